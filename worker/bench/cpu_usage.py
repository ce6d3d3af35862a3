"""Where a benchmark run's CPU went (Linux /proc): each process of interest, its XLA compute threads
apart from its other threads, and the time the machine's cores sat idle.

On a small machine shared by the engine, the API and the load generator, the serving path costs
the engine more than the others' own CPU: whatever leaves a core idle while work waits shows up
here as idle core-seconds. `bench stack` reports both halves of a pair this way, so the gap
between serving and offline can be read off by where it went (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

COMPUTE_THREADS = "tf_XLAEigen"  # name prefix of XLA CPU's intra-op pool: the engine's compute threads
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


@dataclass(frozen=True)
class Snapshot:
    at: float  # time.monotonic()
    idle_s: float  # idle + iowait seconds so far, summed over the machine's cores
    cpu_s: dict[str, float]  # role (or "<role> compute" / "<role> other") -> CPU seconds of its live threads


def take(roles: dict[str, list[int]]) -> Snapshot | None:
    """CPU so far of each role's processes (role -> pids), split into compute and other threads
    where a role has compute threads; None where /proc/stat is not there (not Linux)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()  # "cpu user nice system idle iowait ..."
    except OSError:
        return None
    cpu_s: dict[str, float] = {}
    for role, pids in roles.items():
        threads = [t for pid in pids for t in _threads(pid)]
        computes = any(name.startswith(COMPUTE_THREADS) for name, _ in threads)
        for name, seconds in threads:
            key = role if not computes else f"{role} {'compute' if name.startswith(COMPUTE_THREADS) else 'other'}"
            cpu_s[key] = cpu_s.get(key, 0.0) + seconds
    return Snapshot(time.monotonic(), (int(fields[4]) + int(fields[5])) * _TICK_S, cpu_s)


def between(before: Snapshot | None, after: Snapshot | None) -> dict | None:
    """Core-seconds from `before` to `after`: each role's threads, the machine's idle time, and the
    rest (processes not named, the kernel). A thread that ended in between is counted in the rest."""
    if before is None or after is None:
        return None
    wall = after.at - before.at
    cores = os.cpu_count() or 1
    used = {k: round(max(0.0, v - before.cpu_s.get(k, 0.0)), 3) for k, v in after.cpu_s.items()}
    idle = max(0.0, after.idle_s - before.idle_s)
    return {"wall_s": round(wall, 3), "cores": cores, "idle_core_s": round(idle, 3), "by_thread_group": used,
            "rest_core_s": round(max(0.0, wall * cores - idle - sum(used.values())), 3)}


def describe(usage: dict | None) -> str:
    """One line: the thread groups, largest first, then the rest and the idle time."""
    if usage is None:
        return "CPU breakdown not available on this system"
    parts = [kv for kv in sorted(usage["by_thread_group"].items(), key=lambda kv: -kv[1]) if kv[1] >= 0.005]
    parts += [("rest", usage["rest_core_s"]), ("idle", usage["idle_core_s"])]
    total = usage["wall_s"] * usage["cores"]
    return (f"core-s of {total:.2f} ({usage['cores']} cores x {usage['wall_s']:.2f} s): "
            + ", ".join(f"{name} {seconds:.2f}" for name, seconds in parts))


def children(pid: int, argument: str | None = None) -> list[int]:
    """The processes whose parent is `pid` (and, if given, with `argument` among their arguments)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != pid:
                    continue
                if argument is None or argument.encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
    return found


def _threads(pid: int) -> list[tuple[str, float]]:
    """(thread name, CPU seconds) of each live thread of `pid`."""
    out = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        rest = stat[stat.rindex(")") + 2 :].split()  # fields from the 3rd: state, ppid, ...
        out.append((name, (int(rest[11]) + int(rest[12])) * _TICK_S))  # utime, stime
    return out
