"""`redjax bench attention` on the CPU: every implementation the backend has, and the Pallas
kernel's settings through Pallas's interpreter, on the same random pages, each held to the jnp
reference; the report's arithmetic; the pick of the fastest setting skips wrong results."""

from __future__ import annotations

import json

import pytest

from worker.bench import attention
from worker.cli import main


def test_reports_each_implementation_against_the_reference(capsys):
    assert main(["bench", "attention", "--dummy", "llama-100m", "--batch", "3", "--context", "70", "--dtype",
                 "bfloat16", "--tuning", "4:2048:4:2", "--tuning", "3:64:4:2", "--interpret", "--repeats", "1",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["batch"], report["context"], report["table_width"], report["interpret"]) == (3, 70, 8, True)
    # llama-100m: 4 KV heads of 64: 3 rows x 70 tokens of keys and values in bfloat16
    assert report["kv_bytes_per_call"] == 3 * 70 * 2 * 4 * 64 * 2
    rows = {r["name"]: r for r in report["results"]}
    assert list(rows) == ["jnp", "cpu-kernel", "pallas 4:2048:4:2", "pallas 3:64:4:2", "jax-pallas"]
    for r in rows.values():
        assert r["max_abs_error"] < 2e-2, r  # bfloat16 pages and queries; float32 sums
        assert r["kv_gbs"] == pytest.approx(report["kv_bytes_per_call"] / r["us_per_call"] / 1e3)
        assert r["step_ms"] == pytest.approx(r["us_per_call"] * report["num_layers"] / 1e3)
    assert rows["jnp"]["max_abs_error"] == 0.0  # the reference itself
    # prefill: 2 rows of 35 query tokens ending at token 70 (half the context) over the same 8-page tables
    p = report["prefill"]
    assert (p["rows"], p["chunk"], p["context"], p["table_width"]) == (2, 35, 70, 8)
    # llama-100m: 12 heads of 64; query i of a chunk sees 36 + i keys; QK and PV, 2 FLOPs a multiply-add
    assert p["flops_per_call"] == 4 * 12 * 64 * 2 * sum(range(36, 71))
    prefill = {r["name"]: r for r in p["results"]}
    assert list(prefill) == ["reference", "cpu-kernel", "pallas"]  # the CPU kernel: what a CPU engine runs
    for r in prefill.values():
        assert r["max_abs_error"] < 2e-2, r  # bfloat16 operands against float32 products
        assert r["tflops"] == pytest.approx(p["flops_per_call"] / r["us_per_call"] / 1e6)
    assert prefill["cpu-kernel"]["max_abs_error"] < 1e-5  # float32 products over the same bfloat16 pages
    # compiled (as on a GPU), the table says which prefill attention an engine should take
    report["interpret"] = False
    prefill["pallas"]["us_per_call"], prefill["reference"]["us_per_call"] = 1.0, 2.0
    assert "the Pallas prefill kernel is faster here; an engine takes it by default" in attention.table(report)
    prefill["pallas"]["us_per_call"] = 3.0
    assert "the reference prefill attention is faster here" in attention.table(report)


def test_int8_pages_through_every_implementation(capsys):
    """`--dtype int8`: pages of int8 values with a float32 scale per token and KV head, through the
    jnp reference, the CPU kernel and the Pallas decode and prefill kernels (JAX's own Pallas kernel
    reads no int8 pages), each against the reference over the dequantized pages."""
    assert main(["bench", "attention", "--dummy", "llama-100m", "--batch", "3", "--context", "70", "--dtype",
                 "int8", "--tuning", "4:2048:4:2", "--interpret", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # a byte a value and a float32 scale per 64 values, keys and values of 4 KV heads
    assert report["kv_bytes_per_call"] == int(3 * 70 * 2 * 4 * 64 * (1 + 4 / 64))
    rows = {r["name"]: r for r in report["results"]}
    assert list(rows) == ["jnp", "cpu-kernel", "pallas 4:2048:4:2"]
    assert rows["jnp"]["max_abs_error"] == 0.0 and rows["cpu-kernel"]["max_abs_error"] < 1e-5
    assert rows["pallas 4:2048:4:2"]["max_abs_error"] < 2e-2  # bfloat16 products
    prefill = {r["name"]: r for r in report["prefill"]["results"]}
    assert list(prefill) == ["reference", "cpu-kernel", "pallas"]
    assert prefill["reference"]["max_abs_error"] < 1e-5 and prefill["cpu-kernel"]["max_abs_error"] < 1e-5
    assert prefill["pallas"]["max_abs_error"] < 2e-2  # bfloat16 query, weights and products


def test_the_table_and_usage_errors(capsys):
    assert main(["bench", "attention", "--dummy", "llama-tiny", "--batch", "2", "--context", "33", "--repeats", "1",
                 "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama-tiny decode attention, one layer: 2 rows x 33 tokens, pages of 16 (4-page tables)")
    assert "\njnp " in out and "fastest Pallas setting" not in out  # no Pallas on a CPU without --interpret
    assert "prefill attention, one layer: 2 rows x 16 query tokens ending at token 33 (4-page tables)" in out
    assert "\nreference " in out and "\ncpu-kernel " in out.split("prefill attention")[1]
    assert "\npallas " not in out and "--pallas-prefill" not in out
    for flags, message in ((["--tuning", "4:2048"], "expected PAGES:PROGRAMS:WARPS:STAGES"),
                           (["--page-size", "8"], "powers of two >= 16"), (["--dummy", "nope"], "unknown preset"),
                           (["--context", "100", "--prefill-context", "200"], "--prefill-context must be at least"),
                           (["--prefill-chunk", "600", "--prefill-context", "500"], "--prefill-context must be at least --prefill-chunk")):
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "attention", *flags])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_fastest_setting_must_also_be_right():
    rows = [{"name": "jnp", "us_per_call": 50.0, "max_abs_error": 0.0},
            {"name": "pallas 8:4096:8:2", "us_per_call": 10.0, "max_abs_error": 3.0},  # fast and wrong
            {"name": "pallas 4:2048:4:2", "us_per_call": 20.0, "max_abs_error": 1e-3},
            {"name": "pallas 1:512:4:2", "us_per_call": 30.0, "max_abs_error": 1e-3},
            {"name": "pallas 2:2048:4:2", "error": "CompilationError: out of shared memory"}]
    assert attention.fastest({"results": rows})["name"] == "pallas 4:2048:4:2"
    assert attention.fastest({"results": rows[:2]}) is None


def test_the_prefill_kernel_is_taken_only_when_right_and_faster():
    def report(kernel: dict) -> dict:
        return {"prefill": {"results": [{"name": "reference", "us_per_call": 100.0, "max_abs_error": 1e-3},
                                        {"name": "pallas", **kernel}]}}

    assert attention.prefill_kernel_wins(report({"us_per_call": 60.0, "max_abs_error": 1e-3}))
    assert not attention.prefill_kernel_wins(report({"us_per_call": 60.0, "max_abs_error": 3.0}))  # fast and wrong
    assert not attention.prefill_kernel_wins(report({"us_per_call": 160.0, "max_abs_error": 1e-3}))
    assert not attention.prefill_kernel_wins(report({"error": "CompilationError: out of shared memory"}))
    assert not attention.prefill_kernel_wins({"results": []})  # no prefill timing at all
