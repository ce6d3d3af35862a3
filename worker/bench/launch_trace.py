"""Where a traced step launch's host time goes: the events the profiler recorded on the host while
the runner's `_run` (the jitted step's call: the batch packed into one array, the arguments handed
to the runtime, the asynchronous launch) was on the stack.

On an H200 that call took ~7 ms (session 42: 7.1 ms a decode call at 128/128, 7.8 at 1024/1024,
5.9 a prefill call) where `bench launch` timed 1.2 ms for a stand-in with the same arguments and
the device idle, so the difference lies in what the real step's launch does. The profiler's host
lines name it: Python frames (`$file:line function`), the runtime's own spans (argument parsing,
`ExecuteHelper...`, waits for buffer holds) and, on a GPU, what the executable does while being
enqueued. Each event's self time (its duration less its children's) is summed by name, so the
nested spans add up to the launch; events on the host's other threads during the launches (a
runtime's worker threads, driver callbacks) are summed apart, clipped to the launch windows.
"""

from __future__ import annotations

import re
from collections import defaultdict

RUN = re.compile(r"runner\.py:\d+ _run$")  # the Python tracer's name for `ModelRunner._run`
TOP = 12  # events listed by self time; other threads' by time inside the launches


def family(name: str) -> str:
    """An op's name without XLA's numbering ("fusion.12", "loop_add_fusion_3" -> "fusion",
    "loop_add_fusion"): one layer's instance of an op is summed with the other layers'."""
    return re.sub(r"([._]\d+)+$", "", name)


def _name(name: str) -> str:
    """An event's family; Python frames (`$file:line function`) as they are."""
    return name if name.startswith("$") else family(name)


def launch_breakdown(events: list[dict], threads: dict[tuple, str]) -> dict | None:
    """Host time inside the traced `_run` calls -> {"calls", "ms_per_call", "self": [...],
    "other_threads": [...]}; None where the trace holds no such call (a profiler without the
    Python tracer)."""
    spans = [e for e in events if e.get("ph") == "X" and RUN.search(e.get("name", ""))]
    if not spans:
        return None
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            by_thread[(e["pid"], e["tid"])].append(e)
    own: dict[str, list] = defaultdict(lambda: [0.0, 0.0, 0])  # name -> [self us, total us, count]
    windows = []
    for run in spans:
        key, start, end = (run["pid"], run["tid"]), float(run["ts"]), float(run["ts"]) + float(run["dur"])
        windows.append((key, start, end))
        inside = sorted((e for e in by_thread[key] if start <= float(e["ts"]) and float(e["ts"]) + float(e["dur"]) <= end),
                        key=lambda e: (float(e["ts"]), -float(e["dur"])))
        _self_times(inside, own)
    others: dict[tuple[str, str], float] = defaultdict(float)
    for key, start, end in windows:
        for other, evs in by_thread.items():
            if other == key:
                continue
            for e in _outermost(evs, start, end):
                a, b = max(start, float(e["ts"])), min(end, float(e["ts"]) + float(e["dur"]))
                others[(threads.get(other, str(other)), _name(e["name"]))] += b - a
    n = len(spans)
    total = sum(end - start for _, start, end in windows)

    def per_call(us: float) -> float:
        return us / 1e3 / n

    return {
        "calls": n, "ms_per_call": per_call(total),
        "self": [{"name": name, "self_ms_per_call": per_call(s), "total_ms_per_call": per_call(t), "per_call": c / n}
                 for name, (s, t, c) in sorted(own.items(), key=lambda item: -item[1][0])[:TOP]],
        "other_threads": [{"thread": thread, "name": name, "ms_per_call": per_call(us)}
                          for (thread, name), us in sorted(others.items(), key=lambda item: -item[1])[:TOP] if us > 0],
    }


def _self_times(inside: list[dict], own: dict[str, list]) -> None:
    """Events of one thread, nested and sorted by start (longer first) -> each one's self time,
    count and total (an event inside one of its own name counted once) added to `own` by name."""
    stack: list[tuple[float, str, list]] = []  # (end, name, [child us])
    totals: list[tuple[str, float, list, bool]] = []
    for e in inside:
        ts, dur, name = float(e["ts"]), float(e["dur"]), _name(e["name"])
        while stack and stack[-1][0] <= ts:
            stack.pop()
        children = [0.0]
        if stack:
            stack[-1][2][0] += dur
        nested = any(n == name for _, n, _ in stack)  # inside an event of its own name: its total counts once
        stack.append((ts + dur, name, children))
        totals.append((name, dur, children, nested))
    for name, dur, children, nested in totals:
        entry = own[name]
        entry[0] += dur - children[0]
        entry[1] += 0.0 if nested else dur
        entry[2] += 1


def _outermost(events: list[dict], start: float, end: float) -> list[dict]:
    """The events of one thread overlapping [start, end] that no other such event contains."""
    hits = sorted((e for e in events if float(e["ts"]) < end and float(e["ts"]) + float(e["dur"]) > start),
                  key=lambda e: (float(e["ts"]), -float(e["dur"])))
    out, reach = [], float("-inf")
    for e in hits:
        if float(e["ts"]) + float(e["dur"]) <= reach:
            continue
        out.append(e)
        reach = max(reach, float(e["ts"]) + float(e["dur"]))
    return out


def lines(launch: dict, unit: str) -> list[str]:
    """The text report's lines for one window's launches."""
    out = [f"  launch (the step's call on the host): {launch['ms_per_call']:.2f} ms per {unit} over "
           f"{launch['calls']} calls; self time by event:"]
    for r in launch["self"]:
        out.append(f"  {r['self_ms_per_call']:>8.3f} ms self {r['total_ms_per_call']:>8.3f} ms total "
                   f"{r['per_call']:>7.1f}/{unit:<4}  {r['name'][:80]}")
    for r in launch["other_threads"][:5]:
        out.append(f"  {r['ms_per_call']:>8.3f} ms on {r['thread'][:30]}: {r['name'][:60]}")
    return out
