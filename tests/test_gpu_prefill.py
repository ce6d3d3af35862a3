"""The Pallas/Triton prefill attention kernel (worker/engine/gpu_prefill.py) against the jnp
reference (itself held to torch in test_paged_attention.py), and lowered for CUDA to check it
becomes one Triton kernel. On a GPU the kernel runs compiled; elsewhere (CI) through Pallas's
interpreter, which runs the same kernel code."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from worker.engine import attention_choice, gpu_attention, gpu_prefill, paged_attention as pa
from worker.engine.attention_choice import AttentionUnavailable, choose_attention

ON_GPU = jax.default_backend() == "gpu"
prefill = partial(gpu_prefill.pallas_prefill_attention, interpret=not ON_GPU)


def rows_of_chunks(rng, heads, kv_heads, dim, page_size, num_pages, width, contexts, chunk, stored=jnp.float32):
    """Pages full of garbage (only what the tables and lengths name may be read) and one prefill row
    per context: the row's last `chunk` tokens as its queries, padded to `chunk` where shorter."""
    k = rng.standard_normal((kv_heads, num_pages, dim, page_size), dtype=np.float32) * 3
    v = rng.standard_normal((kv_heads, num_pages, page_size, dim), dtype=np.float32) * 3
    to = (lambda x: pa.stored(jnp.asarray(x), pa.BF16_BITS)) if stored == pa.BF16_BITS else jnp.asarray
    rows = len(contexts)
    tables = rng.permutation(np.arange(1, num_pages))[: rows * width].reshape(rows, width).astype(np.int32)
    q = rng.standard_normal((rows, chunk, heads, dim), dtype=np.float32)
    lens = np.asarray(contexts, np.int32)
    positions = np.maximum(lens[:, None] - chunk, 0) + np.arange(chunk)[None, :]  # past the context: padding
    return (jnp.asarray(q), to(k), to(v), jnp.asarray(tables), jnp.asarray(positions.astype(np.int32)),
            jnp.asarray(lens))


def valid(positions, lens):
    """The query tokens that exist (position inside the context); padding queries are free."""
    return np.asarray(positions) < np.asarray(lens)[:, None]


