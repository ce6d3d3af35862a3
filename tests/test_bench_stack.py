"""`redjax bench stack`: the embedded stack (`redjax serve`) against the engine alone, in pairs."""

from __future__ import annotations

import json
import os

import pytest

from tests.bench_support import check_serve_report, run_bench
from tests.stack_support import make_served_model


def test_stack_pairs_the_embedded_stack_with_the_engine_alone(tmp_path):
    """`bench stack` runs `redjax serve` (embedded Redis, API, worker) and `bench offline` in
    alternating pairs. The offline run gets the serving prompts, tokenized as the API tokenizes
    them (the model's own tokenizer, transformers), and the ratios are those of the pairs' figures."""
    import statistics

    import transformers

    from worker.bench.prompts import random_prompts

    model = make_served_model(tmp_path / "served")
    code, out = run_bench("stack", "--model", str(model), "--pairs", "2", "--num-prompts", "4", "--input-len", "6",
                          "--output-len", "8", "--seed", "3", "--json", "--max-num-seqs", "8",
                          "--max-num-batched-tokens", "128", "--page-size", "8", "--num-pages", "128")
    assert code == 0, out
    report = json.loads(out)
    assert [p["first"] for p in report["pairs"]] == ["serve", "offline"]
    for p in report["pairs"]:
        assert p["serve_failed"] == 0
        assert p["offline_prompt_tokens"] == p["serve_prompt_tokens"]  # the same prompts, token for token
        assert p["ratio"] == pytest.approx(p["serve_output_tokens_per_s"] / p["offline_output_tokens_per_s"])
        # where the CPU went: the worker's XLA compute threads apart from its others, the API, this
        # process (the load generator, split into compute and other where a test imported jax);
        # offline, the engine's own process. A run this short may take under one clock tick of a thread.
        serve, offline = p["serve_cpu"]["by_thread_group"], p["offline_cpu"]["by_thread_group"]
        assert {"API", "worker compute", "worker other"} <= set(serve)
        assert {k for k in serve if k.startswith("load generator")} in ({"load generator"},
                                                                       {"load generator compute", "load generator other"})
        assert set(offline) == {"engine compute", "engine other"}
        assert min(serve.values()) >= 0 and min(offline.values()) >= 0
        # read from the stack's /metrics around the measured run (compiles there are counted below)
        assert isinstance(p["serve_step_compiles"], int) and p["serve_step_compiles"] >= 0
        assert p["serve_compile_stall_s"] >= 0
        for usage in (p["serve_cpu"], p["offline_cpu"]):
            assert usage["idle_core_s"] >= 0 and usage["rest_core_s"] >= 0 and usage["cores"] == os.cpu_count()
    assert report["median_ratio"] == pytest.approx(statistics.median(p["ratio"] for p in report["pairs"]))
    assert report["engine_flags"] == ["--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--page-size", "8",
                                      "--num-pages", "128"]
    check_serve_report(report["last_serve_report"], 4)
    tok = transformers.AutoTokenizer.from_pretrained(str(model))
    counts = [len(tok(p)["input_ids"]) for p in random_prompts(4, 6, seed=3)]  # the first pair's prompts
    assert report["prompt_tokens_per_request"] == round(sum(counts) / len(counts))


def test_stack_serves_a_dummy_preset_through_its_word_tokenizer():
    """`bench stack --dummy PRESET` writes random weights and a word tokenizer to a temporary
    directory and serves them like any model: every serving prompt word is one token. With
    --range-ratio each request has its own length in and out, and the offline half runs the same
    requests: as many prompt and output tokens as were served (--prefix-len words before each)."""
    from worker.bench.prompts import random_workload

    code, out = run_bench("stack", "--dummy", "llama-tiny", "--pairs", "1", "--num-prompts", "4", "--input-len", "6",
                          "--output-len", "8", "--range-ratio", "0.5", "--prefix-len", "3", "--json", "--max-num-seqs", "8",
                          "--max-num-batched-tokens", "128", "--page-size", "8", "--num-pages", "128")
    assert code == 0, out
    report = json.loads(out)
    assert report["model"] == "dummy:llama-tiny" and report["range_ratio"] == 0.5 and report["prefix_words"] == 3
    requests = random_workload(4, 6, 8, 0.5, seed=0, prefix_len=3)  # the first pair's
    words, outs = sum(len(p.text.split()) for p in requests), sum(p.output_len for p in requests)
    assert len({p.output_len for p in requests}) > 1
    pair = report["pairs"][0]
    assert pair["serve_prompt_tokens"] == pair["offline_prompt_tokens"] == words
    assert pair["serve_output_tokens"] == pair["offline_output_tokens"] == outs
    assert report["prompt_tokens_per_request"] == round(words / 4)
    assert pair["serve_failed"] == 0 and pair["offline_output_tokens_per_s"] > 0
    assert pair["serve_cached_prompt_tokens"] == pair["offline_cached_prompt_tokens"] == 0  # 3 words: under a page
    r = report["last_serve_report"]
    assert r["completed"] == 4 and r["failed"] == 0 and r["output_tokens"] == outs


