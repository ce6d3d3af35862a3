"""Shared by the `redjax bench` tests: run a bench mode in-process, check a serving report."""

from __future__ import annotations

import contextlib
import io

from worker.bench.cli import run


def run_bench(*argv: str) -> tuple[int, str]:
    """`redjax bench MODE ARGS...` in this process -> (exit code, stdout)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = run(argv[0], list(argv[1:]))
    return code, buf.getvalue()


def check_serve_report(r: dict, n: int) -> None:
    """n requests, all completed, each of 8 output tokens (ignore_eos), with ordered percentiles."""
    assert r["num_requests"] == r["completed"] == n and r["failed"] == 0
    assert r["output_tokens"] == n * 8  # ignore_eos: every request runs to max_tokens, counted from usage
    assert r["request_throughput"] > 0 and r["output_token_throughput"] > 0
    for key in ("ttft", "tpot", "itl", "e2e"):
        d = r[key]
        if key == "itl" and d["p50_ms"] is None:  # every stream's tokens came in one event: no gap to time
            assert set(d.values()) == {None} and r["itl"] == {k: None for k in r["e2e"]}
            continue
        assert 0 < d["p50_ms"] <= d["p90_ms"] <= d["p99_ms"], key
    assert r["ttft"]["p99_ms"] <= r["e2e"]["p99_ms"]
