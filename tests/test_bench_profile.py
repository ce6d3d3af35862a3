"""`bench offline --profile`: a traced round of steady decode calls, summarized kernel by kernel
(worker/bench/profile.py), on this machine's real profiler, and the summary's arithmetic on a
GPU-shaped trace written here."""

from __future__ import annotations

import gzip
import json

import pytest

from worker.bench import profile
from worker.cli import main


@pytest.fixture(autouse=True)
def _own_xla_flags(monkeypatch):
    """--profile adds a flag to XLA_FLAGS for the backend it would start: not for later tests' processes."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)


# the screened greedy heads' kernels: the approximate product, the screen
SCREENED_HEADS = {"screened-int8": ("redjax_panel_matmul_i8", "redjax_screened_argmax_i8"),
                  "screened-bf16": ("redjax_panel_matmul_bf16", "redjax_screened_argmax")}

def test_traced_calls_keep_the_command_buffers_the_timed_ones_use():
    # XLA would run a profiled GPU program op by op: another launch than the one the report times
    environ = {"XLA_FLAGS": "--xla_gpu_autotune_level=0"}
    profile.trace_as_timed(environ)
    assert environ["XLA_FLAGS"] == "--xla_gpu_autotune_level=0 --xla_enable_command_buffers_during_profiling=true"
    profile.trace_as_timed(environ)  # once only
    assert environ["XLA_FLAGS"].count("during_profiling") == 1
    mine = {"XLA_FLAGS": "--xla_enable_command_buffers_during_profiling=false"}  # the user's own choice stands
    profile.trace_as_timed(mine)
    assert mine == {"XLA_FLAGS": "--xla_enable_command_buffers_during_profiling=false"}
    empty: dict = {}
    profile.trace_as_timed(empty)
    assert empty == {"XLA_FLAGS": "--xla_enable_command_buffers_during_profiling=true"}


def _within_a_step(calls_per_step: float, expected: int, steps: float) -> bool:
    """A traced window holds `steps` decode steps, counted by attention calls; cut between a step's
    attention and its products at the two ends, it may count up to one step's calls more or fewer."""
    return abs(calls_per_step - expected) * steps <= expected + 1e-9


