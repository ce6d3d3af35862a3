"""Prefill rows' paged attention on GPUs: the reference with the decode kernel's rounding, and a
Pallas kernel (Triton backend) that reads the pages in place.

A row-layout step gives prefill rows as q [S, Q, H, D]: S rows of Q query tokens, each row a run of
one sequence's positions (`positions` [S, Q]) over its page table. The reference
(`paged_attention.paged_attention`) gathers every row's whole table into a copy and scores each
query against all of it, masked: a [S, KV, G, Q, L] float32 score tensor written and read back
several times (softmax), L the step's page-table width, however short the row's own context.

The kernel (`pallas_prefill_attention`) runs one program per (row, KV head, block of query
tokens): the block's queries for the KV head's G query heads are one [tokens x G, D] tile; it
walks the row's pages up to the block's last visible key, a few pages per loop iteration, with an
online softmax in float32 and each query's own causal (and sliding-window) range. Nothing is
gathered and no score leaves the chip. Over bfloat16 pages its products take bfloat16 operands
(the query and the softmax weights rounded), float32 sums, as the decode kernel's; over int8
pages (kv_quant.py) too, their values widened exactly to bfloat16 and each key's and value's scale
applied to its scores and its weights, as the decode kernel applies them.

`interpret=True` runs it through Pallas's interpreter on any backend (the tests on the CPU).
`bench attention` times it against the reference on the GPU at hand; an engine takes it with
`--pallas-prefill` (EngineConfig.pallas_prefill).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from worker.engine.kv_quant import QuantizedPages
from worker.engine.paged_attention import BF16_BITS, MASKED, paged_attention

MIN_TILE = 16  # rows of Triton's smallest dot
BLOCK_TOKENS = 16  # query tokens per program (times the padded group: 64 rows for llama3-8b)
PAGES_PER_BLOCK = 4  # pages whose loads one loop iteration issues together


def prefill_attention(
    q: jax.Array,  # [S, Q, H, D]
    k_pages: jax.Array,  # [KV, N, D, page_size]
    v_pages: jax.Array,  # [KV, N, page_size, D]
    page_tables: jax.Array,  # i32[S, P]
    positions: jax.Array,  # i32[S, Q]
    context_lens: jax.Array,  # i32[S]
    window: int | None = None,
) -> jax.Array:  # [S, Q, H, D]
    """Prefill rows through the reference (`paged_attention`), rounding as the decode kernel does:
    over bfloat16 pages the query and the softmax weights go into their products as bfloat16 (the
    tensor cores; float32 operands made them TF32 or full-precision float32 products, with float32
    copies of the gathered pages), the sums stay float32. A bfloat16 model in transformers rounds
    the same way. Float32 pages keep the reference's float32 products."""
    compute = jnp.bfloat16 if k_pages.dtype == BF16_BITS else q.dtype
    out = paged_attention(q.astype(compute), k_pages, v_pages, page_tables, positions, context_lens, window)
    return out.astype(q.dtype)


def page_at(tables_ref, num_pages: int, i):
    """Inside a kernel: the i-th page of a table; an index past the table or the cache gives a page
    that exists (the caller masks its keys)."""
    return jnp.clip(tables_ref[jnp.minimum(i, tables_ref.shape[0] - 1)], 0, num_pages - 1)  # never outside the cache


def load_page(tables_ref, k_ref, v_ref, i, bits: bool):
    """Inside a kernel: the keys [D, ps] and values [ps, D] of the i-th page of a table, as numbers
    (bfloat16 bit patterns reinterpreted; int8 pages as their int8 values, scales apart)."""
    p = page_at(tables_ref, k_ref.shape[0], i)
    k, v = k_ref[p], v_ref[p]
    if bits:
        k, v = (jax.lax.bitcast_convert_type(x, jnp.bfloat16) for x in (k, v))
    return k, v