@pytest.mark.parametrize("heads,kv_heads,dim,page_size,window,chunk", [
    (8, 2, 32, 16, None, 16),  # 4 query heads per KV head: 4 x 16 rows a program
    (4, 4, 16, 32, None, 8),  # no grouping, pages of 32, a chunk shorter than a program's block
    (6, 2, 64, 16, 21, 16),  # a sliding window that starts mid-page; 3 heads per group (padded to 4)
    (8, 2, 32, 16, None, 40),  # a chunk that is not a multiple of the block (padded inside)
])
def test_kernel_matches_the_reference(heads, kv_heads, dim, page_size, window, chunk):
    rng = np.random.default_rng(0)
    # a row from the start, a row deep in its context, a row whose chunk is partly padding, a padding row
    contexts = [chunk, 5 * page_size + 3, chunk // 2 + 1, 0]
    q, k, v, tables, positions, lens = rows_of_chunks(rng, heads, kv_heads, dim, page_size, 40, 8, contexts, chunk)
    got = np.asarray(prefill(q, k, v, tables, positions, lens, window))
    with jax.default_matmul_precision("highest"):  # a GPU's float32 einsum defaults to TF32 (10-bit mantissa)
        ref = np.asarray(pa.paged_attention(q, k, v, tables, positions, lens, window))
    keep = valid(positions, lens)
    np.testing.assert_allclose(got[keep], ref[keep], rtol=1e-5, atol=1e-5)
    assert not got[3].any()  # a row with no context sees nothing: zeros


def test_bfloat16_pages_round_like_the_reference_on_a_rounded_query():
    """Over bfloat16 pages a float32 query enters the products as bfloat16 (as
    `gpu_prefill.prefill_attention`, the reference with that rounding, does)."""
    rng = np.random.default_rng(1)
    q, k, v, tables, positions, lens = rows_of_chunks(rng, 8, 2, 32, 16, 40, 8, [70, 16, 33], 16,
                                                      stored=pa.BF16_BITS)
    got = prefill(q, k, v, tables, positions, lens)
    assert got.dtype == jnp.float32
    ref = np.asarray(gpu_prefill.prefill_attention(q, k, v, tables, positions, lens))
    keep = valid(positions, lens)
    np.testing.assert_allclose(np.asarray(got)[keep], ref[keep], rtol=2e-2, atol=2e-2)  # bfloat16 weights, rounded apart


@pytest.mark.parametrize("window", [None, 21])
def test_int8_pages_with_their_scales(window):
    """int8 pages (kv_quant.py): each key's scale multiplies its scores and each value's its weight
    in the weighted sum; the products in bfloat16 (the int8 values exact, the query and weights
    rounded), so the result is the reference's over the dequantized pages to bfloat16 rounding."""
    from worker.engine.int8_linear import quantize
    from worker.engine.kv_quant import QuantizedPages

    rng = np.random.default_rng(3)
    q, k, v, tables, positions, lens = rows_of_chunks(rng, 8, 2, 32, 16, 40, 8, [70, 16, 33, 0], 16)
    k, v = QuantizedPages(*quantize(k, axis=2)), QuantizedPages(*quantize(v, axis=3))
    got = np.asarray(prefill(q, k, v, tables, positions, lens, window))
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(pa.paged_attention(q, k, v, tables, positions, lens, window))
    keep = valid(positions, lens)
    # bfloat16 weights and products: within a percent of the largest output
    assert np.abs(got[keep] - ref[keep]).max() < 0.01 * np.abs(ref[keep]).max()
    assert not got[3].any()
    # the scales are read per page: the same pages with every scale doubled double each output
    # (values' scales) and sharpen the softmax (keys'), which the reference sees alike
    k2 = QuantizedPages(k.data, k.scales * 2)
    got2 = np.asarray(prefill(q, k2, v, tables, positions, lens, window))
    with jax.default_matmul_precision("highest"):
        ref2 = np.asarray(pa.paged_attention(q, k2, v, tables, positions, lens, window))
    assert np.abs(got2[keep] - ref2[keep]).max() < 0.01 * np.abs(ref2[keep]).max()
    assert np.abs(got2[keep] - got[keep]).max() > 0.1 * np.abs(got[keep]).max()


def test_a_long_context_over_many_blocks_of_pages():
    """A chunk of 32 tokens at the end of a 1000-token context: 63 pages of 16, over 16 loop
    iterations of 4 pages, the last one partly past the row's table."""
    rng = np.random.default_rng(2)
    q, k, v, tables, positions, lens = rows_of_chunks(rng, 8, 2, 32, 16, 200, 63, [1000, 520], 32)
    got = np.asarray(prefill(q, k, v, tables, positions, lens))
    with jax.default_matmul_precision("highest"):  # not TF32 on a GPU
        ref = np.asarray(pa.paged_attention(q, k, v, tables, positions, lens))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stored,rows,chunk,n,p", [(pa.BF16_BITS, 1, 1024, 1024, 128),
                                                   (pa.BF16_BITS, 16, 64, 3000, 130),
                                                   (jnp.float32, 4, 256, 1024, 64),
                                                   (jnp.int8, 1, 1024, 1024, 128)])
def test_lowers_to_one_triton_kernel_for_cuda(stored, rows, chunk, n, p):
    """The llama3-8b prefill shapes of a 1024-token step (32 heads, 8 KV heads, head dim 128, pages
    of 16: one row of 1024 tokens, or 16 rows of 64), with the model's float32 queries, lower for
    CUDA to a single Triton kernel (a primitive Triton cannot express fails here, not on the GPU);
    int8 pages with their scales too."""
    from worker.engine.kv_quant import QuantizedPages

    def pages(shape):
        if stored == jnp.int8:
            return QuantizedPages(jax.ShapeDtypeStruct(shape, jnp.int8), jax.ShapeDtypeStruct((8, n, 16), jnp.float32))
        return jax.ShapeDtypeStruct(shape, stored)

    q = jax.ShapeDtypeStruct((rows, chunk, 32, 128), jnp.float32)
    k = pages((8, n, 128, 16))
    v = pages((8, n, 16, 128))
    ints = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in ((rows, p), (rows, chunk), (rows,))]
    fn = jax.jit(gpu_prefill.pallas_prefill_attention)
    text = fn.trace(q, k, v, *ints).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1, text[:2000]
    assert "redjax_paged_prefill_attention" in text


