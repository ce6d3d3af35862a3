"""`redjax bench`: offline on a tiny random model (with and without the transformers baseline),
and serve against the real stack (API + worker subprocesses, real Redis). No wall-clock thresholds."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hf_models import make_hf_model
from tests.stack_support import make_served_model, start_api, start_worker, stop
from worker.bench import roofline
from worker.bench.cli import offline_parser, run
from worker.models.config import ModelConfig

TINY = ["--num-prompts", "4", "--input-len", "8", "--output-len", "8", "--json"]


def _bench(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = run(argv[0], list(argv[1:]))
    return code, buf.getvalue()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    make_hf_model("llama", path)
    return path


def test_offline_reports_throughput(tiny_model):
    code, out = _bench("offline", "--model", str(tiny_model), *TINY)
    report = json.loads(out)
    assert code == 0
    assert report["output_tokens"] == 4 * 8
    for key in ("output_tokens_per_s", "requests_per_s", "total_tokens_per_s", "memory_bandwidth_gbs",
                "matmul_gflops", "decode_roofline_fraction", "prefill_roofline_fraction", "decode_host_fraction"):
        assert report[key] > 0, key
    assert "ratio" not in report
    # the warm-up's variants were planned and compiled ahead; the measured run compiled none
    startup = report["startup"]
    assert startup["variants_compiled_ahead"] >= 2 and startup["compile_ahead_s"] > 0 and startup["warmup_s"] > 0
    assert report["compiles_during_run"] == 0


def test_offline_plans_the_runs_tail_steps_too(tiny_model):
    """Prompts admitted over 8 prefill steps finish their fused decode steps at different times;
    the last rows' final steps take shapes the warm-up's shorter requests never meet. Planning the
    run itself as well leaves nothing to compile during it (this shape compiled 3 variants)."""
    code, out = _bench("offline", "--model", str(tiny_model), "--num-prompts", "16", "--input-len", "8",
                       "--output-len", "20", "--max-num-batched-tokens", "16", "--max-num-seqs", "16",
                       "--decode-steps", "3", "--json")
    assert code == 0 and json.loads(out)["compiles_during_run"] == 0


def test_offline_compare_hf(tiny_model):
    code, out = _bench("offline", "--model", str(tiny_model), *TINY, "--compare", "hf", "--hf-batch-size", "2")
    report = json.loads(out)
    assert code == 0
    for key in ("output_tokens_per_s", "baseline_output_tokens_per_s", "ratio"):
        assert report[key] > 0, key
    assert report["greedy_match_fraction"] == 1.0  # same weights, same prompts, greedy
    assert report["baseline_batch_size"] == 2 and list(report["baseline_batch_trials"]) == ["2"]


def test_offline_compare_hf_picks_the_fastest_batch_size_by_default(tiny_model):
    code, out = _bench("offline", "--model", str(tiny_model), "--num-prompts", "20", "--input-len", "8",
                       "--output-len", "4", "--json", "--compare", "hf", "--rounds", "2")
    report = json.loads(out)
    assert code == 0
    trials = report["baseline_batch_trials"]  # 16, 32 and 64, capped at the 20 prompts
    assert sorted(map(int, trials)) == [16, 20]
    assert report["baseline_batch_size"] == int(max(trials, key=trials.get))
    assert "batch {}".format(report["baseline_batch_size"]) in report["baseline"]
    assert all(f["greedy_match_fraction"] == 1.0 for f in report["per_round"])
    with pytest.raises(SystemExit):
        offline_parser().parse_args(["--model", "x", "--hf-batch-size", "0"])


def test_offline_compare_hf_on_dummy_weights_gives_transformers_the_engine_weights():
    # the engine packs float32 weights for its matmul kernel; transformers must get them as loaded
    code, out = _bench("offline", "--dummy", "llama-tiny", *TINY, "--compare", "hf", "--hf-batch-size", "2")
    report = json.loads(out)
    assert code == 0 and report["matmul"] == "kernel"
    assert report["greedy_match_fraction"] == 1.0


def test_offline_rounds_alternate_with_the_baseline_and_report_medians(tiny_model):
    code, out = _bench("offline", "--model", str(tiny_model), *TINY, "--compare", "hf", "--hf-batch-size", "2",
                       "--rounds", "3")
    report = json.loads(out)
    assert code == 0 and report["rounds"] == 3 and len(report["per_round"]) == 3
    ratios = sorted(f["ratio"] for f in report["per_round"])
    assert report["ratio"] == ratios[1]
    assert sorted(f["output_tokens_per_s"] for f in report["per_round"])[1] == report["output_tokens_per_s"]
    assert all(f["output_tokens"] == 4 * 8 and f["greedy_match_fraction"] == 1.0 for f in report["per_round"])


def test_offline_text_summary(tiny_model):
    code, out = _bench("offline", "--model", str(tiny_model), *TINY[:-1], "--decode-steps", "1")
    assert code == 0 and "output tokens/s" in out and "host" in out
    assert re.search(r"startup: calibration [\d.]+ s, \d+ step variants compiled ahead in [\d.]+ s", out), out


@pytest.mark.parametrize("tied", [True, False])
def test_roofline_counts_only_the_weights_that_enter_products(tied):
    cfg = dataclasses.replace(ModelConfig.preset("llama-100m"), tie_word_embeddings=tied)
    norms = cfg.num_layers * 2 * cfg.hidden_size + cfg.hidden_size
    table = cfg.vocab_size * cfg.hidden_size  # the embedding lookup reads rows, it multiplies nothing
    assert roofline.matmul_params(cfg) == cfg.num_params - norms - (0 if tied else table)
    assert roofline.prefill_token_flops(cfg) == 2 * (roofline.matmul_params(cfg) - table)
    assert roofline.decode_step_flops(cfg, 64, 0) == 64 * 2 * roofline.matmul_params(cfg)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_url):
    model = make_served_model(tmp_path_factory.mktemp("served"))
    worker = start_worker(model, redis_url, "bench-worker")
    api, url = start_api(model, redis_url)
    yield url
    stop(api)
    stop(worker)


def _check_report(r: dict, n: int) -> None:
    assert r["num_requests"] == r["completed"] == n and r["failed"] == 0
    assert r["output_tokens"] == n * 8  # ignore_eos: every request runs to max_tokens, counted from usage
    assert r["request_throughput"] > 0 and r["output_token_throughput"] > 0
    for key in ("ttft", "tpot", "itl", "e2e"):
        d = r[key]
        assert 0 < d["p50_ms"] <= d["p90_ms"] <= d["p99_ms"], key
    assert r["ttft"]["p99_ms"] <= r["e2e"]["p99_ms"]


def test_serve_concurrency(stack, tmp_path):
    out = tmp_path / "report.json"
    code, text = _bench("serve", "--url", stack, "--num-prompts", "6", "--concurrency", "3", "--input-len", "12",
                        "--output-len", "8", "--goodput", "ttft:600000", "tpot:600000", "--json-out", str(out))
    assert code == 0, text
    report = json.loads(out.read_text())
    _check_report(report, 6)
    assert report["concurrency"] == 3 and report["good_requests"] == 6
    assert "ttft" in text and "p99" in text


def test_serve_sweep_plot(stack, tmp_path):
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    code, text = _bench("serve", "--url", stack, "--num-prompts", "4", "--sweep", "2,inf", "--input-len", "6",
                        "--output-len", "8", "--json-out", str(out), "--plot", str(png),
                        "--percentiles", "99.9,50,99,90")
    assert code == 0, text
    reports = json.loads(out.read_text())
    assert [r["request_rate"] for r in reports] == [2.0, None]
    for r in reports:
        _check_report(r, 4)
        assert list(r["e2e"]) == ["mean_ms", "p50_ms", "p90_ms", "p99_ms", "p99.9_ms"]
        assert r["e2e"]["p99_ms"] <= r["e2e"]["p99.9_ms"]
    assert "p99.9" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serve_sweeps_the_concurrency(stack, tmp_path):
    """Comma-separated --concurrency values sweep it (one run each, a list of reports, a plot)."""
    out, png = tmp_path / "caps.json", tmp_path / "caps.png"
    code, text = _bench("serve", "--url", stack, "--num-prompts", "4", "--concurrency", "1,4", "--input-len", "6",
                        "--output-len", "8", "--json-out", str(out), "--plot", str(png))
    assert code == 0, text
    reports = json.loads(out.read_text())
    assert [(r["request_rate"], r["concurrency"]) for r in reports] == [(None, 1), (None, 4)]
    for r in reports:
        _check_report(r, 4)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serve_counts_rejected_requests_as_failed(stack, tmp_path):
    """A model the server does not serve: every request fails with the server's HTTP error, and
    the report says so instead of inventing latencies."""
    out = tmp_path / "report.json"
    code, text = _bench("serve", "--url", stack, "--model", "no-such-model", "--num-prompts", "3", "--input-len", "4",
                        "--output-len", "4", "--json-out", str(out))
    report = json.loads(out.read_text())
    assert report["completed"] == 0 and report["failed"] == 3
    assert all(e.startswith("HTTP 404") for e in report["errors"]), report["errors"]


def test_serve_chat_endpoint_with_poisson_arrivals_under_a_concurrency_cap(stack, tmp_path):
    """--endpoint chat sends each prompt as one user message to /v1/chat/completions and times the
    deltas' content; a rate and a concurrency together: arrivals wait for a free slot, so no more
    than the cap are ever in flight."""
    out = tmp_path / "report.json"
    code, text = _bench("serve", "--url", stack, "--endpoint", "chat", "--num-prompts", "6", "--request-rate", "200",
                        "--burstiness", "0.5", "--concurrency", "2", "--input-len", "5", "--output-len", "8",
                        "--json-out", str(out))
    assert code == 0, text
    report = json.loads(out.read_text())
    _check_report(report, 6)
    assert (report["endpoint"], report["request_rate"], report["burstiness"], report["concurrency"]) == \
        ("chat", 200.0, 0.5, 2)
    assert report["prompt_tokens"] > 6 * 5  # the chat template's tokens come on top of the words
    assert "rate 200/s, concurrency 2" in text


def test_serve_cap_holds_requests_in_flight_to_the_concurrency(stack):
    from worker.bench.prompts import Prompt
    from worker.bench.serve import Load, run_load, served_model

    load = Load(8, request_rate=1000.0, concurrency=2, output_len=8)
    _, results = asyncio.run(run_load(stack, served_model(stack), [Prompt(f"word {i}") for i in range(8)], load))
    assert all(r.ok for r in results), [r.error for r in results]
    events = sorted([(r.start, 1) for r in results] + [(r.start + r.e2e, -1) for r in results])
    in_flight = list(itertools.accumulate(step for _, step in events))
    assert max(in_flight) == 2  # the 8 arrive within ~10 ms; each takes far longer than that to stream 8 tokens


def test_serve_per_prompt_output_lengths_from_a_jsonl_file_and_random_ranges(stack, tmp_path):
    """JSON lines may give each prompt its own max_tokens; --range-ratio draws random lengths. With
    ignore_eos every request runs to its own length, counted from usage."""
    from worker.bench.prompts import random_prompts, random_workload

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "the river", "max_tokens": 3}\n\n{"prompt": "a stone"}\n'
                       '{"prompt": "light", "max_tokens": 11}\n')
    out = tmp_path / "report.json"
    code, text = _bench("serve", "--url", stack, "--prompts-file", str(prompts), "--num-prompts", "4",
                        "--output-len", "5", "--json-out", str(out))
    assert code == 0, text
    report = json.loads(out.read_text())
    assert report["completed"] == 4 and report["output_tokens"] == 3 + 5 + 11 + 3  # cycled to 4 prompts

    drawn = random_workload(6, 10, 8, range_ratio=0.5, seed=4)
    assert {p.output_len for p in drawn} != {8} and all(4 <= p.output_len <= 12 for p in drawn)
    assert all(5 <= len(p.text.split()) <= 15 for p in drawn)
    assert [p.text for p in random_workload(3, 7, 8, seed=2)] == random_prompts(3, 7, seed=2)  # ratio 0: fixed
    code, text = _bench("serve", "--url", stack, "--num-prompts", "6", "--input-len", "10", "--output-len", "8",
                        "--range-ratio", "0.5", "--seed", "4", "--json-out", str(out))
    assert code == 0, text
    assert json.loads(out.read_text())["output_tokens"] == sum(p.output_len for p in drawn)


def test_serve_without_ignore_eos_sends_only_standard_fields(stack, tmp_path):
    from worker.bench.prompts import Prompt
    from worker.bench.serve import Load

    load = Load(1, output_len=8, ignore_eos=False, endpoint="chat")
    body = load.body("m", Prompt("hello", 4))
    assert body == {"model": "m", "max_tokens": 4, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": "hello"}]}
    out = tmp_path / "report.json"
    code, text = _bench("serve", "--url", stack, "--no-ignore-eos", "--num-prompts", "3", "--input-len", "4",
                        "--output-len", "8", "--json-out", str(out))
    assert code == 0, text
    report = json.loads(out.read_text())
    assert report["completed"] == 3 and 3 <= report["output_tokens"] <= 3 * 8 and report["ignore_eos"] is False


def test_sharegpt_file_gives_each_conversations_first_human_turn(tmp_path):
    from worker.bench.prompts import Prompt, file_prompts

    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "What is a river?"},
                                      {"from": "gpt", "value": "Water that flows."},
                                      {"from": "human", "value": "And a lake?"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "no human turn"}]},
        {"id": "c", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "user", "value": "Hi"}]},
    ]))
    assert file_prompts(str(path), 3) == [Prompt("What is a river?"), Prompt("Hi"), Prompt("What is a river?")]


@pytest.mark.parametrize("argv, message", [
    (["--sweep", "1,fast"], "--sweep takes comma-separated request rates"),
    (["--request-rate", "0"], "request rates must be > 0"),
    (["--burstiness", "0"], "--burstiness must be > 0"),
    (["--range-ratio", "1"], "--range-ratio must be in [0, 1)"),
    (["--concurrency", "0"], "--concurrency must be >= 1"),
    (["--concurrency", "2,many"], "--concurrency takes a number of requests"),
    (["--concurrency", "2", "--plot", "x.png"], "--plot needs a sweep"),
    (["--percentiles", "50,100"], "--percentiles takes comma-separated numbers in (0, 100)"),
    (["--prompts-file", "/no/such/file"], "--prompts-file: [Errno 2]"),
    (["--prompts-file", "BAD_JSONL"], "'max_tokens' must be a positive integer"),
])
def test_serve_refuses_bad_flags_before_sending_anything(argv, message, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "max_tokens": 0}\n')
    argv = [str(bad) if a == "BAD_JSONL" else a for a in argv]
    with pytest.raises(SystemExit) as exit_:
        _bench("serve", "--url", "http://127.0.0.1:9", *argv)  # nothing listens there: no request may be sent
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_gamma_arrivals_keep_the_mean_rate_and_set_the_spread():
    import random
    import statistics

    from worker.bench.serve import Load

    for burstiness in (0.25, 1.0, 4.0):
        load = Load(1, request_rate=10.0, burstiness=burstiness)
        rng = random.Random(0)
        gaps = [load.gap(rng) for _ in range(40000)]
        assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.03)
        # gamma(k, 1 / (rate k)): variance 1 / (rate^2 k); burstier arrivals spread more
        assert statistics.pvariance(gaps) == pytest.approx(0.01 / burstiness, rel=0.08)
    assert Load(1).gap(random.Random(0)) == 0.0  # infinite rate: all at once


def test_stack_pairs_the_embedded_stack_with_the_engine_alone(tmp_path):
    """`bench stack` runs `redjax serve` (embedded Redis, API, worker) and `bench offline` in
    alternating pairs. The offline run gets as many prompt tokens as the model's own tokenizer
    (transformers) gives the serving prompts, and the ratios are those of the pairs' figures."""
    import statistics

    import transformers

    from worker.bench.prompts import random_prompts

    model = make_served_model(tmp_path / "served")
    code, out = _bench("stack", "--model", str(model), "--pairs", "2", "--num-prompts", "4", "--input-len", "6",
                       "--output-len", "8", "--seed", "3", "--json", "--max-num-seqs", "8",
                       "--max-num-batched-tokens", "128", "--page-size", "8", "--num-pages", "128")
    assert code == 0, out
    report = json.loads(out)
    assert [p["first"] for p in report["pairs"]] == ["serve", "offline"]
    for p in report["pairs"]:
        assert p["serve_failed"] == 0
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
        for usage in (p["serve_cpu"], p["offline_cpu"]):
            assert usage["idle_core_s"] >= 0 and usage["rest_core_s"] >= 0 and usage["cores"] == os.cpu_count()
    assert report["median_ratio"] == pytest.approx(statistics.median(p["ratio"] for p in report["pairs"]))
    assert report["engine_flags"] == ["--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--page-size", "8",
                                      "--num-pages", "128"]
    _check_report(report["last_serve_report"], 4)
    tok = transformers.AutoTokenizer.from_pretrained(str(model))
    counts = [len(tok(p)["input_ids"]) for p in random_prompts(4, 6, seed=3)]  # the first pair's prompts
    assert report["prompt_tokens_per_request"] == round(sum(counts) / len(counts))


