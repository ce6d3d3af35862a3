"""Latency percentiles, throughput and goodput of a finished serving run.

Plain Python, no numpy: the load generator usually shares the machine with the server it
measures, and importing numpy starts OpenBLAS's thread pool, whose threads spin for ~65 ms of CPU
before they sleep (session 48: a second core taken from the server in the first 0.1 s of a run).
"""

from __future__ import annotations

import math

PERCENTILES = (50.0, 90.0, 99.0)


def percentile_key(q: float) -> str:
    """50 -> "p50_ms", 99.9 -> "p99.9_ms"."""
    return f"p{q:g}_ms"


def distribution(values_s: list[float], percentiles: tuple[float, ...] = PERCENTILES) -> dict[str, float | None]:
    """Mean and percentiles, in milliseconds; with no values, None each (no request measured it: every
    request failed, or none had two output tokens for a TPOT), not a latency of zero."""
    if not values_s:
        return {"mean_ms": None, **{percentile_key(q): None for q in percentiles}}
    ms = sorted(v * 1e3 for v in values_s)
    return {"mean_ms": math.fsum(ms) / len(ms), **{percentile_key(q): percentile(ms, q) for q in percentiles}}


def percentile(ordered: list[float], q: float) -> float:
    """The q-th percentile of ascending values, interpolated linearly between the two nearest ranks
    (numpy's default method)."""
    rank = (len(ordered) - 1) * q / 100.0
    below = math.floor(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


def summarize(results: list, seconds: float, slo_ms: dict[str, float],
              percentiles: tuple[float, ...] = PERCENTILES) -> dict:
    """`slo_ms` keys: "ttft", "tpot", "e2e" (milliseconds); goodput counts requests meeting all of them."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)

    def meets(r) -> bool:
        # no text at all: the client had its first text no sooner than the end
        values = {"ttft": r.e2e if r.ttft is None else r.ttft, "tpot": r.tpot or 0.0, "e2e": r.e2e}
        return all(values[k] * 1e3 <= v for k, v in slo_ms.items())

    good = [r for r in ok if meets(r)]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": seconds, "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        # prompt tokens the server's prefix cache served (None: its usage does not say)
        "cached_prompt_tokens": sum(cached) if cached else None,
        "request_throughput": len(ok) / seconds, "output_token_throughput": out_tokens / seconds,
        "total_token_throughput": (in_tokens + out_tokens) / seconds,
        # requests that streamed no text have no TTFT (nor TPOT): left out, and counted here
        "no_text_requests": sum(r.ttft is None for r in ok),
        "ttft": distribution([r.ttft for r in ok if r.ttft is not None], percentiles),
        "tpot": distribution([r.tpot for r in ok if r.tpot is not None], percentiles),
        "itl": distribution([g for r in ok for g in r.itl], percentiles),
        "e2e": distribution([r.e2e for r in ok], percentiles),
        "slo_ms": slo_ms, "good_requests": len(good), "goodput": len(good) / seconds,
    }
