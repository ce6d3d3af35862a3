"""`redjax bench offline` on a tiny random model (with and without the transformers baseline), its
roofline figures against the report's own measurements (the arithmetic: test_roofline.py), and
scripts/gpu_bench.sh dry-run on the CPU. No wall-clock thresholds."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_support import run_bench
from tests.hf_models import make_hf_model
from worker.bench import roofline
from worker.bench.cli import offline_parser
from worker.bench.hf_baseline import run_hf
from worker.bench.offline import Workload, WorkloadError
from worker.bench.prompts import draw_lengths, random_workload
from worker.models.config import ModelConfig

TINY = ["--num-prompts", "4", "--input-len", "8", "--output-len", "8", "--json"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    make_hf_model("llama", path)
    return path


def test_offline_reports_throughput(tiny_model):
    code, out = run_bench("offline", "--model", str(tiny_model), *TINY)
    report = json.loads(out)
    assert code == 0
    assert report["output_tokens"] == 4 * 8
    for key in ("output_tokens_per_s", "requests_per_s", "total_tokens_per_s", "memory_bandwidth_gbs",
                "matmul_gflops", "decode_roofline_fraction", "prefill_roofline_fraction", "decode_host_fraction"):
        assert report[key] > 0, key
    assert "ratio" not in report
    # the compute ceiling is the machine's best measured product: XLA's or the engine kernel's (CI
    # builds the kernels), whichever is faster, so no step can beat its roofline by the kernel alone
    assert report["matmul_gflops_xla"] > 0 and report["matmul_gflops_kernel"] > 0
    assert report["matmul_gflops"] == max(report["matmul_gflops_xla"], report["matmul_gflops_kernel"])
    # the whole run's fraction: each phase's ideal time (per step, per prompt token) over both phases' time
    d, p = report["decode_phase"], report["prefill_phase"]
    assert report["ideal_decode_s"] == pytest.approx(report["decode_ideal_step_ms"] / 1e3 * d["decode_steps"])
    assert report["ideal_prefill_s"] == pytest.approx(report["prefill_ideal_token_us"] / 1e6 * p["prefill_tokens"])
    assert report["roofline_fraction"] == pytest.approx(
        (report["ideal_decode_s"] + report["ideal_prefill_s"]) / (d["wall_s"] + p["wall_s"]), rel=1e-3)  # phases: us
    # products then attention, each at its roofline: from the report's own batch, context and probes
    cfg = ModelConfig.from_dir(tiny_model)
    assert cfg.dtype == "float32" and report["kv_cache_dtype"] == "float32"
    context = report["decode_mean_context"]
    serial = roofline.decode_serial_step_s(cfg, 4, 4, report["decode_mean_batch"], context,
                                           context * (1 - report["decode_shared_kv_fraction"]),
                                           report["memory_bandwidth_gbs"], report["matmul_gflops"])
    assert report["decode_serial_step_ms"] == pytest.approx(serial * 1e3)
    assert report["decode_ideal_step_ms"] <= report["decode_serial_step_ms"]
    assert report["decode_serial_fraction"] == pytest.approx(serial * 1e3 / report["decode_step_ms"])
    assert report["serial_decode_s"] == pytest.approx(serial * d["decode_steps"])
    assert report["serial_roofline_fraction"] == pytest.approx(
        (report["serial_decode_s"] + report["ideal_prefill_s"]) / (d["wall_s"] + p["wall_s"]), rel=1e-3)
    # the host is named with what the CPU kernels choose by: figures of two hosts are not one series
    with open("/proc/cpuinfo") as f:
        model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    assert report["device_name"].startswith(model) and f"{os.cpu_count()} cores" in report["device_name"]
    for phase in (report["decode_phase"], report["prefill_phase"]):  # host time by part, adding up to the whole
        parts = [phase[f"{part}_s"] for part in ("schedule", "build", "launch", "postprocess")]
        assert min(parts) >= 0 and sum(parts) == pytest.approx(phase["host_s"], abs=1e-5), phase
        assert phase["host_s"] + phase["wait_s"] <= phase["wall_s"]
    # (a call counts for the batch it reads back, with the next one's launch: each part shows in some phase)
    assert all(report["decode_phase"][f"{part}_s"] + report["prefill_phase"][f"{part}_s"] > 0
               for part in ("schedule", "build", "launch", "postprocess"))
    # the warm-up's variants were planned and compiled ahead; the measured run compiled none
    startup = report["startup"]
    assert startup["variants_compiled_ahead"] >= 2 and startup["compile_ahead_s"] > 0 and startup["warmup_s"] > 0
    assert report["compiles_during_run"] == 0


def test_offline_plans_the_runs_tail_steps_too(tiny_model):
    """Prompts admitted over 8 prefill steps finish their fused decode steps at different times;
    the last rows' final steps take shapes the warm-up's shorter requests never meet. Planning the
    run itself as well leaves nothing to compile during it (this shape compiled 3 variants)."""
    code, out = run_bench("offline", "--model", str(tiny_model), "--num-prompts", "16", "--input-len", "8",
                          "--output-len", "20", "--max-num-batched-tokens", "16", "--max-num-seqs", "16",
                          "--decode-steps", "3", "--json")
    assert code == 0 and json.loads(out)["compiles_during_run"] == 0


def test_offline_on_the_shape_of_a_config_json(tmp_path, capsys):
    """--dummy PATH: random weights shaped by any config.json; a name that is neither a preset nor
    a config is a usage error before anything loads."""
    cfg = ModelConfig.preset("llama-tiny")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**cfg.to_hf_dict(), "num_hidden_layers": 1}))
    code, out = run_bench("offline", "--dummy", str(config), *TINY)
    assert code == 0
    report = json.loads(out)
    assert report["model"] == str(config) and report["num_params"] == ModelConfig.preset(str(config)).num_params
    assert report["num_params"] < cfg.num_params and report["output_tokens_per_s"] > 0
    with pytest.raises(SystemExit) as exit_:
        run_bench("offline", "--dummy", "gpt-17", *TINY)
    assert exit_.value.code == 2 and "unknown preset 'gpt-17'" in capsys.readouterr().err


def test_offline_compare_hf(tiny_model):
    code, out = run_bench("offline", "--model", str(tiny_model), *TINY, "--compare", "hf", "--hf-batch-size", "2")
    report = json.loads(out)
    assert code == 0
    for key in ("output_tokens_per_s", "baseline_output_tokens_per_s", "ratio"):
        assert report[key] > 0, key
    assert report["greedy_match_fraction"] == 1.0  # same weights, same prompts, greedy
    assert report["greedy_first_token_match_fraction"] == 1.0
    assert report["greedy_mean_common_tokens"] == report["output_len"]
    assert report["baseline_batch_size"] == 2 and list(report["baseline_batch_trials"]) == ["2"]
    # transformers against the engine's roofline, and the ratio that roofline allows: one round, so
    # the baseline's seconds over the round's ideal seconds
    ideal_s = report["ideal_decode_s"] + report["ideal_prefill_s"]
    assert report["ratio_at_roofline"] == pytest.approx(report["baseline_seconds"] / ideal_s)
    assert report["baseline_roofline_fraction"] == pytest.approx(1 / report["ratio_at_roofline"])
    # and with products and attention in turn: the serial ideal, never a higher ratio
    serial_s = report["serial_decode_s"] + report["ideal_prefill_s"]
    assert report["ratio_at_serial_roofline"] == pytest.approx(report["baseline_seconds"] / serial_s)
    assert report["ratio_at_serial_roofline"] <= report["ratio_at_roofline"]


def test_greedy_agreement_counts_identical_outputs_first_tokens_and_common_prefixes():
    from worker.bench.offline import greedy_agreement

    ours = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9], [1, 1]]
    theirs = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9], [1, 1, 1]]  # the last: ours stopped sooner
    got = greedy_agreement(ours, theirs)
    assert got == {"greedy_match_fraction": 0.25, "greedy_first_token_match_fraction": 0.75,
                   "greedy_mean_common_tokens": (4 + 2 + 0 + 2) / 4}


def test_offline_compare_hf_picks_the_fastest_batch_size_by_default(tiny_model):
    code, out = run_bench("offline", "--model", str(tiny_model), "--num-prompts", "20", "--input-len", "8",
                          "--output-len", "4", "--json", "--compare", "hf", "--rounds", "2")
    report = json.loads(out)
    assert code == 0
    trials = report["baseline_batch_trials"]  # 16, 32 and 64, capped at the 20 prompts
    assert sorted(map(int, trials)) == [16, 20]
    assert report["baseline_batch_size"] == int(max(trials, key=trials.get))
    assert "batch {}".format(report["baseline_batch_size"]) in report["baseline"]
    assert all(f["greedy_match_fraction"] == 1.0 for f in report["per_round"])
    ideal_round_s = (report["ideal_decode_s"] + report["ideal_prefill_s"]) / 2  # the ideals sum both rounds
    assert report["ratio_at_roofline"] == pytest.approx(report["baseline_seconds"] / ideal_round_s)
    with pytest.raises(SystemExit):
        offline_parser().parse_args(["--model", "x", "--hf-batch-size", "0"])


def test_offline_compare_hf_on_dummy_weights_gives_transformers_the_engine_weights():
    # the engine packs float32 weights for its matmul kernel; transformers must get them as loaded
    code, out = run_bench("offline", "--dummy", "llama-tiny", *TINY, "--compare", "hf", "--hf-batch-size", "2")
    report = json.loads(out)
    assert code == 0 and report["matmul"] == "kernel"
    assert report["greedy_match_fraction"] == 1.0


def test_offline_rounds_alternate_with_the_baseline_and_report_medians(tiny_model):
    code, out = run_bench("offline", "--model", str(tiny_model), *TINY, "--compare", "hf", "--hf-batch-size", "2",
                          "--rounds", "3")
    report = json.loads(out)
    assert code == 0 and report["rounds"] == 3 and len(report["per_round"]) == 3
    ratios = sorted(f["ratio"] for f in report["per_round"])
    assert report["ratio"] == ratios[1]
    assert sorted(f["output_tokens_per_s"] for f in report["per_round"])[1] == report["output_tokens_per_s"]
    assert all(f["output_tokens"] == 4 * 8 and f["greedy_match_fraction"] == 1.0 for f in report["per_round"])


def test_offline_options_on_every_nth_request_mix_the_traffic(tiny_model, capsys):
    """--options-every N: top-p, logprobs, prompt logprobs and the penalties on requests 0, N, 2N,
    ... only (mixed traffic: the screened head draws the rest, head_choice.py); not with --compare,
    whose transformers batches sample alike and have no presence or frequency penalty and no prompt
    logprobs."""
    work = Workload(8, 4, 4, temperature=0.7, top_p=0.9, logprobs=2, options_every=4, frequency_penalty=0.5,
                    presence_penalty=-0.25, prompt_logprobs=0)
    assert [work.params(4, seed=i).prompt_logprobs for i in range(6)] == [0, None, None, None, 0, None]
    assert [work.params(4, seed=i).top_p for i in range(6)] == [0.9, 1.0, 1.0, 1.0, 0.9, 1.0]
    assert [work.params(4, seed=i).logprobs for i in range(6)] == [2, None, None, None, 2, None]
    assert [work.params(4, seed=i).frequency_penalty for i in range(6)] == [0.5, 0.0, 0.0, 0.0, 0.5, 0.0]
    assert [work.params(4, seed=i).presence_penalty for i in range(6)] == [-0.25, 0.0, 0.0, 0.0, -0.25, 0.0]
    code, out = run_bench("offline", "--model", str(tiny_model), *TINY, "--temperature", "0.7", "--top-p", "0.9",
                          "--logprobs", "1", "--options-every", "3", "--frequency-penalty", "0.5",
                          "--prompt-logprobs", "2")
    sampling = json.loads(out)["sampling"]
    assert code == 0 and sampling["options_every"] == 3 and sampling["frequency_penalty"] == 0.5
    assert sampling["prompt_logprobs"] == 2
    for bad, flag in ((["--options-every", "0"], "--options-every"),
                      (["--options-every", "2", "--compare", "hf"], "--options-every"),
                      (["--presence-penalty", "2.5"], "--presence-penalty"),
                      (["--frequency-penalty", "0.5", "--compare", "hf"], "--frequency-penalty"),
                      (["--prompt-logprobs", "21"], "--prompt-logprobs"),
                      (["--prompt-logprobs", "0", "--compare", "hf"], "--prompt-logprobs")):
        with pytest.raises(SystemExit) as exit_:
            run_bench("offline", "--model", str(tiny_model), *TINY, "--top-p", "0.9", *bad)
        assert exit_.value.code == 2 and flag in capsys.readouterr().err


def test_offline_logprobs_asks_both_engines_for_them(tiny_model, capsys):
    """--logprobs N: every engine request asks for its tokens' logprobs and N alternatives, and
    transformers computes the same (raw logits, log-softmax, top N) in its timed batches; the greedy
    tokens still agree. Out of range is a usage error."""
    work = Workload(2, 4, 4, logprobs=3)
    assert work.params(4, seed=1).logprobs == 3 and Workload(2, 4, 4).params(4, seed=1).logprobs is None
    code, out = run_bench("offline", "--model", str(tiny_model), *TINY, "--compare", "hf", "--hf-batch-size", "2",
                          "--logprobs", "3")
    report = json.loads(out)
    assert code == 0 and report["sampling"]["logprobs"] == 3 and report["greedy_match_fraction"] == 1.0
    code, out = run_bench("offline", "--model", str(tiny_model), *TINY[:-1], "--logprobs", "0")
    assert code == 0 and "greedy, logprobs 0" in out
    with pytest.raises(SystemExit) as exit_:
        run_bench("offline", "--model", str(tiny_model), *TINY, "--logprobs", "21")
    assert exit_.value.code == 2 and "--logprobs must be in [0, 20]" in capsys.readouterr().err


def test_hf_baseline_with_logprobs_gives_the_same_tokens(tiny_model):
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    _, plain = run_hf(tiny_model, prompts, 5, 2)
    _, with_logprobs = run_hf(tiny_model, prompts, 5, 2, logprobs=4)
    assert with_logprobs == plain and all(len(o) == 5 for o in plain)


def test_offline_text_summary(tiny_model):
    code, out = run_bench("offline", "--model", str(tiny_model), *TINY[:-1], "--decode-steps", "1")
    assert code == 0 and "output tokens/s" in out and "host" in out
    assert re.search(r"decode: .* host [\d.]+% of step time \(per call, ms: schedule [\d.]+, build [\d.]+, launch "
                     r"[\d.]+, postprocess [\d.]+\)", out), out
    assert re.search(r"startup: calibration [\d.]+ s, \d+ step variants compiled ahead in [\d.]+ s", out), out


def test_offline_range_ratio_gives_each_request_its_own_lengths(tiny_model, capsys):
    """--range-ratio: lengths drawn per request (the ones bench serve draws for the same seed); the
    engine runs each request to its own output length, transformers in padded batches of mixed
    lengths gives the same greedy tokens, and nothing compiles during the run."""
    sizes = draw_lengths(6, 8, 8, 0.5, seed=3)
    assert len(set(sizes)) > 1  # lengths do vary
    assert [(len(p.text.split()), p.output_len) for p in random_workload(6, 8, 8, 0.5, seed=3)] == sizes
    code, out = run_bench("offline", "--model", str(tiny_model), "--num-prompts", "6", "--input-len", "8",
                          "--output-len", "8", "--range-ratio", "0.5", "--seed", "3", "--json", "--compare", "hf",
                          "--hf-batch-size", "4", "--rounds", "2")
    report = json.loads(out)
    assert code == 0 and report["range_ratio"] == 0.5
    assert report["mean_input_len"] == pytest.approx(sum(i for i, _ in sizes) / 6)
    assert report["mean_output_len"] == pytest.approx(sum(o for _, o in sizes) / 6)
    assert all(f["output_tokens"] == sum(o for _, o in sizes) for f in report["per_round"])
    assert report["greedy_match_fraction"] == 1.0 and report["compiles_during_run"] == 0
    for argv in (["--range-ratio", "1"], ["--range-ratio", "-0.1"], ["--output-len", "0"]):
        with pytest.raises(SystemExit) as exit_:
            run_bench("offline", "--model", str(tiny_model), *argv)
        assert exit_.value.code == 2
    assert "--range-ratio must be in [0, 1)" in capsys.readouterr().err


def test_offline_prefix_len_shares_a_prefix_the_cache_serves(tiny_model, capsys):
    """--prefix-len: every prompt of a round starts with the same ids; prompts admitted after the
    first one's prefix is computed read its full pages from the cache, and their greedy tokens are
    still transformers' (which computes every prompt whole). Without the cache nothing is served."""
    work = Workload(6, 5, 8, prefix_len=24)
    prompts = work.prompts(1000, seed=9)
    assert work.sizes == [(29, 8)] * 6 and len({tuple(p[:24]) for p in prompts}) == 1
    assert len({tuple(p[24:]) for p in prompts}) == 6
    flags = ["--num-prompts", "6", "--input-len", "5", "--output-len", "8", "--prefix-len", "24", "--json",
             "--page-size", "8", "--max-num-batched-tokens", "32", "--max-num-seqs", "8"]
    code, out = run_bench("offline", "--model", str(tiny_model), *flags, "--compare", "hf", "--hf-batch-size", "3",
                          "--rounds", "2")
    report = json.loads(out)
    assert code == 0 and report["prefix_len"] == 24 and report["prompt_tokens"] == 6 * 29
    hits = [f["prefix_cache_hit_tokens"] for f in report["per_round"]]
    # 32 tokens a step: the first prompt takes a step alone, so at least the last four hit its 3 full pages
    assert all(4 * 24 <= h <= 5 * 24 and h % 8 == 0 for h in hits), hits
    assert report["greedy_match_fraction"] == 1.0 and report["compiles_during_run"] == 0
    assert 0 < report["decode_shared_kv_fraction"] < 24 / 29  # the memory ideal reads shared pages once a step
    cached_context = report["prefill_mean_context"]  # the prompts' computed tails see the cached pages too
    code, out = run_bench("offline", "--model", str(tiny_model), *flags, "--no-prefix-cache")
    report = json.loads(out)
    assert code == 0 and report["prefix_cache_hit_tokens"] == report["decode_shared_kv_fraction"] == 0
    assert cached_context > report["prefill_mean_context"] >= 1  # whole prompts: (29 + 1) / 2 on average
    for argv in (["--prefix-len", "-1"], ["--prefix-len", "4", "--prompts-file", "README.md"]):
        with pytest.raises(SystemExit) as exit_:
            run_bench("offline", "--model", str(tiny_model), *argv)
        assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--prefix-len must be >= 0" in err and "--prefix-len shape random prompts" in err


