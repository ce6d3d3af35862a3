"""Decode paged attention for GPUs as a Pallas kernel (Triton backend), reading pages in place.

The jnp decode path (`paged_attention.paged_decode_attention`) gathers each block of pages into a
copy before its two matmuls, so every step moves the running sequences' K/V through memory about
three times (read, write the copy, read it again). Here each program walks a run of one
sequence's page table for one KV head and reads each page once, straight from the cache, with an
online softmax, stopping at the sequence's own context (a short sequence in a batch of long ones
costs only its own pages). Each loop iteration reads a block of pages, all their loads issued
before the softmax update that needs them, and each context is split over several programs
(`Tuning`), whose partial softmaxes are joined afterwards: one page at a time over one program
per row and KV head left a GPU waiting on memory latency (session 29's H200 read the KV at ~0.7
TB/s of 3.7 so), and at batch 1 the 8 KV heads of llama3-8b alone would keep 8 of an H100's 132
multiprocessors busy. Session 30's H200 read it at 84 % of the bandwidth with the default split.

Layout (paged_attention.py): keys [KV, N, D, page_size] (transposed pages), values
[KV, N, page_size, D]; bfloat16 pages arrive as their bit patterns (uint16); int8 pages
(kv_quant.py) with their scales, which multiply a page's scores and, in the weighted sum, its
weights; their values widen exactly to bfloat16 for the products. The query heads that
share a KV head are one block of G rows, padded to 16 (Triton's smallest matrix-multiply tile), so
each page costs two [16, D] x [D, ps] / [16, ps] x [ps, D] products. Page size and head dim must be
powers of two of at least 16 (`supported`); otherwise the engine keeps the jnp path.

Prefill rows use the reference (`paged_attention.paged_attention`): there the products of the
queries dominate, and XLA's fused einsums serve them; over bfloat16 pages with bfloat16 operands,
as the kernel's (gpu_prefill.py, which also holds a Pallas prefill kernel an engine can take).

`interpret=True` runs the same kernel through Pallas's interpreter on any backend: the tests hold
it to the reference on the CPU, and check that it lowers to a Triton kernel for CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from worker.engine.gpu_prefill import load_page, online_softmax, page_at, prefill_attention
from worker.engine.kv_quant import QuantizedPages
from worker.engine.paged_attention import BF16_BITS, MASKED, AttentionOps

MIN_TILE = 16  # rows, columns and depth of Triton's smallest dot


@dataclass(frozen=True)
class Tuning:
    """How the kernel spreads its work. `pages_per_block`: pages one loop iteration reads (their
    loads issued together, then one online-softmax update); `target_programs`: programs per call
    to aim for by splitting contexts (never more splits than blocks of pages); `num_warps`,
    `num_stages`: Triton's. `bench attention` sweeps these on the machine at hand."""

    pages_per_block: int = 4
    target_programs: int = 1024
    num_warps: int = 4
    num_stages: int = 2


# Session 17's kernel (1 page per iteration, ~512 programs). `bench attention` on session 30's
# H200, one llama3-8b layer at 64 x 1552 tokens with a bfloat16 query: 175 us (63 % of the
# bandwidth) for it, 130 us (84 %) for the default (4 pages of 64 tokens per iteration, ~1024
# programs), 134 us at ~2048 programs, 256 us for JAX's own Pallas paged-attention kernel.
SESSION_17 = Tuning(pages_per_block=1, target_programs=512)
DEFAULT = Tuning()


def supported(head_dim: int, page_size: int) -> bool:
    """Whether the kernel handles this shape (Triton tiles: powers of two, at least 16)."""
    pow2 = lambda n: n >= MIN_TILE and n & (n - 1) == 0  # noqa: E731
    return pow2(head_dim) and pow2(page_size)


