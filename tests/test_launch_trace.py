"""The host time of a traced step launch, event by event (worker/bench/launch_trace.py), on a
trace written here: self times add up to the launch, a span nested in one of its own name counts
once in its total, and other host threads count only inside the launch windows."""

from __future__ import annotations

import pytest

from worker.bench.launch_trace import launch_breakdown, lines

THREADS = {(2, 1): "python", (2, 9): "gpu_driver"}


def x(name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "name": name, "pid": 2, "tid": tid, "ts": ts, "dur": dur}


def one_launch(t0: float) -> list[dict]:
    """A 1000 us launch: the batch packed (100 us, 60 in a list comprehension), then the jitted
    call (800 us, nested in itself as the runtime names it twice), the executable's enqueue (500)
    with a 320 us wait inside it."""
    return [x("$runner.py:158 _run", t0, 1000),
            x("$batch.py:199 pack", t0 + 10, 100), x("$batch.py:207 <listcomp>", t0 + 20, 60),
            x("PjitFunction(jit(_step))", t0 + 150, 800), x("PjitFunction(jit(_step))", t0 + 155, 790),
            x("ExecuteHelper", t0 + 200, 500), x("Wait for donation holds", t0 + 300, 320)]


def test_self_times_add_up_to_the_launch():
    events = one_launch(0) + one_launch(5000) + [
        x("$llm_engine.py:229 _postprocess", 2000, 900),  # the same thread outside a launch: not counted
        x("cuLaunchKernel.3", 900, 300, tid=9),  # another thread: 100 us of it inside the first launch
        x("cuLaunchKernel.7", 5100, 50, tid=9), x("inner", 5110, 20, tid=9)]  # nested: counted once
    b = launch_breakdown(events, THREADS)
    assert b["calls"] == 2 and b["ms_per_call"] == pytest.approx(1.0)
    rows = {r["name"]: r for r in b["self"]}
    assert "$llm_engine.py:229 _postprocess" not in rows
    assert sum(r["self_ms_per_call"] for r in b["self"]) == pytest.approx(1.0)
    assert rows["Wait for donation holds"]["self_ms_per_call"] == pytest.approx(0.32)
    assert rows["ExecuteHelper"]["self_ms_per_call"] == pytest.approx(0.18)
    assert rows["$batch.py:199 pack"]["self_ms_per_call"] == pytest.approx(0.04)
    # the jitted call: 800 us in all (not 1590), 10 + 290 us its own
    assert rows["PjitFunction(jit(_step))"] == pytest.approx(
        {"name": "PjitFunction(jit(_step))", "self_ms_per_call": 0.3, "total_ms_per_call": 0.8, "per_call": 2.0})
    assert rows["$runner.py:158 _run"]["self_ms_per_call"] == pytest.approx(0.1)
    assert b["self"][0]["name"] == "Wait for donation holds"
    assert b["other_threads"] == [{"thread": "gpu_driver", "name": "cuLaunchKernel", "ms_per_call": pytest.approx(0.075)}]
    text = "\n".join(lines(b, "call"))
    assert "1.00 ms per call over 2 calls" in text and "gpu_driver" in text


def test_a_trace_without_the_python_tracer_has_no_breakdown():
    assert launch_breakdown([x("PjitFunction(jit(_step))", 0, 100)], THREADS) is None
