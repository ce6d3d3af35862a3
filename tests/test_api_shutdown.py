"""The API shuts down when asked: open responses and streams finish first (within
`shutdown_grace_s`), a cancellation redis-py swallowed does not hang it, and a port it cannot bind
ends `redjax api` and `redjax serve` with an error instead of a process that hangs."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from api.config import ApiConfig
from api.services import ApiServices
from tests.api_support import (  # noqa: F401 (fixtures)
    MODEL_NAME, FakeWorker, api_server, eventually, tiny_model, tiny_model_dir,
)
from worker import contract
from tests.conftest import free_port
from tests.stack_support import REPO, _env, make_served_model


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_served_model(tmp_path_factory.mktemp("model"))


def test_stop_ends_background_tasks_that_swallow_a_cancel(redis_url):
    """redis-py 8 can swallow a cancellation that lands inside one of its calls (70 of 100 cancels
    of a task looping on SMEMBERS, session 49); the task then runs on to its next wait. `stop`
    cancels each task again until it has ended."""

    async def swallows_the_first_cancel():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass  # what redis-py did with it
        await asyncio.sleep(3600)

    async def scenario():
        services = ApiServices.create(ApiConfig(model_dir="unused", redis_url=redis_url), model=None)
        await services.start()
        services.tasks.append(asyncio.create_task(swallows_the_first_cancel()))
        await asyncio.sleep(0.05)  # every task is waiting
        await asyncio.wait_for(services.stop(), 10)
        return services.tasks

    tasks = asyncio.run(scenario())
    assert all(task.done() for task in tasks)


@pytest.mark.parametrize("command", ["api", "serve"])
def test_a_port_in_use_ends_the_command_with_an_error(model, redis_url, command):
    """Another server on the port: `redjax api` exits with uvicorn's startup failure (it used to
    hang: its shutdown waited on a fleet-watch poll that had swallowed its cancel, and it ignored
    SIGTERM), and `redjax serve` says so before it starts any worker or Redis."""
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        argv = [sys.executable, "-m", "worker.cli", command, "--model", str(model), "--port", str(port)]
        if command == "api":
            argv += ["--redis", redis_url]
        started = time.monotonic()
        out = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode != 0, out.stderr[-2000:]
    assert "address already in use" in out.stderr.lower() and "Traceback" not in out.stderr
    if command == "serve":
        assert out.returncode == 1 and f"cannot serve the API on 127.0.0.1:{port}" in out.stderr
        assert "redjax: API" not in out.stdout and "worker" not in out.stderr  # nothing was started
    print(f"{command} exited {out.returncode} after {time.monotonic() - started:.1f} s")


def test_sigterm_lets_open_streams_and_responses_finish(redis_client, redis_url, tiny_model_dir, tiny_model):
    """SIGTERM to `redjax api` while a stream and a plain request are under way (a worker sends a
    token every 0.15 s): both finish, the stream with its last chunk and [DONE], and the process
    exits 0. sse-starlette used to end every stream at the signal (the client saw the connection
    drop) and the run's requests were withdrawn."""
    port = free_port()
    api = subprocess.Popen([sys.executable, "-m", "worker.cli", "api", "--model", str(tiny_model_dir), "--redis",
                            redis_url, "--port", str(port), "--served-model-name", MODEL_NAME], cwd=REPO, env=_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 32}
    try:
        deadline = time.monotonic() + 60
        while not _answers(f"http://127.0.0.1:{port}/health"):
            assert api.poll() is None and time.monotonic() < deadline, api.stderr.read()[-2000:]
            time.sleep(0.1)
        with FakeWorker(redis_url, tiny_model.tokenizer, MODEL_NAME, delay_s=0.15), ThreadPoolExecutor(1) as pool:
            plain = pool.submit(httpx.post, url, json=body, timeout=30)
            chunks = []
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        chunks.append(line.removeprefix("data: "))
                        if len(chunks) == 1:
                            api.send_signal(signal.SIGTERM)  # a stream open, its first token out
            answer = plain.result()
        out, err = api.communicate(timeout=30)
    finally:
        if api.poll() is None:
            api.kill()
            api.wait()
    assert chunks[-1] == "[DONE]", chunks[-3:]
    texts = [json.loads(c)["choices"][0] for c in chunks[:-1]]
    assert texts[-1]["finish_reason"] == "stop" and len(texts) > 5  # every token of the reply, then the end
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "stop"
    assert api.returncode == 0, err[-2000:]


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_an_api_keeps_its_alive_key_while_it_runs_and_removes_it_when_it_stops(redis_client, redis_url,
                                                                              tiny_model_dir, tiny_model):
    """Workers drop the requests of an API process whose alive key is gone (it died: nobody is left
    to read them). The enqueue sets the key with the requests, the fleet watch keeps it (and sets
    it again when Redis has lost it), and a clean stop deletes it."""
    with api_server(redis_url, tiny_model_dir, tiny_model) as server:
        assert not redis_client.keys("*:alive")  # an API that has queued nothing writes no key
        with FakeWorker(redis_url, tiny_model.tokenizer, MODEL_NAME) as worker:
            body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3}
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
        key = contract.api_alive_key(worker.seen[0].notify)
        assert 0 < redis_client.ttl(key) <= contract.API_ALIVE_TTL_S
        redis_client.expire(key, 3)
        assert eventually(lambda: redis_client.ttl(key) > 3)  # refreshed while the process runs
        redis_client.delete(key)  # as a Redis that restarted empty has lost it
        assert eventually(lambda: redis_client.exists(key))  # set again, before workers think us dead
    assert not redis_client.exists(key)