def _kernel(tables_ref, pos_ref, ctx_ref, q_ref, k_ref, v_ref, *refs, window: int, bits: bool, int8: bool,
            pages_per_split: int, pages_per_block: int):
    # one program: sequence pl.program_id(0), KV head pl.program_id(1), context split pl.program_id(2)
    # tables_ref i32[P]; pos_ref, ctx_ref i32[1]; q_ref [Gp, D]; k_ref [N, D, ps]; v_ref [N, ps, D];
    # int8 pages: then ks_ref, vs_ref f32[N, ps] (each slot's scale);
    # out: o_ref f32[Gp, D] (unnormalized), m_ref f32[Gp] (running max), l_ref f32[Gp] (sum of weights)
    ks_ref, vs_ref, o_ref, m_ref, l_ref = refs if int8 else (None, None, *refs)
    gp, d = q_ref.shape
    ps, width = k_ref.shape[-1], tables_ref.shape[0]
    pos, ctx = pos_ref[0], ctx_ref[0]
    first = pl.program_id(2) * pages_per_split  # this program's pages: [first, first + pages_per_split)
    # keys [lo, hi) are visible; never past the page table (a fused decode row that has stopped
    # keeps stepping with positions beyond its pages; its output is discarded)
    hi = jnp.minimum(jnp.minimum(pos + 1, ctx), width * ps)
    lo = jnp.maximum(pos - window + 1, 0) if window else jnp.int32(0)
    q = q_ref[...]
    exact = q.dtype == jnp.float32  # float32: full-precision products (no TF32)
    precision = jax.lax.Precision.HIGHEST if exact else None
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    # this program's pages with a visible key: [begin, stop); a block's first page is one of them,
    # so every block's running max is a real score and its masked keys weigh exactly 0
    begin = jnp.maximum(lo // ps, first)
    stop = jnp.minimum(pl.cdiv(hi, ps), first + pages_per_split)
    stop = jnp.where(hi > lo, jnp.maximum(stop, begin), begin)

    def block(b, carry):
        m, l, acc = carry  # f32[Gp], f32[Gp], f32[Gp, D]
        scores, values, value_scales = [], [], []
        for r in range(pages_per_block):  # every page's loads before any softmax update needs them
            i = begin + b * pages_per_block + r
            k, v = load_page(tables_ref, k_ref, v_ref, i, bits)  # [D, ps], [ps, D]
            s = jnp.dot(q, k.astype(q.dtype), precision=precision, preferred_element_type=jnp.float32) * scale
            if int8:  # int8 values are exact in bfloat16; the scales apply to scores and weights
                page = page_at(tables_ref, k_ref.shape[0], i)
                s = s * ks_ref[page][None, :]
                value_scales.append(vs_ref[page])
            j = i * ps + jnp.arange(ps)
            visible = (j >= lo) & (j < hi) & (i < stop)  # the last block may run past this program's pages
            scores.append(jnp.where(visible[None, :], s, MASKED))  # [Gp, ps]
            values.append(v.astype(q.dtype))
        # every row's weights are 0 where masked: the block's first page has a key it sees
        return online_softmax(m, l, acc, scores, values, precision, value_scales=value_scales if int8 else None)

    init = (jnp.full((gp,), MASKED, jnp.float32), jnp.zeros((gp,), jnp.float32), jnp.zeros((gp, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, pl.cdiv(stop - begin, pages_per_block), block, init)
    o_ref[...], m_ref[...], l_ref[...] = acc, m, l


def context_splits(rows: int, kv_heads: int, pages: int, tuning: Tuning = DEFAULT) -> int:
    """Programs per (sequence, KV head): enough that a batch spreads over a GPU's streaming
    multiprocessors with several programs on each (~`target_programs` in all), never more than
    one per block of pages."""
    blocks = -(-pages // tuning.pages_per_block)
    splits = 1
    while splits * 2 <= blocks and rows * kv_heads * splits * 2 <= tuning.target_programs:
        splits *= 2
    return splits


def pallas_decode_attention(
    q: jax.Array,  # [S, H, D]: one query token per sequence
    k_pages: jax.Array | QuantizedPages,  # [KV, N, D, page_size]
    v_pages: jax.Array | QuantizedPages,  # [KV, N, page_size, D]
    page_tables: jax.Array,  # i32[S, P]
    positions: jax.Array,  # i32[S]
    context_lens: jax.Array,  # i32[S]
    window: int | None = None,
    *,
    interpret: bool = False,
    tuning: Tuning = DEFAULT,
) -> jax.Array:  # [S, H, D]
    """Same contract as `paged_attention.paged_decode_attention`, with zeros for rows that see no key."""
    s, h, d = q.shape
    kv, n, _, ps = k_pages.shape
    g = h // kv
    gp = max(MIN_TILE, 1 << (g - 1).bit_length())
    int8 = isinstance(k_pages, QuantizedPages)
    bits = k_pages.dtype == BF16_BITS
    # bfloat16 pages: the products in bfloat16 on the tensor cores, whatever the query's dtype (the
    # model's projections hand over float32, which made every product a float32 one at full
    # precision: the engine's calls took several times what the same shape took with a bfloat16
    # query in `bench attention`). A bfloat16 model in transformers rounds its queries the same way.
    compute = jnp.bfloat16 if bits or int8 else q.dtype  # int8 values are exact in bfloat16
    qg = jnp.pad(q.astype(compute).reshape(s, kv, g, d), ((0, 0), (0, 0), (0, gp - g), (0, 0)))  # [S, KV, Gp, D]
    p = page_tables.shape[1]
    splits = context_splits(s, kv, p, tuning)
    per_split = -(-p // splits)
    i32 = lambda x: x.astype(jnp.int32)  # noqa: E731
    part = lambda *shape: pl.BlockSpec((None, None, None, *shape), lambda i, j, c: (i, j, c) + (0,) * len(shape))  # noqa: E731
    pages = (k_pages.data, v_pages.data, k_pages.scales, v_pages.scales) if int8 else (k_pages, v_pages)
    scales = [pl.BlockSpec((None, n, ps), lambda i, j, c: (j, 0, 0))] * 2 if int8 else []  # this KV head's
    o, m, l = pl.pallas_call(
        partial(_kernel, window=int(window or 0), bits=bits, int8=int8, pages_per_split=per_split,
                pages_per_block=min(tuning.pages_per_block, per_split)),
        grid=(s, kv, splits),
        in_specs=[
            pl.BlockSpec((None, p), lambda i, j, c: (i, 0)),  # the sequence's page table
            pl.BlockSpec((1,), lambda i, j, c: (i,)),  # its query position
            pl.BlockSpec((1,), lambda i, j, c: (i,)),  # its context length
            pl.BlockSpec((None, None, gp, d), lambda i, j, c: (i, j, 0, 0)),  # its queries for this KV head
            pl.BlockSpec((None, n, d, ps), lambda i, j, c: (j, 0, 0, 0)),  # this KV head's key pages
            pl.BlockSpec((None, n, ps, d), lambda i, j, c: (j, 0, 0, 0)),  # and value pages
            *scales,  # int8 pages: their key and value scales
        ],
        out_specs=[part(gp, d), part(gp), part(gp)],
        out_shape=[jax.ShapeDtypeStruct((s, kv, splits, gp, d), jnp.float32),
                   *(jax.ShapeDtypeStruct((s, kv, splits, gp), jnp.float32),) * 2],
        interpret=interpret,
        compiler_params=pl_triton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        name="redjax_paged_decode_attention",
    )(i32(page_tables), i32(positions), i32(context_lens), qg, *pages)
    # the splits' softmaxes joined, over the G real query heads: o [S, KV, C, G, D], m and l [S, KV, C, G]
    o, m, l = o[:, :, :, :g], m[..., :g], l[..., :g]
    weight = jnp.exp(m - m.max(axis=2, keepdims=True))  # a split that saw no key: l = 0, weight irrelevant
    total = (l * weight).sum(axis=2)  # [S, KV, G]
    out = (o * weight[..., None]).sum(axis=2) / jnp.maximum(total, 1e-30)[..., None]
    out = jnp.where(total[..., None] > 0, out, 0.0)  # a padding row (no visible key) gets zeros, like the CPU kernel
    return out.reshape(s, h, d).astype(q.dtype)


PALLAS = AttentionOps("pallas", pallas_decode_attention, prefill_attention, reads_own_context=False)


def tuned(tuning: Tuning) -> AttentionOps:
    """The kernel with another work split (EngineConfig.pallas_tuning)."""
    return AttentionOps("pallas", partial(pallas_decode_attention, tuning=tuning), prefill_attention,
                        reads_own_context=False)
