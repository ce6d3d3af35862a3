"""worker/host_memory.py in a process of its own: with the CLI's settings freed memory stays in the
process (a step's temporaries are reused, not faulted in again), except while a model loads, whose
large blocks go back to the OS as they are freed, as does what the load left free once it ends."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json
from worker.host_memory import hand_back_freed_memory, loading, retain_freed_memory
import numpy as np

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

def churn():  # 1 GiB in 32 MiB blocks allocated and freed, as a load's or a step's temporaries
    blocks = [np.ones(2**22) for _ in range(32)]
    del blocks

r = {"retained": retain_freed_memory()}
start = rss()
churn()
r["kept"] = rss() - start  # freed, but still the process's: malloc keeps it for reuse
r["handed"] = hand_back_freed_memory()
r["handed_back"] = rss() - start
with loading():
    churn()
    r["while_loading"] = rss() - start  # each block unmapped as it was freed
r["after_loading"] = rss() - start
churn()
r["kept_again"] = rss() - start
print(json.dumps(r))
"""


def test_freed_memory_stays_in_the_process_except_while_loading():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout
    r = json.loads(out)
    assert r["retained"] and r["handed"]
    assert r["kept"] > 0.9 * 2**30, r
    assert r["handed_back"] < 0.1 * 2**30, r
    assert r["while_loading"] < 0.1 * 2**30 and r["after_loading"] < 0.1 * 2**30, r
    assert r["kept_again"] > 0.9 * 2**30, r
