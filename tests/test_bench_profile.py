"""`bench offline --profile`: a traced round of steady decode calls, summarized kernel by kernel
(worker/bench/profile.py), on this machine's real profiler, and the summary's arithmetic on a
GPU-shaped trace written here."""

from __future__ import annotations

import gzip
import json

import pytest

from worker.bench import profile
from worker.cli import main


def test_a_profiled_round_summarizes_its_decode_calls(tmp_path, capsys):
    out = tmp_path / "trace"
    code = main(["bench", "offline", "--dummy", "llama-tiny", "--num-prompts", "4", "--input-len", "16",
                 "--output-len", "80", "--profile", str(out), "--profile-calls", "3", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    p = report["profile"]
    assert p["calls"] == 3 and p["decode_steps"] >= 3  # fused decode: several steps a call
    assert (out / "plugins").is_dir() and p["trace"].endswith("perfetto_trace.json.gz")
    assert p["device_ms_per_step"] > 0 and p["top"] and p["by_kind"]
    assert sum(k["share"] for k in p["by_kind"].values()) == pytest.approx(1.0)
    assert sum(k["ms_per_step"] for k in p["by_kind"].values()) == pytest.approx(p["device_ms_per_step"])
    assert report["output_tokens"] == 4 * 80  # the timed round is reported as before


def test_text_report_lists_the_kernels(tmp_path, capsys):
    assert main(["bench", "offline", "--dummy", "llama-tiny", "--num-prompts", "2", "--input-len", "8",
                 "--output-len", "48", "--profile", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "decode calls" in text and "ms per step" in text and "by kind:" in text and "/step" in text


def test_nothing_to_trace_is_a_usage_error(tmp_path, capsys):
    """One output token: the round never decodes, so the profile has nothing to say."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "offline", "--dummy", "llama-tiny", "--num-prompts", "2", "--input-len", "8",
              "--output-len", "1", "--profile", str(tmp_path)])
    assert exit_.value.code == 2 and "nothing was traced" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "offline", "--dummy", "llama-tiny", "--profile", str(tmp_path), "--profile-calls", "0"])


def gpu_trace(path, events):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7(Compute)"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 1, "args": {"name": "python"}}]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    return path


def test_summary_of_a_gpu_trace_counts_stream_kernels_once(tmp_path):
    x = lambda name, dur, tid=7, pid=1: {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": 0, "dur": dur}  # noqa: E731
    events = [x("redjax_paged_decode_attention", 100) for _ in range(4)]  # 2 steps x 2 layers
    events += [x("sm90_xmma_gemm_bf16bf16_bf16f32", 150), x("nvjet_tst_128x64", 150),
               x("loop_add_fusion_3", 30), x("loop_add_fusion_12", 30), x("copy_fusion_1", 40)]
    events += [x("fusion.3", 600, tid=8), x("PjitFunction(step)", 5000, tid=1, pid=2)]  # repeats and host time
    s = profile.summarize(gpu_trace(tmp_path / "t.json.gz", events), decode_steps=2)
    assert s["device_ms_per_step"] == pytest.approx(0.4)  # 800 us of kernels over 2 steps
    assert s["by_kind"]["attention"] == pytest.approx({"ms_per_step": 0.2, "share": 0.5, "calls_per_step": 2.0})
    assert s["by_kind"]["matmul"]["ms_per_step"] == pytest.approx(0.15)
    assert s["by_kind"]["other"]["ms_per_step"] == pytest.approx(0.03)
    assert s["by_kind"]["copy"]["share"] == pytest.approx(40 / 800)
    assert s["top"][0]["name"] == "redjax_paged_decode_attention"
    assert {"name": "loop_add_fusion", "kind": "other", "ms_per_step": pytest.approx(0.03),
            "share": pytest.approx(60 / 800), "calls_per_step": 1.0} in s["top"]


def test_names_and_kinds():
    assert profile.family("fusion.12") == "fusion" and profile.family("loop_add_fusion_3") == "loop_add_fusion"
    assert profile.family("redjax_paged_decode_attention") == "redjax_paged_decode_attention"
    assert profile.kind("redjax_paged_decode_attention") == "attention"
    assert profile.kind("cutlass_80_tensorop_bf16_s16816gemm") == "matmul" and profile.kind("nvjet_hsh") == "matmul"
    assert profile.kind("input_scatter_fusion") == "scatter" and profile.kind("copy.4") == "copy"
    assert profile.kind("loop_multiply_fusion") == "other"


def test_the_profiled_round_ends_after_its_trace_with_nothing_left_behind(tmp_path):
    """Once its calls are traced the round's requests are aborted: the engine is idle, every page
    is free again (the prefix cache emptied), and only the traced calls were stepped past the trace."""
    from worker.bench.offline import Workload, make_engine
    from worker.bench.probe import StepProbe

    work = Workload(num_prompts=4, input_len=16, output_len=200)
    engine, _ = make_engine(None, "llama-tiny", {"decode_steps": 2}, work)
    probe = StepProbe().install(engine)
    prompts = work.round_prompts(engine.model_config.vocab_size, 0)
    p = profile.profile_decode(engine, probe, prompts, work.output_lens, work, str(tmp_path), calls=3)
    assert p["calls"] == 3 and not engine.has_unfinished()
    assert probe.decode.decode_steps < 2 * 20  # far short of the 200 tokens the requests asked for
    engine.allocator.uncache(engine.allocator.cache_entries())
    assert engine.pages_used == 0