def test_stack_refuses_an_unknown_preset_before_starting_anything(capsys):
    with pytest.raises(SystemExit) as exit_:
        run_bench("stack", "--dummy", "no-such-preset", "--pairs", "1")
    assert exit_.value.code == 2
    assert "unknown preset 'no-such-preset'" in capsys.readouterr().err


def test_stack_with_workers_pins_each_and_runs_as_many_engines_offline():
    """`--workers 2`: redjax serve starts two workers, each on its own cores, and waits for both;
    the offline half runs two engines on every other prompt, on the same cores, timed together:
    between them they run every prompt and write as many tokens as were served."""
    code, out = run_bench("stack", "--dummy", "llama-tiny", "--pairs", "1", "--num-prompts", "6", "--input-len", "6",
                          "--output-len", "8", "--workers", "2", "--json", "--max-num-seqs", "4",
                          "--max-num-batched-tokens", "64", "--page-size", "8", "--num-pages", "64")
    assert code == 0, out
    report = json.loads(out)
    pair = report["pairs"][0]
    assert report["workers"] == 2 and pair["serve_failed"] == 0
    assert pair["serve_output_tokens"] == pair["offline_output_tokens"] == 6 * 8
    assert pair["serve_prompt_tokens"] == pair["offline_prompt_tokens"]
    engines = pair["offline_engines"]
    assert len(engines) == 2 and all(e["seconds"] > 0 and e["output_tokens_per_s"] > 0 for e in engines)
    # all output tokens over the longest engine's round
    assert pair["offline_output_tokens_per_s"] == pytest.approx(48 / max(e["seconds"] for e in engines))
    assert {"engine compute", "engine other"} <= set(pair["offline_cpu"]["by_thread_group"])  # both engines' threads


def test_stack_refuses_no_workers_and_more_workers_than_prompts(capsys):
    with pytest.raises(SystemExit) as exit_:
        run_bench("stack", "--workers", "0")
    assert exit_.value.code == 2 and "--workers must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        run_bench("stack", "--workers", "3", "--num-prompts", "2")
    assert exit_.value.code == 2 and "--workers must not exceed --num-prompts" in capsys.readouterr().err


def test_offline_engines_stop_together_when_one_fails(tmp_path):
    """One engine of a data-parallel offline half that fails (here: no prompt left for it) stops
    the others, which would wait for it at the barrier, and the failure is its own."""
    from worker.bench.stack import StackRun, _offline_once

    model = make_served_model(tmp_path / "served")
    run = StackRun(str(model), 1, 6, 8, 1, 0, (), workers=2, offline_argv=("--max-num-seqs", "4", "--num-pages", "64",
                                                                         "--page-size", "8"))
    with pytest.raises(RuntimeError, match=r"(?s)bench offline exited 2: .*error: --num-prompts"):
        _offline_once(run, seed=0)


def test_stack_counts_what_the_workers_compiled_during_the_measured_run(redis_client, redis_url):
    """The serving half reads the fleet's compile counters from /metrics before the run and again
    once every worker has sent a heartbeat after it: a run that compiled says so."""
    import threading
    import time

    from dashboard.app import create_dashboard
    from dashboard.config import DashboardConfig
    from tests.test_dashboard_live import seed_worker, serve_app
    from worker import contract
    from worker.bench.stack import _compiles, _compiles_since

    seed_worker(redis_client, "w0", updated_at=time.time() - 0.9)
    redis_client.hincrby(contract.TOTALS, contract.TOTAL_STEP_COMPILES, 4)  # before the run: not counted
    with serve_app(create_dashboard(DashboardConfig(redis_url=redis_url))) as base:
        before = _compiles(base)
        assert before[:2] == (4.0, 0.0) and before[2] >= 0.9
        ended = time.monotonic()
        redis_client.hincrby(contract.TOTALS, contract.TOTAL_STEP_COMPILES, 2)  # the run's, not yet beaten

        def heartbeat_later():  # the worker's next heartbeat, which adds the stall
            time.sleep(0.5)
            redis_client.hincrbyfloat(contract.TOTALS, contract.TOTAL_COMPILE_STALL_S, 0.75)
            seed_worker(redis_client, "w0")

        beat = threading.Thread(target=heartbeat_later)
        beat.start()
        try:
            assert _compiles_since(base, before, ended) == (2, 0.75)
        finally:
            beat.join()
        assert _compiles_since(base, None, ended) == (None, None)  # a stack without /metrics
