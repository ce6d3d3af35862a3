"""The compiled CPU paged-attention kernel (worker/engine/cpu_kernels/paged_attention.cc, its decode
and prefill paths in decode_attention.h and prefill_attention.h) against the jnp reference:
decode rows, prefill rows, packed (ragged) rows, every head grouping, partly filled pages, and
decode rows that write their new key and value in the same call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_paged_attention import KERNEL_SHAPES, decode_inputs, paged_attention, reference_decode
from worker.engine import paged_attention as pa


@pytest.mark.parametrize("shape", KERNEL_SHAPES)
@pytest.mark.parametrize("window", [None, 3, 1, 21])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_compiled_cpu_kernel_matches_the_reference(window, dtype, shape):
    """The C++ kernel on decode rows (built here with the system compiler) against the reference, with
    float32 and bfloat16 pages, inside jit and with positions short of the context (a decode row
    whose later tokens are already written must not see them)."""
    from worker.engine import cpu_attention

    assert cpu_attention.load(), "the CPU kernel did not build (is a C++ compiler installed?)"
    ps, d = KERNEL_SHAPES[shape]
    q, k_pages, v_pages, tables, ctx = decode_inputs(dtype, seed=3, ps=ps, d=d)
    kernel = jax.jit(cpu_attention.paged_decode_attention, static_argnames="window")
    out = kernel(q, k_pages, v_pages, tables, ctx - 1, ctx, window)
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference_decode(q, k_pages, v_pages, tables, ctx, window)),
                               atol=1e-5, rtol=1e-5)
    early = jnp.maximum(ctx - 3, 0)  # query at position ctx - 3 with ctx keys present
    ref = paged_attention(q[:, None], k_pages.astype(jnp.float32), v_pages.astype(jnp.float32), tables,
                          early[:, None], ctx, window)[:, 0]
    np.testing.assert_allclose(np.asarray(kernel(q, k_pages, v_pages, tables, early, ctx, window)), np.asarray(ref),
                               atol=1e-5, rtol=1e-5)


def assert_kernel_decode_matches(q, k_pages, v_pages, tables, ctx, window):
    """The compiled kernel on decode rows against the reference, the query at the last position and
    at one short of the context (a decode row whose later tokens are already written)."""
    from worker.engine import cpu_attention

    kernel = jax.jit(cpu_attention.paged_decode_attention, static_argnames="window")
    for positions in (ctx - 1, jnp.maximum(ctx - 3, 0)):
        want = paged_attention(q[:, None], k_pages.astype(jnp.float32), v_pages.astype(jnp.float32), tables,
                               positions[:, None], ctx, window)[:, 0]
        np.testing.assert_allclose(np.asarray(kernel(q, k_pages, v_pages, tables, positions, ctx, window)),
                                   np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("used", [(15, 16, 17, 31, 32, 33), (1, 48, 63, 64, 2, 20)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_compiled_cpu_kernel_reads_a_partly_filled_last_page_in_part(used, dtype):
    """A decode row whose last 64-key page holds few visible keys scores only the first line of each
    key row (16 float32 keys, 32 bfloat16 ones); the rest of the page is garbage it must not use.
    Visible counts on both sides of those limits, with positions short of the context too."""
    from worker.engine import cpu_attention

    assert cpu_attention.load(), "the CPU kernel did not build (is a C++ compiler installed?)"
    contexts = [64 * (i % 3) + u for i, u in enumerate(used)]
    q, k_pages, v_pages, tables, ctx = decode_inputs(dtype, seed=11, ps=64, d=64, h=6, kv=2, contexts=contexts)
    assert_kernel_decode_matches(q, k_pages, v_pages, tables, ctx, None)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 2), (12, 2), (14, 2), (16, 2)],
                         ids=["G1", "G3", "G4", "G6", "G7", "G8"])
@pytest.mark.parametrize("d", [32, 128])
@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_compiled_cpu_kernel_decode_matches_the_reference_for_every_head_grouping(heads, kv_heads, d, window, dtype):
    """Decode rows take the query heads of a KV head in passes of up to 4 over the pages (6 = 4 + 2,
    7 = 4 + 3, 8 = 4 + 4), with the value pass split into head subsets where the accumulators would
    not fit in registers (D 128)."""
    from worker.engine import cpu_attention

    assert cpu_attention.load(), "the CPU kernel did not build (is a C++ compiler installed?)"
    # pages of 80 keys: a 64-key step (32 keys per load) and a 16-key step per page
    q, k_pages, v_pages, tables, ctx = decode_inputs(dtype, seed=5, ps=80, d=d, h=heads, kv=kv_heads)
    assert_kernel_decode_matches(q, k_pages, v_pages, tables, ctx, window)


@pytest.mark.parametrize("shape", KERNEL_SHAPES)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_compiled_cpu_kernel_matches_the_reference_on_prefill_rows(window, dtype, shape):
    """Rows of several queries (prefill chunks, one split over two rows, padding queries and a
    padding row) through the C++ kernel against the reference, on a page table wider than any
    context (the engine gives the kernel the widest table on every step)."""
    from worker.engine import cpu_attention

    assert cpu_attention.load(), "the CPU kernel did not build (is a C++ compiler installed?)"
    rng = np.random.default_rng(11)
    s, qn, h, kv, n, p = 5, 6, 4, 2, 48, 8
    ps, d = KERNEL_SHAPES[shape]
    k_pages = jnp.asarray(rng.normal(size=(kv, n, d, ps)), dtype)
    v_pages = jnp.asarray(rng.normal(size=(kv, n, ps, d)), dtype)
    tables = rng.permutation(n)[: s * p].reshape(s, p).astype(np.int32)
    tables[3] = tables[2]  # rows 2 and 3: one sequence's 11-token chunk split over two rows
    ctx = np.asarray([6, 13, 19, 19, 0], np.int32)  # row 4: padding
    starts, lens = [0, 9, 8, 14, 0], [6, 4, 6, 5, 0]  # first position and real queries of each row
    positions = np.zeros((s, qn), np.int32)
    for r in range(s):
        positions[r, : lens[r]] = np.arange(starts[r], starts[r] + lens[r])
    q = jnp.asarray(rng.normal(size=(s, qn, h, d)), jnp.float32)
    kernel = jax.jit(cpu_attention.paged_attention, static_argnames="window")
    out = np.asarray(kernel(q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(positions), jnp.asarray(ctx), window))
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = np.asarray(paged_attention(q, f32(k_pages), f32(v_pages), jnp.asarray(tables), jnp.asarray(positions),
                                     jnp.asarray(ctx), window))
    for r in range(s):
        np.testing.assert_allclose(out[r, : lens[r]], ref[r, : lens[r]], atol=1e-5, rtol=1e-5, err_msg=f"row {r}")
    assert not out[4].any()  # a padding row sees no key: zeros


def packed_rows(rng, spans: list[tuple[int, int]], n: int, p: int, trailing: int):
    """Rows packed back to back, row r's queries at positions [first, first + length) of `spans[r]`
    (length 0: a padding row), tables `p` random pages of `n` wide, `trailing` padding tokens after
    them -> (tables i32[R, P], q_starts, q_lens, context_lens i32[R], positions i32[T])."""
    lengths = [length for _, length in spans]
    tables = rng.integers(1, n, size=(len(spans), p)).astype(np.int32)
    q_starts = np.cumsum([0] + lengths[:-1]).astype(np.int32)
    ctx = np.asarray([first + length for first, length in spans], np.int32)
    positions = np.zeros(sum(lengths) + trailing, np.int32)
    for (first, length), start in zip(spans, q_starts):
        positions[start : start + length] = np.arange(first, first + length)
    return tables, q_starts, np.asarray(lengths, np.int32), ctx, positions


@pytest.mark.parametrize("heads", [(4, 2), (3, 1), (8, 2)], ids=["g2", "g3", "g4"])
@pytest.mark.parametrize("shape", KERNEL_SHAPES)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_compiled_cpu_kernel_on_packed_rows_equals_the_reference_row_by_row(window, dtype, shape, heads):
    """The ragged form the engine's packed steps use: decode rows and prefill chunks of different
    lengths (longer than the kernel's 16-query work blocks) packed back to back, padding rows and
    trailing padding tokens. Each row must equal the reference run on that row alone; tokens in no
    row come back as zeros. Query heads per KV head 2, 3 and 4: a block's query rows (tokens x
    heads) in full tiles and remainders of the kernel's row tiles."""
    from worker.engine import cpu_attention

    assert cpu_attention.load(), "the CPU kernel did not build (is a C++ compiler installed?)"
    rng = np.random.default_rng(5)
    (h, kv), n, p = heads, 64, 12
    ps, d = KERNEL_SHAPES[shape]
    k_pages = jnp.asarray(rng.normal(size=(kv, n, d, ps)), dtype)
    v_pages = jnp.asarray(rng.normal(size=(kv, n, ps, d)), dtype)
    # (first position, query tokens) per row: 2 decode rows, chunks of 37, 3 and 20 tokens, 2 padding rows
    spans = [(9, 1), (30, 1), (0, 37), (21, 3), (11, 20), (0, 0), (0, 0)]
    tables, q_starts, q_lens, ctx, positions = packed_rows(rng, spans, n, p, trailing=7)
    q = jnp.asarray(rng.normal(size=(len(positions), h, d)), jnp.float32)
    kernel = jax.jit(cpu_attention.ragged_paged_attention, static_argnames="window")
    out = np.asarray(kernel(q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(positions), jnp.asarray(q_starts),
                            jnp.asarray(q_lens), jnp.asarray(ctx), window))
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    for row, ((first, length), start) in enumerate(zip(spans, q_starts)):
        if not length:
            continue
        ref = paged_attention(q[None, start : start + length], f32(k_pages), f32(v_pages), jnp.asarray(tables[row : row + 1]),
                              jnp.asarray(positions[None, start : start + length]), jnp.asarray(ctx[row : row + 1]), window)
        np.testing.assert_allclose(out[start : start + length], np.asarray(ref[0]), atol=1e-5, rtol=1e-5,
                                   err_msg=f"row {row}")
    assert not out[int(q_lens.sum()) :].any()  # padding tokens: zeros