DEMO = "worker/demo_model"
PASSAGES = ["It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
            "in want of a wife. However little known the feelings or views of such a man may be",
            "Mr. Bennet was so odd a mixture of quick parts, sarcastic humour, reserve, and caprice, that the "
            "experience of three and twenty years had been insufficient to make his wife understand his character",
            "Elizabeth listened in silence, but was not convinced; their behaviour at the assembly had not been "
            "calculated to please in general"]


def test_offline_runs_a_sharegpt_file_through_the_models_tokenizer(tmp_path, capsys):
    """--prompts-file: each conversation's first human turn in, its reply's token count out (one
    without a reply is left out); the same requests every round, each round from an empty prefix
    cache, and transformers gives the same greedy tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO, local_files_only=True)
    replies = ["She is tolerable; but not handsome enough to tempt me.", "You mistake me, my dear.",
               "I could easily forgive his pride, if he had not mortified mine."]
    chats = [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
             for q, a in zip(PASSAGES, replies)] + [{"conversations": [{"from": "human", "value": "no reply"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(chats))
    code, out = run_bench("offline", "--model", DEMO, "--prompts-file", str(path), "--num-prompts", "3",
                          "--page-size", "16", "--rounds", "2", "--compare", "hf", "--json")
    report = json.loads(out)
    lens = [len(tok.encode(a, add_special_tokens=False)) for a in replies]
    assert code == 0 and report["prompts_file"] == str(path)
    assert report["mean_input_len"] == pytest.approx(sum(len(tok.encode(q)) for q in PASSAGES) / 3)
    assert all(f["output_tokens"] == sum(lens) for f in report["per_round"])
    assert [f["prefix_cache_hit_tokens"] for f in report["per_round"]] == [0, 0]  # > 16 tokens each
    assert report["greedy_match_fraction"] == 1.0 and report["compiles_during_run"] == 0
    # --dummy has no tokenizer of its own; a tokenizer whose ids pass the model's vocabulary is refused
    for argv, error in ((["--dummy", "llama-tiny"], "needs --tokenizer DIR"),
                        (["--dummy", "llama-tiny", "--tokenizer", DEMO], "the model's vocabulary has 1024"),
                        (["--model", DEMO, "--input-len", "8"], "shape random prompts, not --prompts-file")):
        with pytest.raises(SystemExit) as exit_:
            run_bench("offline", *argv, "--prompts-file", str(path))
        assert exit_.value.code == 2 and error in capsys.readouterr().err, argv


def test_offline_file_prompts_sharing_a_prefix_compile_nothing_during_the_run(tmp_path):
    """A file whose prompts open alike (a system prompt): the warm-up runs the file's own prompts
    from an empty cache, so the chunks that start after the cached pages are compiled before the
    run (random ids in the warm-up left them to compile during it)."""
    path = tmp_path / "shared.jsonl"
    path.write_text("".join(json.dumps({"prompt": PASSAGES[0] + " " + p, "max_tokens": 6}) + "\n" for p in PASSAGES))
    code, out = run_bench("offline", "--model", DEMO, "--prompts-file", str(path), "--num-prompts", "6", "--rounds",
                          "2", "--page-size", "8", "--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--json")
    report = json.loads(out)
    hits = [f["prefix_cache_hit_tokens"] for f in report["per_round"]]
    assert code == 0 and hits[0] == hits[1] > 0, hits
    assert report["compiles_during_run"] == 0


def test_workload_check_names_the_request_that_cannot_run():
    """A file's prompt can tokenize to nothing (a tokenizer that adds no BOS); ids past the
    vocabulary or a request past max_model_len are refused with the request's number."""
    work = lambda *reqs: Workload(len(reqs), 1, 1, requests=reqs)  # noqa: E731
    work(((1, 2), 3)).check(vocab_size=8, max_model_len=5)
    for w, error in ((work(((1,), 2), ((), 2)), "request 1: the prompt has no tokens"),
                     (work(((1, 2), 4)), "request 0: 2 prompt + 4 output tokens; the engine allows 5"),
                     (work(((1, 8), 1)), "the prompts hold token id 8; the model's vocabulary has 8")):
        with pytest.raises(WorkloadError, match=re.escape(error)):
            w.check(vocab_size=8, max_model_len=5)


