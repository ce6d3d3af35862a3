"""The API holds as many client connections as the host allows, not the shell's soft limit."""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import time

import httpx

from tests.api_support import MODEL_NAME, tiny_model_dir  # noqa: F401 (fixture)
from tests.conftest import free_port
from tests.stack_support import REPO, _env

SOFT = 256  # the soft open-files limit the API is started under (the hard one stays as it is)
CLIENTS = 400


def test_the_api_raises_its_open_files_limit_and_answers_more_connections_than_the_soft_one(redis_url,
                                                                                             tiny_model_dir):
    """Under a soft limit of 256 open files, 400 connections held open at once each get their
    answer. Without raising the limit the API cannot accept past it and the kernel resets the
    rest (1500 requests at once under `ulimit -Sn 1024`: 427 connection resets, none logged)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert hard == resource.RLIM_INFINITY or hard > 2 * CLIENTS, "this host's hard limit is too low for the test"
    port = free_port()
    argv = [sys.executable, "-m", "worker.cli", "api", "--model", str(tiny_model_dir), "--redis", redis_url,
            "--port", str(port), "--served-model-name", MODEL_NAME]
    # the soft limit set by a shell (as `ulimit -Sn` in a terminal), not in a forked copy of this process
    api = subprocess.Popen(["bash", "-c", f'ulimit -Sn {SOFT} && exec "$@"', "api", *argv], cwd=REPO, env=_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert api.poll() is None and time.monotonic() < deadline, api.stderr.read()[-2000:]
            time.sleep(0.1)
        limits = open(f"/proc/{api.pid}/limits").read()
        soft = int(next(line for line in limits.splitlines() if line.startswith("Max open files")).split()[3])
        assert soft > 2 * CLIENTS
        clients = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(CLIENTS)]
        for client in clients:  # every connection open before any is answered
            client.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
        answers = [client.recv(64) for client in clients]
        for client in clients:
            client.close()
    finally:
        api.terminate()
        api.wait(timeout=30)
    assert all(answer.startswith(b"HTTP/1.1 200") for answer in answers), {a[:20] for a in answers}