def online_softmax(m, l, acc, scores: list, values: list, precision, masks: list | None = None,
                   value_scales: list | None = None):
    """Inside a kernel: one online-softmax update over a block of pages. m, l f32[R] (running max,
    sum of weights), acc f32[R, D]; scores f32[R, ps] per page (MASKED where hidden), values [ps, D]
    per page in the products' dtype; masks bool[R, ps] per page where a row may see none of the
    block's keys (its weights must then be 0 however its running max stands); value_scales f32[ps]
    per page of int8 values (a key's weight times its value's scale enters the weighted sum, its
    weight alone the sum of weights) -> (m, l, acc)."""
    m_new = m
    for s in scores:
        m_new = jnp.maximum(m_new, s.max(axis=-1))
    correction = jnp.exp(m - m_new)
    l, acc = l * correction, acc * correction[:, None]
    for r, (s, v) in enumerate(zip(scores, values)):
        w = jnp.exp(s - m_new[:, None])  # [R, ps]
        if masks is not None:
            w = jnp.where(masks[r], w, 0.0)
        l = l + w.sum(axis=-1)
        if value_scales is not None:
            w = w * value_scales[r][None, :]
        acc = acc + jnp.dot(w.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
    return m_new, l, acc


def _kernel(tables_ref, pos_ref, ctx_ref, q_ref, k_ref, v_ref, *refs, window: int, bits: bool, int8: bool,
            pages_per_block: int):
    # one program: prefill row pl.program_id(0), KV head pl.program_id(1), block of query tokens pl.program_id(2)
    # tables_ref i32[P]; pos_ref i32[R]: each query row's position (R = tokens x padded group, token-major);
    # ctx_ref i32[1]; q_ref [R, D]; k_ref [N, D, ps]; v_ref [N, ps, D]; int8 pages: then ks_ref, vs_ref
    # f32[N, ps] (each slot's scale); out: o_ref f32[R, D] (normalized)
    ks_ref, vs_ref, o_ref = refs if int8 else (None, None, *refs)
    rows, d = q_ref.shape
    ps, width = k_ref.shape[-1], tables_ref.shape[0]
    pos = pos_ref[...]
    # keys [lo, hi) are visible to each query row; never past the page table
    hi = jnp.minimum(jnp.minimum(pos + 1, ctx_ref[0]), width * ps)  # [R]
    lo = jnp.maximum(pos - window + 1, 0) if window else jnp.zeros_like(pos)  # [R]
    q = q_ref[...]
    exact = q.dtype == jnp.float32  # float32: full-precision products (no TF32)
    precision = jax.lax.Precision.HIGHEST if exact else None
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    begin = jnp.min(lo) // ps  # the block's pages with a key some row sees: [begin, stop)
    stop = jnp.maximum(pl.cdiv(jnp.max(hi), ps), begin)

    def block(b, carry):
        m, l, acc = carry  # f32[R], f32[R], f32[R, D]
        scores, masks, values, value_scales = [], [], [], []
        for r in range(pages_per_block):  # every page's loads before any softmax update needs them
            i = begin + b * pages_per_block + r
            k, v = load_page(tables_ref, k_ref, v_ref, i, bits)  # [D, ps], [ps, D]
            s = jnp.dot(q, k.astype(q.dtype), precision=precision, preferred_element_type=jnp.float32) * scale
            if int8:  # int8 values are exact in bfloat16; the scales apply to scores and weights
                page = page_at(tables_ref, k_ref.shape[0], i)
                s = s * ks_ref[page][None, :]
                value_scales.append(vs_ref[page])
            j = (i * ps + jnp.arange(ps))[None, :]  # [1, ps]
            visible = (j >= lo[:, None]) & (j < hi[:, None]) & (i < stop)  # [R, ps]
            scores.append(jnp.where(visible, s, MASKED))
            masks.append(visible)
            values.append(v.astype(q.dtype))
        # a row may see none of a block's keys (its window starts later, or it ends earlier)
        return online_softmax(m, l, acc, scores, values, precision, masks, value_scales if int8 else None)

    init = (jnp.full((rows,), MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, pl.cdiv(stop - begin, pages_per_block), block, init)
    # a row that sees no key (padding) gets zeros
    o_ref[...] = jnp.where((l > 0)[:, None], acc / jnp.maximum(l, 1e-30)[:, None], 0.0)


def pallas_prefill_attention(
    q: jax.Array,  # [S, Q, H, D]
    k_pages: jax.Array | QuantizedPages,  # [KV, N, D, page_size]
    v_pages: jax.Array | QuantizedPages,  # [KV, N, page_size, D]
    page_tables: jax.Array,  # i32[S, P]
    positions: jax.Array,  # i32[S, Q]
    context_lens: jax.Array,  # i32[S]
    window: int | None = None,
    *,
    interpret: bool = False,
    block_tokens: int = BLOCK_TOKENS,
    pages_per_block: int = PAGES_PER_BLOCK,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:  # [S, Q, H, D]
    """Same contract as `paged_attention.paged_attention`, with zeros for queries that see no key."""
    s, qn, h, d = q.shape
    kv, n, _, ps = k_pages.shape
    g = h // kv
    gp = 1 << (g - 1).bit_length()  # the group padded to a power of two (Triton's tiles)
    bt = 1 << (max(block_tokens, -(-MIN_TILE // gp)) - 1).bit_length()  # tokens a program: bt * gp >= 16 rows
    qpad = -(-qn // bt) * bt
    int8 = isinstance(k_pages, QuantizedPages)
    bits = k_pages.dtype == BF16_BITS
    compute = jnp.bfloat16 if bits or int8 else q.dtype  # int8 values are exact in bfloat16
    qg = q.astype(compute).reshape(s, qn, kv, g, d)
    qg = jnp.pad(qg, ((0, 0), (0, qpad - qn), (0, 0), (0, gp - g), (0, 0)))  # [S, Qpad, KV, Gp, D]
    qg = qg.transpose(0, 2, 1, 3, 4).reshape(s, kv, qpad * gp, d)  # [S, KV, Qpad * Gp, D], token-major
    pos = jnp.pad(positions.astype(jnp.int32), ((0, 0), (0, qpad - qn)))  # padding queries: position 0
    pos = jnp.repeat(pos, gp, axis=1)  # [S, Qpad * Gp]
    p = page_tables.shape[1]
    rows = bt * gp
    pages = (k_pages.data, v_pages.data, k_pages.scales, v_pages.scales) if int8 else (k_pages, v_pages)
    scales = [pl.BlockSpec((None, n, ps), lambda i, j, c: (j, 0, 0))] * 2 if int8 else []  # this KV head's
    out = pl.pallas_call(
        partial(_kernel, window=int(window or 0), bits=bits, int8=int8, pages_per_block=pages_per_block),
        grid=(s, kv, qpad // bt),
        in_specs=[
            pl.BlockSpec((None, p), lambda i, j, c: (i, 0)),  # the row's page table
            pl.BlockSpec((None, rows), lambda i, j, c: (i, c)),  # its queries' positions
            pl.BlockSpec((1,), lambda i, j, c: (i,)),  # its context length
            pl.BlockSpec((None, None, rows, d), lambda i, j, c: (i, j, c, 0)),  # the block's queries for this KV head
            pl.BlockSpec((None, n, d, ps), lambda i, j, c: (j, 0, 0, 0)),  # this KV head's key pages
            pl.BlockSpec((None, n, ps, d), lambda i, j, c: (j, 0, 0, 0)),  # and value pages
            *scales,  # int8 pages: their key and value scales
        ],
        out_specs=pl.BlockSpec((None, None, rows, d), lambda i, j, c: (i, j, c, 0)),
        out_shape=jax.ShapeDtypeStruct((s, kv, qpad * gp, d), jnp.float32),
        interpret=interpret,
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="redjax_paged_prefill_attention",
    )(page_tables.astype(jnp.int32), pos, context_lens.astype(jnp.int32), qg, *pages)
    out = out.reshape(s, kv, qpad, gp, d)[:, :, :qn, :g]  # [S, KV, Q, G, D]
    return out.transpose(0, 2, 1, 3, 4).reshape(s, qn, h, d).astype(q.dtype)