def test_stack_serves_a_dummy_preset_through_its_word_tokenizer():
    """`bench stack --dummy PRESET` writes random weights and a word tokenizer to a temporary
    directory and serves them like any model: every serving prompt word is one token, so the
    offline half gets exactly --input-len prompt tokens."""
    code, out = _bench("stack", "--dummy", "llama-tiny", "--pairs", "1", "--num-prompts", "4", "--input-len", "6",
                       "--output-len", "8", "--json", "--max-num-seqs", "8", "--max-num-batched-tokens", "128",
                       "--page-size", "8", "--num-pages", "128")
    assert code == 0, out
    report = json.loads(out)
    assert report["model"] == "dummy:llama-tiny"
    assert report["prompt_tokens_per_request"] == 6
    assert report["pairs"][0]["serve_failed"] == 0 and report["pairs"][0]["offline_output_tokens_per_s"] > 0
    _check_report(report["last_serve_report"], 4)


def test_stack_refuses_an_unknown_preset_before_starting_anything(capsys):
    with pytest.raises(SystemExit) as exit_:
        _bench("stack", "--dummy", "no-such-preset", "--pairs", "1")
    assert exit_.value.code == 2
    assert "unknown preset 'no-such-preset'" in capsys.readouterr().err


def test_serve_reads_events_split_across_reads_with_lf_or_crlf():
    """The load generator parses SSE per network read: lines cut between reads, CRLF endings and
    comment lines must not change what it counts."""
    import asyncio

    from worker.bench.serve import Result, _read_stream

    def event(obj) -> str:
        return f"data: {json.dumps(obj)}"

    lines = [": ping", event({"choices": [{"text": "a"}]}), "", event({"choices": [{"text": ""}]}), "",
             event({"choices": [{"text": "bc"}]}), "", event({"choices": [], "usage": {"prompt_tokens": 5,
                                                                                     "completion_tokens": 3}}),
             "", "data: [DONE]", "", event({"choices": [{"text": "after done"}]}), ""]

    class Content:
        def __init__(self, body: bytes, cut: int):
            self.parts = [body[i:i + cut] for i in range(0, len(body), cut)]

        async def iter_any(self):
            for part in self.parts:
                yield part

    for newline in ("\n", "\r\n"):
        body = newline.join(lines).encode()
        for cut in (1, 7, len(body)):
            r = Result(start=0.0)
            asyncio.run(_read_stream(Content(body, cut), r))
            assert (r.prompt_tokens, r.output_tokens) == (5, 3), (newline, cut)
            assert r.ttft > 0 and len(r.itl) == 1, (newline, cut)  # two chunks with text; "" is not content


