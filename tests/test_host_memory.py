"""worker/host_memory.py in a process of its own: with the CLI's settings freed memory stays in the
process (a step's temporaries are reused, not faulted in again), until the engine's builders hand
back what loading freed."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json
from worker.host_memory import hand_back_freed_memory, retain_freed_memory
import numpy as np

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

retained = retain_freed_memory()
start = rss()
blocks = [np.ones(2**22) for _ in range(32)]  # 1 GiB in 32 MiB blocks, as a load's temporaries
del blocks
kept = rss()
handed = hand_back_freed_memory()
print(json.dumps({"retained": retained, "handed": handed, "kept": kept - start, "after": rss() - start}))
"""


def test_freed_memory_stays_in_the_process_until_handed_back():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout
    r = json.loads(out)
    assert r["retained"] and r["handed"]
    assert r["kept"] > 0.9 * 2**30  # freed, but still the process's: malloc keeps it for reuse
    assert r["after"] < 0.1 * 2**30, r  # handed back to the OS