def test_a_profiled_round_summarizes_its_decode_calls(tmp_path, capsys):
    out = tmp_path / "trace"
    code = main(["bench", "offline", "--dummy", "llama-tiny", "--num-prompts", "4", "--input-len", "16",
                 "--output-len", "80", "--profile", str(out), "--profile-calls", "3", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    p = report["profile"]
    assert p["calls"] == 3 and p["decode_steps"] >= 3  # fused decode: several steps a call
    assert (out / "decode" / "plugins").is_dir() and p["trace"].endswith("perfetto_trace.json.gz")
    # 4 prompts of 16 tokens fit in one call, and the first call is never traced: no prefill window
    assert "prefill" not in p and "one call" in p["prefill_error"]
    assert p["device_ms_per_step"] > 0 and p["top"] and p["by_kind"]
    assert sum(k["share"] for k in p["by_kind"].values()) == pytest.approx(1.0)
    assert sum(k["ms_per_step"] for k in p["by_kind"].values()) == pytest.approx(p["device_ms_per_step"])
    assert report["output_tokens"] == 4 * 80  # the timed round is reported as before
    # the CPU kernels are named by their targets, so the kinds and the step count come out as on a GPU
    assert {"attention", "matmul"} <= set(p["by_kind"]) and p["steps_from"] == "attention kernels"
    names = {r["name"] for r in p["top"]}
    # decode steps write each row's new key and value in the attention call (one call a layer)
    assert {"redjax_paged_attention_write", "redjax_panel_matmul"} <= names, names
    # the host side of the traced launches: the runner's call, by the events inside it
    launch = p["launch"]
    assert launch["calls"] >= 1 and launch["ms_per_call"] > 0 and launch["self"]
    assert all(0 < r["total_ms_per_call"] <= launch["ms_per_call"] * (1 + 1e-9) for r in launch["self"])
    assert not any("kv_write" in name for name in names), names
    # 2 layers of 7 projections and the output head: the traced steps are whole decode steps
    # (the window may cut a step at either end between its attention and its products). Greedy
    # rows on a CPU with AVX512-VNNI or AVX512-BF16 take the screened head: an int8 or bfloat16
    # product and its screen
    steps = p["decode_steps"]
    calls = {r["name"]: r["calls_per_step"] for r in p["top"]}
    head = SCREENED_HEADS.get(report["greedy_head"])
    assert _within_a_step(calls["redjax_panel_matmul"], 14 if head else 15, steps)
    if head:
        assert _within_a_step(calls[head[0]], 1, steps) and _within_a_step(calls[head[1]], 1, steps)
    # the same products by shape (llama-tiny: hidden 256, 4 x 64 query and 2 x 64 KV dims, MLP 512,
    # vocab 1024), the 4 rows padded to the step's batch bucket: q and o, k and v (one shape), gate
    # and up (one), down, the head
    shapes = {(r["k"], r["n"]): r for r in p["products"]}
    assert set(shapes) == {(256, 256), (256, 128), (256, 512), (512, 256), (256, 1024)}, set(shapes)
    (rows,) = {r["m"] for r in p["products"]}
    assert rows >= 4
    calls = {kn: r["calls_per_step"] for kn, r in shapes.items()}
    assert _within_a_step(calls[(256, 1024)], 1, steps) and _within_a_step(calls[(512, 256)], 2, steps)
    assert all(_within_a_step(calls[kn], 4, steps) for kn in ((256, 256), (256, 128), (256, 512)))
    for r in p["products"]:  # each rate from the shape and its time
        assert r["gflops"] == pytest.approx(2 * r["m"] * r["k"] * r["n"] / r["us_per_call"] / 1e3)
    # one program ran: every product has its shape, and the shapes add up to the products' time
    assert p["products_unshaped_ms_per_step"] == pytest.approx(0.0, abs=1e-9)
    assert sum(r["ms_per_step"] for r in p["products"]) == pytest.approx(p["by_kind"]["matmul"]["ms_per_step"])


def test_prefill_calls_are_traced_whole(tmp_path, capsys):
    """8 prompts of 64 tokens through 128-token steps: the calls after the first that hold prompt
    chunks are traced, the step in flight waited for at both ends, so each traced call is one whole
    step (llama-tiny: 2 layers of 7 projections and the head, 2 attention calls)."""
    out = tmp_path / "trace"
    assert main(["bench", "offline", "--dummy", "llama-tiny", "--num-prompts", "8", "--input-len", "64",
                 "--output-len", "40", "--max-num-batched-tokens", "128", "--profile", str(out),
                 "--profile-calls", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    p = report["profile"]["prefill"]
    assert (out / "prefill" / "plugins").is_dir() and p["calls"] == 3
    assert 64 <= p["prompt_tokens_per_step"] <= 128 and p["decode_rows_per_step"] < 8
    assert p["device_us_per_prompt_token"] == pytest.approx(
        p["device_ms_per_step"] * 1e3 / p["prompt_tokens_per_step"])
    calls = {r["name"]: r["calls_per_step"] for r in p["top"]}
    assert calls["redjax_paged_attention"] == 2, calls
    head = SCREENED_HEADS.get(report["greedy_head"])
    if head:  # the head of the sampled rows: an int8 or bfloat16 product, screened
        assert calls["redjax_panel_matmul"] == 14 and calls[head[0]] == 1 and calls[head[1]] == 1, calls
    else:
        assert calls["redjax_panel_matmul"] == 15, calls


def test_text_report_lists_the_kernels(tmp_path, capsys):
    assert main(["bench", "offline", "--dummy", "llama-tiny", "--num-prompts", "2", "--input-len", "8",
                 "--output-len", "48", "--profile", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "decode calls" in text and "ms per step" in text and "by kind:" in text and "/step" in text
    assert "prefill: not traced" in text


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
    """Two decode steps of two layers, kernels back to back on one stream with a 10 us launch gap
    after each, and one 500 us wait on the host between the steps; the per-op line repeating the
    stream's kernels and the host's own events must not count."""
    kernels = ["redjax_paged_decode_attention", "sm90_xmma_gemm_bf16bf16_bf16f32", "loop_add_fusion_3",
               "redjax_paged_decode_attention", "nvjet_tst_128x64", "loop_add_fusion_12", "copy_fusion_1"]
    durations = [100, 150, 30, 100, 150, 30, 40]  # one step: 600 us of kernels
    events, t = [], 0.0
    for step in range(2):
        for name, dur in zip(kernels, durations):
            events.append({"ph": "X", "name": name, "pid": 1, "tid": 7, "ts": t, "dur": dur})
            t += dur + 10
        t += 500 - 10 if step == 0 else 0
    events += [{"ph": "X", "name": "fusion.3", "pid": 1, "tid": 8, "ts": 0, "dur": 600},
               {"ph": "X", "name": "PjitFunction(step)", "pid": 2, "tid": 1, "ts": 0, "dur": 5000}]
    s = profile.summarize(gpu_trace(tmp_path / "t.json.gz", events), decode_steps=5, num_layers=2)
    assert (s["decode_steps"], s["steps_from"]) == (2, "attention kernels")  # 4 attention kernels / 2 layers
    assert s["device_ms_per_step"] == pytest.approx(0.6)
    assert s["by_kind"]["attention"] == pytest.approx({"ms_per_step": 0.2, "share": 1 / 3, "calls_per_step": 2.0})
    assert s["by_kind"]["matmul"]["ms_per_step"] == pytest.approx(0.3)
    assert s["by_kind"]["other"]["ms_per_step"] == pytest.approx(0.06)
    assert s["by_kind"]["copy"]["share"] == pytest.approx(80 / 1200)
    assert s["top"][0]["name"] in ("redjax_paged_decode_attention", "sm90_xmma_gemm_bf16bf16_bf16f32")
    assert {"name": "loop_add_fusion", "kind": "other", "ms_per_step": pytest.approx(0.06),
            "share": pytest.approx(120 / 1200), "calls_per_step": 2.0} in s["top"]
    # 12 launch gaps of 10 us and one host wait of 500 us over a span of 1200 + 120 + 500 us
    assert s["short_gaps_ms_per_step"] == pytest.approx(0.12 / 2) and s["long_gaps"] == 1
    assert s["long_gaps_ms_per_step"] == pytest.approx(0.25)
    assert s["span_ms_per_step"] == pytest.approx(1.82 / 2) and s["busy_fraction"] == pytest.approx(1200 / 1820)
    # without the layer count (or on the jnp path, no kernel to count) the engine's step count
    assert profile.summarize(tmp_path / "t.json.gz", decode_steps=5)["decode_steps"] == 5
    # a window that cut a step: its kernels count in proportion (3 attention launches: 1.5 steps)
    cut = profile.summarize(gpu_trace(tmp_path / "cut.json.gz", events[1:7 + 7]), decode_steps=5, num_layers=2)
    assert cut["decode_steps"] == pytest.approx(1.5)


def test_a_cpu_trace_counts_the_ops_inside_a_while_loop_and_not_the_loop():
    """On a CPU, XLA's threads carry the op events; the thread running a fused decode call's loop
    shows a `while` event around the iterations it ran, which must not count again."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 3, "args": {"name": "tf_XLAEigen/12"}}]
    ops = [{"ph": "X", "name": "while.2", "pid": 1, "tid": 3, "ts": 0, "dur": 1000},
           {"ph": "X", "name": "ffi_call.7", "pid": 1, "tid": 3, "ts": 10, "dur": 600},
           {"ph": "X", "name": "multiply_multiply_fusion.1", "pid": 1, "tid": 3, "ts": 620, "dur": 300},
           {"ph": "X", "name": "ThreadpoolListener::Record", "pid": 1, "tid": 3, "ts": 930, "dur": 5}]
    by_op, intervals = profile.op_events(meta + ops, {"ffi_call.7": "redjax_panel_matmul"})
    assert by_op == {"redjax_panel_matmul": (600.0, 1), "multiply_multiply_fusion": (300.0, 1)}
    assert intervals == [(10.0, 610.0), (620.0, 920.0)]


def test_busy_time_merges_overlapping_kernels():
    assert profile.busy_time([(0, 10), (5, 20), (25, 30), (130, 140)]) == (140, 35, 5, 100, 1)
    assert profile.busy_time([]) == (0.0, 0.0, 0.0, 0.0, 0)


def test_op_targets_name_kernel_calls_unless_programs_disagree_on_the_kind():
    one = ('  %ffi_call.41 = f32[64,256]{1,0} custom-call(%a, %b), custom_call_target="redjax_rms_norm", x=1\n'
           '  %ffi_call.42 = f32[64,256]{1,0} custom-call(%c), custom_call_target="redjax_panel_matmul"\n'
           '  %fusion.3 = f32[4]{0} fusion(%d), kind=kLoop\n')
    other = '  %ffi_call.42 = f32[8]{0} custom-call(%e), custom_call_target="redjax_paged_attention"\n'
    assert profile.op_targets([one]) == {"ffi_call.41": "redjax_rms_norm", "ffi_call.42": "redjax_panel_matmul"}
    assert profile.op_targets([one, other]) == {"ffi_call.41": "redjax_rms_norm"}
    # two programs, two kernels of one kind under one name: the time is that kind's either way
    amx = '  %ffi_call.42 = f32[64,256]{1,0} custom-call(%c), custom_call_target="redjax_amx_matmul_bf16"\n'
    joined = profile.op_targets([one, amx])
    assert joined == {"ffi_call.41": "redjax_rms_norm", "ffi_call.42": "redjax_amx_matmul_bf16|redjax_panel_matmul"}
    assert profile.kind(joined["ffi_call.42"]) == "matmul"


def test_op_products_give_each_product_call_its_shape():
    """x [M, K] comes from the call's operand layout, [M, N] from its result; products only, and a
    name two programs give different shapes is dropped (the trace cannot say which ran)."""
    qkv = ('  %ffi_call.80 = f32[64,256]{1,0} custom-call(%ffi_call.79, %params_9_.1), '
           'custom_call_target="redjax_panel_matmul", operand_layout_constraints={f32[64,768]{1,0}, '
           'f32[8,768,32]{2,1,0}}, api_version=API_VERSION_TYPED_FFI\n'
           '  %ffi_call.81 = f32[64,128]{1,0} custom-call(%ffi_call.79, %p.2), '
           'custom_call_target="redjax_amx_matmul_bf16", operand_layout_constraints={f32[64,256]{1,0}, '
           'bf16[4,128,64]{2,1,0}}, api_version=API_VERSION_TYPED_FFI\n'
           '  %ffi_call.82 = f32[64,256]{1,0} custom-call(%a, %b), custom_call_target="redjax_rms_norm", '
           'operand_layout_constraints={f32[64,256]{1,0}, f32[256]{0}}\n')
    assert profile.op_products([qkv]) == {"ffi_call.80": (64, 768, 256), "ffi_call.81": (64, 256, 128)}
    wider = qkv.replace("f32[64,256]{1,0} custom-call(%ffi_call.79, %params_9_.1)",
                        "f32[128,256]{1,0} custom-call(%ffi_call.79, %params_9_.1)")
    assert profile.op_products([qkv, wider]) == {"ffi_call.81": (64, 256, 128)}
    # the trace's events of those calls, summed by shape (other ops and names not in the map: none)
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 3, "args": {"name": "tf_XLAEigen/12"}}]
    ops = [{"ph": "X", "name": name, "pid": 1, "tid": 3, "ts": ts, "dur": dur}
           for name, ts, dur in (("ffi_call.80", 0, 100), ("ffi_call.81", 100, 20), ("ffi_call.80", 200, 60),
                                 ("ffi_call.82", 300, 5))]
    by_shape = profile.shape_events(meta + ops, profile.op_products([qkv]))
    assert by_shape == {(64, 768, 256): (160.0, 2), (64, 256, 128): (20.0, 1)}


def test_names_and_kinds():
    assert profile.family("fusion.12") == "fusion" and profile.family("loop_add_fusion_3") == "loop_add_fusion"
    assert profile.family("redjax_paged_decode_attention") == "redjax_paged_decode_attention"
    assert profile.kind("redjax_paged_decode_attention") == "attention"
    assert profile.kind("cutlass_80_tensorop_bf16_s16816gemm") == "matmul" and profile.kind("nvjet_hsh") == "matmul"
    assert profile.kind("input_scatter_fusion") == "scatter" and profile.kind("copy.4") == "copy"
    assert profile.kind("redjax_kv_write") == "scatter" and profile.kind("redjax_paged_attention") == "attention"
    assert profile.kind("loop_multiply_fusion") == "other"


def test_the_profiled_round_ends_after_its_trace_with_nothing_left_behind(tmp_path):
    """Once its calls are traced the round's requests are aborted: the engine is idle, every page
    is free again (the prefix cache emptied), and only the traced calls were stepped past the trace.
    The kernels of variants that ran through jit (none compiled ahead) are named too."""
    from worker.bench.offline import Workload, make_engine
    from worker.bench.probe import StepProbe

    work = Workload(num_prompts=4, input_len=16, output_len=200)
    engine, _ = make_engine(None, "llama-tiny", {"decode_steps": 2}, work)
    probe = StepProbe().install(engine)
    prompts = work.round_prompts(engine.model_config.vocab_size, 0)
    p = profile.profile_decode(engine, probe, prompts, work.output_lens, work, str(tmp_path), calls=3)
    assert p["calls"] == 3 and not engine.has_unfinished()
    # nothing was compiled ahead: the variants ran through jit, and their kernels are named all the same
    assert not engine.runner.ready
    names = {r["name"] for r in p["top"]}
    assert {"redjax_paged_attention_write", "redjax_panel_matmul"} <= names and "ffi_call" not in names, names
    assert probe.decode.decode_steps < 2 * 20  # far short of the 200 tokens the requests asked for
    engine.allocator.uncache(engine.allocator.cache_entries())
    assert engine.pages_used == 0


def test_a_profiler_that_fails_leaves_the_timed_figures(tmp_path, capsys, monkeypatch):
    """On a lent GPU the timed run is what the call was for: a profiler that cannot trace there costs
    the profile, not the report."""
    def broken(*args, **kwargs):
        raise RuntimeError("no profiler plugin")

    monkeypatch.setattr(profile.jax.profiler, "start_trace", broken)
    assert main(["bench", "offline", "--dummy", "llama-tiny", "--num-prompts", "2", "--input-len", "8",
                 "--output-len", "48", "--profile", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["profile_error"] == "RuntimeError: no profiler plugin" and "profile" not in report
    assert report["output_tokens"] == 2 * 48 and report["output_tokens_per_s"] > 0