def test_the_choice(monkeypatch):
    """With the Pallas decode kernel, prefill rows take the Pallas prefill kernel where it compiles
    (`pallas_prefill` None), always (True: else an error) or never (False); True with another
    attention is an error, False there changes nothing."""
    with pytest.raises(AttentionUnavailable, match="pallas_prefill applies to the Pallas decode kernel, and this "
                                                   "engine runs jnp attention"):
        choose_attention("jnp", 1, 128, 16, jnp.float32, jnp.float32, None, True)
    assert choose_attention("jnp", 1, 128, 16, jnp.float32, jnp.float32, None, False) is pa.JNP
    assert choose_attention("jnp", 1, 128, 16, jnp.float32, jnp.float32) is pa.JNP
    if ON_GPU:
        ops = choose_attention("auto", 1, 128, 16, jnp.bfloat16, jnp.bfloat16)
        assert ops.name == "pallas" and ops.prefill is gpu_prefill.pallas_prefill_attention
        assert choose_attention("auto", 1, 128, 16, jnp.bfloat16, jnp.bfloat16, None, True).prefill is ops.prefill
        off = choose_attention("auto", 1, 128, 16, jnp.bfloat16, jnp.bfloat16, None, False)
        assert off.name == "pallas" and off.prefill is gpu_prefill.prefill_attention
    # the same decisions wherever the decode kernel was chosen, the prefill kernel compiling or not
    monkeypatch.setattr(attention_choice, "_choose", lambda *args: gpu_attention.PALLAS)
    for compiles in (True, False):
        monkeypatch.setattr(attention_choice, "prefill_compiles", lambda *args, ok=compiles: ok)
        auto = choose_attention("auto", 1, 128, 16, jnp.bfloat16, jnp.bfloat16)
        assert auto.prefill is (gpu_prefill.pallas_prefill_attention if compiles else gpu_prefill.prefill_attention)
        off = choose_attention("auto", 1, 128, 16, jnp.bfloat16, jnp.bfloat16, None, False)
        assert off.prefill is gpu_prefill.prefill_attention
        if compiles:
            assert choose_attention("auto", 1, 128, 16, jnp.bfloat16, jnp.bfloat16, None, True).prefill is auto.prefill
        else:
            with pytest.raises(RuntimeError, match="the Pallas prefill kernel did not compile"):
                choose_attention("auto", 1, 128, 16, jnp.bfloat16, jnp.bfloat16, None, True)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_the_startup_probe_runs_the_kernel_over_the_engines_pages(monkeypatch, kv_dtype):
    """`prefill_compiles` runs the kernel once over pages as the engine stores them (int8 with
    their scales); here through the interpreter (a CPU cannot compile it, and says so with False)."""
    seen, kernel = [], gpu_prefill.pallas_prefill_attention

    def interpreted(q, k, *args, **kwargs):
        seen.append((type(k).__name__, str(k.dtype)))
        return kernel(q, k, *args, interpret=True, **kwargs)

    if not ON_GPU:
        assert not attention_choice.prefill_compiles.__wrapped__(32, 16, "float32", kv_dtype)
    monkeypatch.setattr(gpu_prefill, "pallas_prefill_attention", interpreted)
    assert attention_choice.prefill_compiles.__wrapped__(32, 16, "float32", kv_dtype)
    pages = ("QuantizedPages", "int8") if kv_dtype == "int8" else ("DynamicJaxprTracer", "uint16")  # bfloat16 bits
    assert seen == [pages]
