"""The serving report's latency figures, and the load generator's footprint on the machine it shares."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest

from worker.bench.serve import Result
from worker.bench.stats import distribution, percentile, summarize


@pytest.mark.parametrize("n", [1, 2, 3, 10, 257])
def test_percentiles_match_numpys_default_interpolation(n):
    rng = random.Random(n)
    values = [rng.expovariate(20.0) for _ in range(n)]
    qs = (0.1, 1.0, 25.0, 50.0, 90.0, 99.0, 99.9, 100.0)
    d = distribution(values, qs)
    ms = np.asarray(values) * 1e3
    assert d["mean_ms"] == pytest.approx(float(ms.mean()), rel=1e-12)
    for q in qs:
        assert d[f"p{q:g}_ms"] == pytest.approx(float(np.percentile(ms, q)), rel=1e-12, abs=1e-12), q


def test_percentile_of_ordered_values_interpolates_between_ranks():
    assert percentile([10.0, 20.0], 50) == 15.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([7.0], 99.9) == 7.0


def test_the_load_generator_never_imports_numpy():
    """numpy's import starts OpenBLAS's threads, which spin for tens of milliseconds of CPU: on a
    small machine that is taken from the server under test as a run begins."""
    code = (
        "import sys\n"
        "from worker.bench import cli, serve, stats, prompts\n"
        "import tqdm, aiohttp, uvloop\n"
        "r = serve.Result(ok=True, ttft=0.01, e2e=0.1, itl=[0.02, 0.03], prompt_tokens=5, output_tokens=3)\n"
        "stats.summarize([r, r], 1.0, {'ttft': 50.0})\n"
        "print('numpy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_summary_without_measurements_reports_none_not_zero():
    failed = Result(ok=False, error="HTTP 500")
    report = summarize([failed], 1.0, {})
    assert report["ttft"] == {"mean_ms": None, "p50_ms": None, "p90_ms": None, "p99_ms": None}
    assert report["completed"] == 0 and report["failed"] == 1


def test_requests_that_stream_no_text_have_no_ttft_not_a_ttft_of_zero():
    """A model whose tokens decode to nothing (ids past its tokenizer's vocabulary: random weights
    over a padded vocab) streams chunks without text. Such a request has no TTFT or TPOT: they leave
    it out of their figures (session 76: counted as 0 ms they read p50 TTFT 0.0 at saturation), the
    report counts it, and for goodput its first text came no sooner than its end."""
    import asyncio

    from worker.bench.serve import _read_stream
    from worker.bench.serve_cli import _summary

    class Content:
        async def iter_any(self):
            yield b'data: {"choices": [{"text": ""}]}\n\ndata: {"choices": [{"text": ""}]}\n\n'
            yield b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}\n\ndata: [DONE]\n\n'

    silent = Result(start=0.0)
    asyncio.run(_read_stream(Content(), silent))
    assert silent.ttft is None and silent.tpot is None and silent.output_tokens == 2 and not silent.itl
    silent.ok, silent.e2e = True, 0.5
    talking = Result(ok=True, ttft=0.1, e2e=0.4, prompt_tokens=4, output_tokens=4)
    report = summarize([silent, talking], 1.0, {"ttft": 300.0})
    assert report["no_text_requests"] == 1
    assert report["ttft"]["p50_ms"] == pytest.approx(100.0) and report["tpot"]["p50_ms"] == pytest.approx(100.0)
    assert report["good_requests"] == 1  # the silent one's 500 ms to its end misses a 300 ms TTFT
    assert summarize([silent, talking], 1.0, {"ttft": 600.0})["good_requests"] == 2
    assert "streamed no text: 1 of the requests" in _summary({**report, "request_rate": None, "concurrency": None})