def test_serve_times_chat_deltas_by_their_content():
    """A chat stream opens with a role-only delta (not a token); content, or a reasoning model's
    reasoning_content, is."""
    import asyncio

    from worker.bench.serve import Result, _read_stream

    def event(delta) -> bytes:
        return f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta}]})}\n\n".encode()

    class Content:
        async def iter_any(self):
            yield event({"role": "assistant", "content": ""})
            yield event({"reasoning_content": "think"})
            yield event({"content": None})
            yield event({"content": "answer"})
            yield b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}\n\ndata: [DONE]\n\n'

    r = Result(start=0.0)
    asyncio.run(_read_stream(Content(), r))
    assert r.ttft > 0 and len(r.itl) == 1 and (r.prompt_tokens, r.output_tokens) == (4, 2)


def test_gpu_bench_script_writes_a_report_per_run(tmp_path):
    """scripts/gpu_bench.sh, dry-run on the CPU with a tiny preset: each run leaves its JSON report
    and a summary line; a run that fails or passes the deadline is reported and the next one runs."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PRESET": "llama-tiny", "DTYPE": "float32", "ATTENTION": "auto", "SIZE_SCALE": "64",
           "PYTHON": sys.executable, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache")}

    def script(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "scripts/gpu_bench.sh", *args], cwd=root, env={**env, **extra},
                              capture_output=True, text=True, timeout=600)

    done = script("1024-1024", "1024-1024-jnp", "--out", str(tmp_path / "a"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["1024-1024", "1024-1024-jnp"], done.stdout
    assert (tmp_path / "a" / "summary.txt").read_text().splitlines() == lines
    for line, (name, attention) in zip(lines, (("1024-1024", "cpu-kernel"), ("1024-1024-jnp", "jnp"))):
        report = json.loads((tmp_path / "a" / f"{name}.json").read_text())
        assert (report["input_len"], report["output_len"], report["num_prompts"]) == (16, 16, 64)
        assert report["attention"] == attention
        assert f"{report['output_tokens_per_s']:.0f} output tok/s" in line
        assert f"{report['startup']['variants_compiled_ahead']} variants compiled ahead in " in line
    # the kernel on a machine without a GPU: that run fails with the engine's reason, the next goes on
    done = script("1024-128", "1024-1024-jnp", "--out", str(tmp_path / "b"), ATTENTION="pallas",
                  BENCH_FLAGS="--compile-threads 1 --max-num-seqs 32")  # more flags for every run
    assert done.returncode == 0
    assert done.stdout.startswith("1024-128: FAILED (exit 1") and "needs the GPU backend" in done.stdout
    assert "1024-1024-jnp: " in done.stdout and "output tok/s" in done.stdout
    assert not (tmp_path / "b" / "1024-128.json").exists()
    engine = json.loads((tmp_path / "b" / "1024-1024-jnp.json").read_text())["engine"]
    assert (engine["compile_threads"], engine["max_num_seqs"]) == (1, 32)
    # past the deadline: killed and reported
    done = script("1024-1024", "--out", str(tmp_path / "c"), DEADLINE_S="2")
    assert done.returncode == 0
    assert done.stdout.startswith("1024-1024: FAILED (exit 124, deadline")


def test_gpu_bench_compile_cache_travels_between_invocations(tmp_path):
    """--cache-out packs the compile cache into OUTDIR's jax-cache.tgz.* parts; --cache-in unpacks
    them into a fresh machine's empty cache (here: the same path, emptied) before the runs, and the
    programs the first invocation compiled are read from it, not compiled again. (The path must be
    the same: XLA's compile options, part of every cache key, name the cache directory.)"""
    root = Path(__file__).resolve().parent.parent
    cache = tmp_path / "cache"
    env = {**os.environ, "PRESET": "llama-tiny", "DTYPE": "float32", "ATTENTION": "auto", "SIZE_SCALE": "64",
           "PYTHON": sys.executable, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_COMPILATION_CACHE_DIR": str(cache)}

    def script(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "scripts/gpu_bench.sh", "batch1", *args], cwd=root, capture_output=True,
                              text=True, timeout=600, env=env)

    first = script("--out", str(tmp_path / "a"), "--cache-out")
    assert first.returncode == 0, first.stderr
    saved = sorted(p.name for p in cache.iterdir())
    assert any(name.startswith("jit__step-") for name in saved), saved
    assert f"cache: {len(saved)} entries saved as 1 part(s)" in first.stdout.splitlines()[-1], first.stdout
    assert [p.name for p in (tmp_path / "a").glob("jax-cache.tgz.*")] == ["jax-cache.tgz.aa"]
    shutil.rmtree(cache)
    second = script("--out", str(tmp_path / "b"), "--cache-in", str(tmp_path / "a"))
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines()[0] == f"cache: restored {len(saved)} entries from {tmp_path / 'a'}"
    assert "batch1: " in second.stdout and "output tok/s" in second.stdout, second.stdout
    assert sorted(p.name for p in cache.iterdir()) == saved  # every program was found there, none compiled again
    empty = script("--out", str(tmp_path / "c"), "--cache-in", str(tmp_path / "nothing"))
    assert empty.stdout.startswith("cache: nothing to restore in "), empty.stdout
