"""`redjax bench attention`: one layer's decode attention over a paged KV cache, timed for each
implementation the backend has and each Pallas work split asked for, on the same pages, against
the machine's memory bandwidth.

A decode step reads every running sequence's keys and values once per layer. At long contexts and
full batches that is most of the step: llama3-8b at 64 rows x 1552 tokens reads 13 GB of KV a step
beside 15 GB of weights, and session 29's H200 ran the step at 24.2 ms where the bytes allow 7.5.
This bench isolates that part: one call of the decode attention (the engine runs one per layer) on
random pages laid out as the engine lays them, with every row's pages scattered over the pool. It
reports microseconds per call, the KV read rate (GB/s; the bytes are the rows' context keys and
values, each read once) and its share of the measured copy bandwidth, and each result's largest
difference from the jnp reference, so a kernel that is fast and wrong shows as such.

Implementations: "jnp" (the reference, gathering blocks of pages), "pallas B:T:W:S" (the engine's
kernel with a `gpu_attention.Tuning`), "cpu-kernel" (CPU), and "jax-pallas", JAX's own Pallas
paged attention (`jax.experimental.pallas.ops.gpu.paged_attention`, its default settings), a
kernel nobody here wrote, on the same pages in its layout. The Pallas ones run on a GPU, or on
any backend through Pallas's interpreter with --interpret (a check of the results only).
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from worker.bench import roofline
from worker.engine import cpu_attention, gpu_attention, gpu_prefill, paged_attention as pa
from worker.engine.config import parse_tuning
from worker.engine.int8_linear import quantize
from worker.engine.kv_cache import element_bytes
from worker.engine.kv_quant import QuantizedPages
from worker.models.config import ModelConfig, ModelConfigError

# the work splits a sweep tries by default: session 17's (1:512), the default (4:1024:4:2, the
# fastest of session 30's sweep on an H200) and neighbours of each knob
SWEEP = ("1:512:4:2", "2:1024:4:2", "4:512:4:2", "4:1024:4:2", "4:2048:4:2", "4:1024:2:2", "4:1024:4:3",
         "4:1024:4:4", "8:512:4:2", "8:1024:4:2", "8:1024:8:2")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="redjax bench attention",
                                description="one layer's paged decode attention: implementations and kernel settings")
    p.add_argument("--dummy", metavar="PRESET", default="llama3-8b", help="the shape (heads, KV heads, head dim) of "
                   "this preset (default llama3-8b)")
    p.add_argument("--batch", type=int, default=64, help="rows (sequences) in the step (default 64)")
    p.add_argument("--context", type=int, default=1552, help="tokens each row attends to (default 1552: the mean of "
                   "a 64 x 1024/1024 run)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "int8"], default="bfloat16",
                   help="KV page dtype (the queries are float32, as the model hands them to attention); int8: the "
                        "pages quantized by token and KV head with their scales (kv_quant.py)")
    p.add_argument("--tuning", action="append", metavar="PAGES:PROGRAMS:WARPS:STAGES",
                   help="a Pallas work split to time (repeatable; default: a sweep of "
                        f"{len(SWEEP)} around the default)")
    p.add_argument("--prefill-rows", type=int, default=2, help="prefill rows in the prefill timing (default 2)")
    p.add_argument("--prefill-chunk", type=int, help="query tokens a prefill row holds (default: half of "
                   "--prefill-context, at most 512)")
    p.add_argument("--prefill-context", type=int,
                   help="where each prefill row's chunk ends (default 1024, at most --context: with 512-token chunks "
                        "the second half of a 1024-token prompt); its page table is as wide as the decode rows' (a "
                        "mixed step's rows share one width)")
    p.add_argument("--interpret", action="store_true", help="run the Pallas kernels through Pallas's interpreter "
                   "(any backend: a check of their results, far too slow to time)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds of 10 calls; the best is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def run(argv: list[str]) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        cfg = ModelConfig.preset(args.dummy)
    except ModelConfigError as e:
        p.error(str(e))
    tunings = args.tuning or list(SWEEP)
    bad = [t for t in tunings if parse_tuning(t) is None]
    if bad:
        p.error(f"--tuning {bad[0]!r}: expected PAGES:PROGRAMS:WARPS:STAGES, positive integers, warps a power of two")
    if args.prefill_context is None:
        args.prefill_context = min(1024, args.context)
    if args.prefill_chunk is None:
        args.prefill_chunk = max(1, min(512, args.prefill_context // 2))
    if min(args.batch, args.context, args.repeats, args.prefill_rows, args.prefill_chunk) < 1 \
            or not gpu_attention.supported(cfg.head_dim, args.page_size):
        p.error("--batch, --context, --repeats, --prefill-rows and --prefill-chunk must be >= 1, and head dim and "
                "--page-size powers of two >= 16")
    if not args.prefill_chunk <= args.prefill_context <= args.context:
        p.error("--prefill-context must be at least --prefill-chunk and at most --context")
    report = bench_attention(cfg, args.dummy, args.batch, args.context, args.page_size, args.dtype, tunings,
                             args.interpret, args.repeats, args.seed)
    report["prefill"] = bench_prefill(cfg, args.prefill_rows, args.prefill_chunk, args.prefill_context,
                                      report["table_width"], args.page_size, args.dtype, args.interpret, args.repeats,
                                      args.seed)
    print(json.dumps(report, indent=2) if args.json else table(report))
    return 0


def make_inputs(cfg: ModelConfig, batch: int, context: int, page_size: int, dtype: str, seed: int) -> dict:
    """Random pages in the engine's layout, each row's pages scattered over a pool with room to
    spare, page tables as wide as the engine's (the next power of two of the pages a row holds)."""
    rng = np.random.default_rng(seed)
    pages = -(-context // page_size)
    width = 1 << (pages - 1).bit_length()
    num_pages = batch * pages + 1 + batch  # page 0 unused, a little slack
    k, v = random_pages(rng, cfg, num_pages, page_size, dtype)
    tables = np.zeros((batch, width), np.int32)
    tables[:, :pages] = rng.permutation(np.arange(1, num_pages))[: batch * pages].reshape(batch, pages)
    lens = jnp.full((batch,), context, jnp.int32)
    return {
        # float32 queries whatever the pages' dtype, as the model's projections hand them over
        "q": jnp.asarray(rng.standard_normal((batch, cfg.num_heads, cfg.head_dim), np.float32)),  # f32[S, H, D]
        "k": k, "v": v, "tables": jnp.asarray(tables),  # i32[S, P]
        "positions": lens - 1, "lens": lens, "width": width,
    }


def random_pages(rng, cfg: ModelConfig, num_pages: int, page_size: int, dtype: str):
    """Standard normal keys [KV, N, D, ps] and values [KV, N, ps, D] as the engine stores them in
    `dtype`: bfloat16 as its bits, int8 quantized by token and KV head (QuantizedPages)."""
    kv, d = cfg.num_kv_heads, cfg.head_dim
    k = jnp.asarray(rng.standard_normal((kv, num_pages, d, page_size), np.float32))
    v = jnp.asarray(rng.standard_normal((kv, num_pages, page_size, d), np.float32))
    if dtype == "int8":  # each slot's D values by their own scale: keys down a page's column, values along its row
        return QuantizedPages(*quantize(k, axis=2)), QuantizedPages(*quantize(v, axis=3))
    stored = pa.storage_dtype(dtype)
    return pa.stored(k.astype(dtype), stored), pa.stored(v.astype(dtype), stored)


def implementations(tunings: list[str], interpret: bool, int8: bool = False) -> dict:
    """name -> decode(q, k, v, tables, positions, lens), for what this backend runs (over int8
    pages not JAX's own Pallas kernel)."""
    backend = jax.default_backend()
    impls = {"jnp": pa.paged_decode_attention}
    if backend == "cpu":
        from worker.engine import cpu_attention

        if cpu_attention.load():
            impls["cpu-kernel"] = cpu_attention.paged_decode_attention
    if backend == "gpu" or interpret:
        for text in tunings:
            tuning = gpu_attention.Tuning(*parse_tuning(text))
            impls[f"pallas {text}"] = partial(gpu_attention.pallas_decode_attention, tuning=tuning, interpret=interpret)
        if not int8:
            impls["jax-pallas"] = partial(_jax_pallas, interpret=interpret)
    return impls


def _jax_pallas(q, k, v, tables, positions, lens, *, interpret: bool):
    """JAX's own kernel, at its default settings where the table allows (16 splits of the table, 8
    pages a block): keys as [KV, N, ps, D] (the engine's are [KV, N, D, ps]) in the compute dtype;
    the transposition is done once, outside the timed calls."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    splits = min(16, tables.shape[1])
    q = (q * q.shape[-1] ** -0.5).astype(k.dtype)  # it leaves the 1/sqrt(D) of the scores to the caller
    return jax_paged.paged_attention(q, k, v, tables, lens, k_splits=splits,
                                     pages_per_compute_block=min(8, tables.shape[1] // splits), interpret=interpret)


def _jax_layout(inputs: dict, dtype: str) -> tuple[jax.Array, jax.Array]:
    as_dtype = lambda x: pa.page_values(x).astype(dtype)  # noqa: E731
    return as_dtype(inputs["k"]).swapaxes(2, 3), as_dtype(inputs["v"])


def time_calls(fn, args: tuple, repeats: int, inner: int = 10) -> float:
    """Seconds per call: the best of `repeats` rounds of `inner` calls queued back to back."""
    jax.block_until_ready(fn(*args))  # compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def checked_and_timed(name: str, fn, args: tuple, reference: np.ndarray, repeats: int) -> tuple[dict, float]:
    """-> ({"name", "max_abs_error"}, seconds per call), or ({"name", "error"}, 0.0) where it fails:
    a setting this GPU or Triton cannot build is a row, not the end of the bench."""
    row: dict = {"name": name}
    try:
        call = jax.jit(fn)
        row["max_abs_error"] = float(np.abs(np.asarray(call(*args), np.float32) - reference).max())
        return row, time_calls(call, args, repeats)
    except Exception as e:  # noqa: BLE001
        return {"name": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}, 0.0


def bench_attention(cfg: ModelConfig, preset: str, batch: int, context: int, page_size: int, dtype: str,
                    tunings: list[str], interpret: bool, repeats: int, seed: int) -> dict:
    inputs = make_inputs(cfg, batch, context, page_size, dtype, seed)
    itemsize = element_bytes(dtype, cfg.head_dim)  # int8: a byte and the scales' share
    kv_bytes = int(batch * context * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize)  # one layer's keys and values
    bandwidth = roofline.memory_bandwidth_gbs()
    base = (inputs["q"], inputs["k"], inputs["v"], inputs["tables"])
    with jax.default_matmul_precision("highest"):  # the reference at full float32 precision, also on a GPU
        reference = np.asarray(jax.jit(pa.paged_decode_attention)(*base, inputs["positions"], inputs["lens"]), np.float32)
    rows = []
    for name, fn in implementations(tunings, interpret, dtype == "int8").items():
        if name == "jax-pallas":
            args = (inputs["q"], *_jax_layout(inputs, dtype), inputs["tables"], inputs["positions"], inputs["lens"])
        else:
            args = (*base, inputs["positions"], inputs["lens"])
        row, seconds = checked_and_timed(name, fn, args, reference, 1 if interpret else repeats)
        if seconds:
            row.update(us_per_call=seconds * 1e6, kv_gbs=kv_bytes / seconds / 1e9,
                       bandwidth_fraction=kv_bytes / seconds / 1e9 / bandwidth,
                       step_ms=seconds * cfg.num_layers * 1e3)
        rows.append(row)
    return {
        "model": preset, "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
        "dtype": dtype, "batch": batch, "context": context, "page_size": page_size, "table_width": inputs["width"],
        "num_layers": cfg.num_layers, "kv_bytes_per_call": kv_bytes, "memory_bandwidth_gbs": bandwidth,
        "interpret": interpret, "default_tuning": _tuning_text(gpu_attention.DEFAULT), "results": rows,
    }


def bench_prefill(cfg: ModelConfig, rows: int, chunk: int, context: int, width: int, page_size: int, dtype: str,
                  interpret: bool, repeats: int, seed: int) -> dict:
    """One layer's prefill attention: `rows` rows of `chunk` query tokens ending at `context`, over
    tables `width` pages wide, through the reference the engine runs on a GPU (with its rounding,
    `gpu_prefill.prefill_attention`) and, on a GPU or interpreted, the Pallas prefill kernel; each
    against the reference at full precision (float32 products on the same stored pages)."""
    rng = np.random.default_rng(seed + 1)
    pages = -(-context // page_size)
    num_pages = rows * width + 1
    d = cfg.head_dim
    k, v = random_pages(rng, cfg, num_pages, page_size, dtype)
    tables = np.zeros((rows, width), np.int32)
    tables[:, :pages] = rng.permutation(np.arange(1, num_pages))[: rows * pages].reshape(rows, pages)
    q = jnp.asarray(rng.standard_normal((rows, chunk, cfg.num_heads, d), np.float32))  # f32[S, Q, H, D]
    positions = jnp.asarray(np.broadcast_to(np.arange(context - chunk, context, dtype=np.int32), (rows, chunk)))
    lens = jnp.full((rows,), context, jnp.int32)
    args = (q, k, v, jnp.asarray(tables), positions, lens)
    every = np.arange(num_pages)
    exact = [pa.gather_keys(k, every).astype(jnp.float32), pa.gather_values(v, every).astype(jnp.float32)]
    with jax.default_matmul_precision("highest"):
        reference = np.asarray(jax.jit(pa.paged_attention)(q, *exact, *args[3:]), np.float32)
    flops = 4 * cfg.num_heads * d * rows * sum(range(context - chunk + 1, context + 1))  # QK and PV, causal keys
    impls = {"reference": gpu_prefill.prefill_attention}
    if jax.default_backend() == "cpu" and cpu_attention.load():  # what a CPU engine runs for prefill rows
        impls["cpu-kernel"] = cpu_attention.paged_attention
    if jax.default_backend() == "gpu" or interpret:
        impls["pallas"] = partial(gpu_prefill.pallas_prefill_attention, interpret=interpret)
    results = []
    for name, fn in impls.items():
        row, seconds = checked_and_timed(name, fn, args, reference, 1 if interpret else repeats)
        if seconds:
            row.update(us_per_call=seconds * 1e6, tflops=flops / seconds / 1e12, step_ms=seconds * cfg.num_layers * 1e3)
        results.append(row)
    return {"rows": rows, "chunk": chunk, "context": context, "table_width": width, "flops_per_call": flops,
            "results": results}


def _tuning_text(t: gpu_attention.Tuning) -> str:
    return f"{t.pages_per_block}:{t.target_programs}:{t.num_warps}:{t.num_stages}"


def fastest(report: dict, prefix: str = "pallas ") -> dict | None:
    """The fastest correct row whose name starts with `prefix`."""
    ok = [r for r in report["results"] if r["name"].startswith(prefix) and "us_per_call" in r
          and r["max_abs_error"] < 0.05]
    return min(ok, key=lambda r: r["us_per_call"], default=None)


def table(report: dict) -> str:
    lines = [f"{report['model']} decode attention, one layer: {report['batch']} rows x {report['context']} tokens, "
             f"pages of {report['page_size']} ({report['table_width']}-page tables), {report['dtype']}, on "
             f"{report['device']}: {report['kv_bytes_per_call'] / 1e6:.0f} MB of KV per call; machine "
             f"{report['memory_bandwidth_gbs']:.0f} GB/s"]
    lines.append(f"{'implementation':<22} {'us/call':>10} {'KV GB/s':>9} {'of bw':>6} {'x layers ms':>12} {'max err':>9}")
    for r in report["results"]:
        if "error" in r:
            lines.append(f"{r['name']:<22} failed: {r['error']}")
            continue
        lines.append(f"{r['name']:<22} {r['us_per_call']:>10.1f} {r['kv_gbs']:>9.0f} {r['bandwidth_fraction']:>6.0%} "
                     f"{r['step_ms']:>12.2f} {r['max_abs_error']:>9.2g}")
    best = None if report["interpret"] else fastest(report)  # interpreted calls time the interpreter
    if best:
        lines.append(f"fastest Pallas setting: {best['name'][7:]} (default {report['default_tuning']}); "
                     f"an engine takes it with --pallas-tuning {best['name'][7:]}")
    p = report.get("prefill")
    if p:
        lines.append(f"prefill attention, one layer: {p['rows']} rows x {p['chunk']} query tokens ending at token "
                     f"{p['context']} ({p['table_width']}-page tables): {p['flops_per_call'] / 1e9:.1f} GFLOP per call")
        lines.append(f"{'implementation':<22} {'us/call':>10} {'TFLOP/s':>9} {'x layers ms':>12} {'max err':>9}")
        for r in p["results"]:
            if "error" in r:
                lines.append(f"{r['name']:<22} failed: {r['error']}")
                continue
            lines.append(f"{r['name']:<22} {r['us_per_call']:>10.1f} {r['tflops']:>9.1f} {r['step_ms']:>12.2f} "
                         f"{r['max_abs_error']:>9.2g}")
        if not report["interpret"] and prefill_kernel_wins(report):
            lines.append("the Pallas prefill kernel is faster here; an engine takes it by default (--no-pallas-prefill: the reference)")
        elif not report["interpret"] and {"pallas", "reference"} <= {r["name"] for r in p["results"] if "us_per_call" in r}:
            lines.append("the reference prefill attention is faster here, or the kernel's error too large: "
                         "--no-pallas-prefill gives an engine the reference")
    return "\n".join(lines)


def prefill_kernel_wins(report: dict) -> bool:
    """Whether the Pallas prefill kernel ran correct and faster than the reference."""
    by_name = {r["name"]: r for r in report.get("prefill", {}).get("results", []) if "us_per_call" in r}
    kernel, reference = by_name.get("pallas"), by_name.get("reference")
    return bool(kernel and reference and kernel["max_abs_error"] < 0.05
                and kernel["us_per_call"] < reference["us_per_call"])