@pytest.mark.parametrize("heads,kv_heads,d", [(16, 2, 128), (2, 2, 256), (8, 2, 96)], ids=["g8-d128", "g1-d256", "g4-d96"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_compiled_cpu_kernel_prefill_blocks_at_wide_heads_and_large_groups(heads, kv_heads, d, dtype):
    """Prefill blocks whose query rows (tokens x heads) fill many score tiles (8 heads a KV head:
    128 query rows a block) or one (1 head), with head dims whose value tiles hold 3, 1 and 4
    queries; a chunk that starts mid-page and crosses pages, windowed and not."""
    from worker.engine import cpu_attention

    assert cpu_attention.load(), "the CPU kernel did not build (is a C++ compiler installed?)"
    rng = np.random.default_rng(d + heads)
    ps, n, p = 16, 24, 6
    k_pages = jnp.asarray(rng.normal(size=(kv_heads, n, d, ps)), dtype)
    v_pages = jnp.asarray(rng.normal(size=(kv_heads, n, ps, d)), dtype)
    tables = jnp.asarray(rng.permutation(n)[: 2 * p].reshape(2, p), jnp.int32)
    first, chunk = 21, 40  # queries at positions 21..60 of a 61-token sequence; a second row of 3
    positions = np.zeros((2, chunk), np.int32)
    positions[0] = np.arange(first, first + chunk)
    positions[1, :3] = np.arange(5, 8)
    ctx = jnp.asarray([first + chunk, 8], jnp.int32)
    q = jnp.asarray(rng.normal(size=(2, chunk, heads, d)), jnp.float32)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    kernel = jax.jit(cpu_attention.paged_attention, static_argnames="window")
    for window in (None, 19):
        out = np.asarray(kernel(q, k_pages, v_pages, tables, jnp.asarray(positions), ctx, window))
        ref = np.asarray(paged_attention(q, f32(k_pages), f32(v_pages), tables, jnp.asarray(positions), ctx, window))
        np.testing.assert_allclose(out[0], ref[0], atol=1e-5, rtol=1e-5, err_msg=f"window {window}")
        np.testing.assert_allclose(out[1, :3], ref[1, :3], atol=1e-5, rtol=1e-5, err_msg=f"window {window}")


@pytest.mark.parametrize("window", [None, 70])
@pytest.mark.parametrize("sharp", [1.0, 12.0], ids=["plain", "sharp"])
def test_compiled_cpu_kernel_prefill_blocks_end_mid_page_and_softmax_over_whole_vectors(window, sharp):
    """The demo model's prefill shape (pages of 64, head dim 32, 2 query heads a KV head): a chunk
    of 150 tokens after 100 cached, so its 16-token blocks end mid-page (each block scores keys up
    to its own last one, not the page's) and a window starts them mid-vector (the softmax runs on
    whole 16-key vectors and zeroes the keys outside each query's range). `sharp` scales the
    queries so that scores spread over tens of units: the kernel's exponential is its own."""
    from worker.engine import cpu_attention

    assert cpu_attention.load(), "the CPU kernel did not build (is a C++ compiler installed?)"
    rng = np.random.default_rng(40)
    heads, kv_heads, d, ps, n, p = 8, 4, 32, 64, 16, 5
    k_pages = jnp.asarray(rng.normal(size=(kv_heads, n, d, ps)), jnp.float32)
    v_pages = jnp.asarray(rng.normal(size=(kv_heads, n, ps, d)), jnp.float32)
    tables = jnp.asarray(rng.permutation(np.arange(1, n))[:p].reshape(1, p), jnp.int32)
    positions = jnp.asarray(np.arange(100, 250, dtype=np.int32)[None])  # [1, 150]
    ctx = jnp.asarray([250], jnp.int32)
    q = jnp.asarray(rng.normal(size=(1, 150, heads, d)) * sharp, jnp.float32)
    kernel = jax.jit(cpu_attention.paged_attention, static_argnames="window")
    out = np.asarray(kernel(q, k_pages, v_pages, tables, positions, ctx, window))
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(paged_attention(q, k_pages, v_pages, tables, positions, ctx, window))
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", KERNEL_SHAPES)
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_compiled_cpu_kernel_writes_and_attends_decode_rows_in_one_call(window, dtype, shape):
    """`write_decode_attention` (each decode row's new key and value written by the work item that
    then attends) gives the pages and outputs of the page-write kernel followed by the decode
    kernel, bit for bit, and the jnp reference's to float32 rounding: rows whose token starts,
    ends or sits inside a page, a padding row (slot 0, no context) and a row past its own fused
    steps (slot 0: writes nothing, still attends)."""
    from worker.engine import cpu_attention

    assert cpu_attention.load(), "the CPU kernel did not build (is a C++ compiler installed?)"
    ps, d = KERNEL_SHAPES[shape]
    rng = np.random.default_rng(17)
    s, kv, h, n, p = 6, 2, 4, 40, 6
    stored = pa.storage_dtype(dtype)  # bfloat16 pages as their bits, as the engine holds them
    k_pages = pa.stored(jnp.asarray(rng.normal(size=(kv, n, d, ps)), jnp.float32), stored)
    v_pages = pa.stored(jnp.asarray(rng.normal(size=(kv, n, ps, d)), jnp.float32), stored)
    tables = rng.permutation(np.arange(1, n))[: s * p].reshape(s, p).astype(np.int32)  # page 0 is reserved
    ctx = np.asarray([1, ps, ps + 1, 3 * ps - 1, 0, 2 * ps + 2], np.int32)
    positions = np.maximum(ctx - 1, 0)
    slots = tables[np.arange(s), positions // ps] * ps + positions % ps
    slots[4] = slots[5] = 0  # a padding row; a row past its own steps
    q = jnp.asarray(rng.normal(size=(s, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(s, kv, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(s, kv, d)), jnp.float32)
    args = (jnp.asarray(tables), jnp.asarray(positions), jnp.asarray(ctx))

    fused = jax.jit(cpu_attention.write_decode_attention, static_argnames="window")
    out, kp, vp = fused(q, k, v, jnp.asarray(slots), k_pages, v_pages, *args, window=window)

    def separate(k_pages, v_pages):
        kp, vp = cpu_attention.write_pages(k_pages, v_pages, k, v, jnp.asarray(slots))
        return cpu_attention.paged_decode_attention(q, kp, vp, *args, window), kp, vp

    want_out, want_kp, want_vp = jax.jit(separate)(k_pages, v_pages)
    np.testing.assert_array_equal(np.asarray(kp), np.asarray(want_kp))
    np.testing.assert_array_equal(np.asarray(vp), np.asarray(want_vp))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
    ref_kp, ref_vp = jax.jit(pa.write_pages)(k_pages, v_pages, k, v, jnp.asarray(slots))
    np.testing.assert_array_equal(pa.page_values(kp).astype(jnp.float32), pa.page_values(ref_kp).astype(jnp.float32))
    np.testing.assert_array_equal(pa.page_values(vp).astype(jnp.float32), pa.page_values(ref_vp).astype(jnp.float32))
    live = [0, 1, 2, 3, 5]
    ref = reference_decode(q, pa.page_values(ref_kp), pa.page_values(ref_vp), args[0], args[2], window)
    np.testing.assert_allclose(np.asarray(out)[live], np.asarray(ref)[live], atol=1e-5, rtol=1e-5)
    assert not np.asarray(out)[4].any()  # the padding row sees no key
