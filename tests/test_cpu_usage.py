"""worker/bench/cpu_usage: CPU seconds by process and thread group from /proc, as `bench stack`
reports them. Thread CPU is what the kernel counted, so the checks hold on a loaded machine too."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time

from worker.bench import cpu_usage


class _Spender(threading.Thread):
    """A thread that names itself (the OS name /proc shows), then on `go` spends `cpu_s` seconds of
    its own CPU and stays alive until `done`, so both snapshots see it."""

    def __init__(self, name: bytes, cpu_s: float) -> None:
        super().__init__()
        self.os_name, self.cpu_s = name, cpu_s
        self.named, self.go, self.spent, self.done = (threading.Event() for _ in range(4))

    def run(self) -> None:
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(self.os_name), 0, 0, 0)  # PR_SET_NAME
        self.named.set()
        self.go.wait()
        start = time.thread_time()
        while time.thread_time() - start < self.cpu_s:
            sum(range(1000))
        self.spent.set()
        self.done.wait()


def test_compute_threads_are_counted_apart_from_the_process_other_threads():
    roles = {"engine": [os.getpid()]}
    compute = _Spender(cpu_usage.COMPUTE_THREADS.encode() + b"-t", 0.3)
    host = _Spender(b"host-t", 0.1)
    for t in (compute, host):
        t.start()
        t.named.wait()
    before = cpu_usage.take(roles)
    for t in (compute, host):
        t.go.set()
        t.spent.wait()
    usage = cpu_usage.between(before, cpu_usage.take(roles))
    for t in (compute, host):
        t.done.set()
        t.join()
    groups = usage["by_thread_group"]
    assert 0.25 <= groups["engine compute"] < 0.3 + 0.3  # its 0.3 s at the kernel's tick resolution
    assert groups["engine other"] >= 0.05  # the host thread's 0.1 s (and the main thread's waits)
    assert usage["cores"] == os.cpu_count() and usage["wall_s"] > 0
    assert usage["idle_core_s"] >= 0 and usage["rest_core_s"] >= 0
    line = cpu_usage.describe(usage)
    assert line.startswith("core-s of ") and "engine compute" in line and "idle" in line


_CHILD = """
import sys, time
sys.stdin.readline()
start = time.process_time()
while time.process_time() - start < 0.1:
    sum(range(1000))
print("spent", flush=True)
sys.stdin.readline()
"""


def test_a_role_without_compute_threads_is_one_group():
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        roles = {"API": [child.pid]}  # a plain Python process: no thread named as XLA's pool
        before = cpu_usage.take(roles)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "spent\n"
        usage = cpu_usage.between(before, cpu_usage.take(roles))
    finally:
        child.kill()
        child.wait()
    assert set(usage["by_thread_group"]) == {"API"} and usage["by_thread_group"]["API"] >= 0.05


def test_children_and_missing_inputs():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in cpu_usage.children(os.getpid())
        assert child.pid in cpu_usage.children(os.getpid(), "-c")  # its arguments: python -c CODE
        assert child.pid not in cpu_usage.children(os.getpid(), "worker")
        assert cpu_usage.take({"gone": [2**22 + 12345]}).cpu_s == {}  # a process that is gone: no threads
    finally:
        child.kill()
        child.wait()
    assert cpu_usage.between(None, None) is None
    assert cpu_usage.describe(None) == "CPU breakdown not available on this system"