def test_offline_refuses_requests_longer_than_the_model_allows(capsys):
    with pytest.raises(SystemExit) as exit_:
        run_bench("offline", "--model", DEMO, "--num-prompts", "2", "--input-len", "1000", "--output-len", "30")
    assert exit_.value.code == 2
    assert "request 0: 1000 prompt + 30 output tokens; the engine allows 1024" in capsys.readouterr().err


def test_hf_baseline_batches_of_mixed_lengths_match_one_request_at_a_time(tiny_model):
    """Left padding with its mask, the batches sorted by length and put back in prompt order: each
    request's tokens are those it gets alone, exactly as many as it asked for."""
    prompts = [[5, 9, 13], [7] * 9, [3, 4], [11, 2, 8, 6, 1], [20] * 6]
    lens = [4, 7, 2, 7, 5]
    _, batched = run_hf(tiny_model, prompts, lens, batch_size=3)
    alone = [run_hf(tiny_model, [p], n, batch_size=1)[1][0] for p, n in zip(prompts, lens)]
    assert [len(o) for o in batched] == lens
    assert batched == alone


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
        d = report["decode_phase"]  # the host's decode share, split per call as the probe splits it
        assert (f"(decode {report['decode_host_fraction']:.1%}: per call schedule "
                f"{d['schedule_s'] / d['calls'] * 1e3:.2f}, build ") in line
        assert re.search(r"launch [\d.]+, postprocess [\d.]+ ms of [\d.]+\); attention ", line), line
    # the kernel on a machine without a GPU: that run fails with the engine's reason, the next goes on
    done = script("1024-128", "1024-1024-jnp", "--out", str(tmp_path / "b"), ATTENTION="pallas", PALLAS_PREFILL="1",
                  BENCH_FLAGS="--compile-threads 1 --max-num-seqs 32")  # more flags for every run
    assert done.returncode == 0
    assert done.stdout.startswith("1024-128: FAILED (exit 2") and "needs the GPU backend" in done.stdout
    assert "=== 1024-128: 64 x 16/2 --attention pallas --pallas-prefill" in (tmp_path / "b" / "gpu_bench.log").read_text()
    assert "1024-1024-jnp: " in done.stdout and "output tok/s" in done.stdout
    assert not (tmp_path / "b" / "1024-128.json").exists()
    engine = json.loads((tmp_path / "b" / "1024-1024-jnp.json").read_text())["engine"]
    assert (engine["compile_threads"], engine["max_num_seqs"]) == (1, 32)
    # the attention sweep (through Pallas's interpreter here) hands its fastest setting to the kernel runs after it
    done = script("attention", "1024-1024", "--out", str(tmp_path / "d"), ATTENTION="pallas",
                  ATTENTION_FLAGS="--interpret --batch 4 --repeats 1 --tuning 2:2048:4:2 --tuning 1:512:4:2")
    assert done.returncode == 0, done.stderr
    sweep = json.loads((tmp_path / "d" / "attention.json").read_text())
    assert (sweep["context"], sweep["batch"]) == (1552 // 64, 4)
    assert [r["name"] for r in sweep["results"]] == ["jnp", "cpu-kernel", "pallas 2:2048:4:2", "pallas 1:512:4:2",
                                                     "jax-pallas"]
    assert all(r["max_abs_error"] < 1e-5 for r in sweep["results"]), sweep["results"]
    picked = min(sweep["results"][2:4], key=lambda r: r["us_per_call"])["name"].split()[1]
    # interpreted, the prefill kernel's time is the interpreter's: never taken on it
    assert (f"attention: fastest Pallas setting {picked}, prefill kernel not faster; the kernel runs after this use "
            f"--pallas-tuning {picked} --no-pallas-prefill") in done.stdout
    assert (f"=== 1024-1024: 64 x 16/16 --attention pallas --pallas-tuning {picked} --no-pallas-prefill\n"
            in (tmp_path / "d" / "gpu_bench.log").read_text())
    summary = (tmp_path / "d" / "summary.txt").read_text()
    assert "attention pallas 1:512:4:2: " in summary and " us/layer, " in summary
    prefill = sweep["prefill"]
    assert (prefill["rows"], prefill["chunk"], prefill["context"]) == (2, 512 // 64, 1024 // 64)
    assert [r["name"] for r in prefill["results"]] == ["reference", "cpu-kernel", "pallas"]
    assert all(r["max_abs_error"] < 0.05 for r in prefill["results"]), prefill["results"]  # bfloat16 pages
    assert "attention prefill reference: " in summary and "attention prefill pallas: " in summary
    # PROFILE: the run's report and summary get the traced decode calls' kernels
    done = script("batch1", "--out", str(tmp_path / "e"), SIZE_SCALE="4", PROFILE=str(tmp_path / "prof"),
                  BENCH_FLAGS="--decode-steps 2")  # 16 decode calls: 8 traced
    assert done.returncode == 0, done.stderr
    traced = json.loads((tmp_path / "e" / "batch1.json").read_text())["profile"]
    assert traced["calls"] == 8 and traced["trace"].startswith(str(tmp_path / "prof" / "batch1"))
    assert "batch1 profile: 8 decode calls (" in done.stdout and "batch1   by kind: " in done.stdout
    assert "batch1 prefill: not traced (" in done.stdout  # one prompt: admitted whole in the first call
    # 128/128 for the engine alone (a variant of 128-128 through BENCH_FLAGS): no transformers run
    done = script("128-128-engine", "--out", str(tmp_path / "f"), BENCH_FLAGS="--launch-thread")
    assert done.returncode == 0 and done.stdout.startswith("128-128-engine: "), done.stdout + done.stderr
    report = json.loads((tmp_path / "f" / "128-128-engine.json").read_text())
    assert (report["num_prompts"], report["input_len"], report["output_len"]) == (64, 2, 2)
    assert "ratio" not in report and report["engine"]["launch_thread"] is True
    assert report["pallas_prefill_kernel"] is False and ", prefill kernel" not in done.stdout  # the CPU kernel's prefill
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
    # XLA's autotuning results alone (a GPU writes them under the cache; here two stand-ins)
    tuned = cache / "xla_gpu_per_fusion_autotune_cache_dir"
    for name in ("a1.textproto", "b2.textproto"):
        (tuned / name).parent.mkdir(exist_ok=True)
        (tuned / name).write_text(f"result {name}")
    only = script("--out", str(tmp_path / "d"), "--autotune-out")
    assert only.returncode == 0, only.stderr
    assert only.stdout.splitlines()[-1].startswith(f"cache: 2 autotuning results saved as {tmp_path / 'd'}/xla-autotune.tgz")
    assert not list((tmp_path / "d").glob("jax-cache.tgz.*"))
    shutil.rmtree(cache)
    back = script("--out", str(tmp_path / "e"), "--cache-in", str(tmp_path / "d"))
    assert back.stdout.splitlines()[0] == f"cache: restored 2 autotuning results from {tmp_path / 'd'}"
    assert (tuned / "b2.textproto").read_text() == "result b2.textproto"
