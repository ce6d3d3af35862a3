"""The API shuts down when asked, even where redis-py swallowed a cancellation, and a port it
cannot bind ends `redjax api` and `redjax serve` with an error instead of a process that hangs."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from api.config import ApiConfig
from api.services import ApiServices
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
