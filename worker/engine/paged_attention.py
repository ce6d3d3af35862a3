"""Paged attention: the pure `jax.numpy` reference, the oracle for any faster kernel, the blocked
jnp decode path, and `AttentionOps`, the pair of them a step runs (jnp here, the compiled CPU
kernel in cpu_attention.py).

Keys and values live in fixed-size pages shared by all sequences; a sequence's page table
lists its pages in order, so token t of a sequence sits in page `page_table[t // page_size]`
at offset `t % page_size`. Page 0 is reserved: padding tokens have slot 0 and write nothing, and
padded page-table entries point there, masked.

Layout per layer, head-major (gathered pages come out with the attention's batch axes, KV head
and sequence, leading; with pages first, XLA's CPU backend spent more time transposing gathered
pages than multiplying them):

- values `[kv_heads, num_pages, page_size, head_dim]`;
- keys `[kv_heads, num_pages, head_dim, page_size]`, transposed within the page: dimension i of
  a page's keys is one contiguous run, so a kernel scores one query against 16 keys as the lanes
  of one vector, summed over the dimensions, with no horizontal sum per key (the CPU kernel,
  cpu_kernels/paged_attention.cc; vLLM's first CUDA kernel split its key cache the same way).
  The reference here transposes gathered key pages back (`key_rows`); the blocked decode path
  contracts them over D as stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

from worker.engine import kv_quant
from worker.engine.kv_quant import QuantizedPages

MASKED = -1e30  # finite, so an all-masked padding row gives garbage instead of NaN
# bfloat16 pages are stored as their bit patterns: XLA's CPU backend widens a bfloat16 scatter's
# whole operand to float32 and back (466 us vs 5 us per layer write of a 4 x 257 x 64 x 32 cache),
# while a uint16 scatter is done in place; readers reinterpret gathered blocks (`page_values`)
BF16_BITS = jnp.uint16


def storage_dtype(dtype) -> jnp.dtype:
    """The dtype KV pages of logical `dtype` are held in."""
    return jnp.dtype(BF16_BITS) if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(dtype)


def page_values(x: jax.Array) -> jax.Array:
    """Gathered page data as numbers: bfloat16 bit patterns reinterpreted as bfloat16."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == BF16_BITS else x


def gather_keys(pages: jax.Array | QuantizedPages, index) -> jax.Array:
    """Key pages `index` (an index array into the pages axis) as numbers: [KV, *index.shape, D, ps]."""
    return kv_quant.key_numbers(pages, index) if isinstance(pages, QuantizedPages) else page_values(pages[:, index])


def gather_values(pages: jax.Array | QuantizedPages, index) -> jax.Array:
    """Value pages `index` as numbers: [KV, *index.shape, ps, D]."""
    return kv_quant.value_numbers(pages, index) if isinstance(pages, QuantizedPages) else page_values(pages[:, index])


BLOCK_BYTES = 2 << 20  # gathered keys per decode block: one block stays in a core's L2 cache


def stored(x: jax.Array, dtype) -> jax.Array:
    """Values as the pages hold them (bfloat16 as its bit patterns)."""
    if dtype == BF16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), BF16_BITS)
    return x.astype(dtype)


# Page writes promise XLA distinct indices. Without the promise XLA's GPU scatter updates each
# element with an atomic read-modify-write, for 16-bit pages a compare-and-swap loop on the 32-bit
# word: session 34's H200 trace had the 64 page writes of a 1024-token prefill call take 8.3 of its
# 44 ms. Out-of-bounds indices are dropped, as jnp's scatters drop them by default.
UNIQUE = {"unique_indices": True, "mode": "drop"}


def distinct_slots(slots: jax.Array, capacity: int) -> jax.Array:
    """Slots with each padding token's (slot 0) moved to its own index past the cache's `capacity`
    slots: every index distinct, and a padding token writes nothing (real tokens never have page 0)."""
    return jnp.where(slots == 0, capacity + jnp.arange(slots.shape[0], dtype=slots.dtype), slots)


def write_kv(
    pages: jax.Array | QuantizedPages,  # [KV, num_pages, page_size, D]
    new: jax.Array,  # [T, KV, D]
    slots: jax.Array,  # i32[T]: page * page_size + offset for each token
) -> jax.Array | QuantizedPages:
    """Scatter one layer's new values into their slots; returns the updated pages."""
    if isinstance(pages, QuantizedPages):
        q, scales = kv_quant.quantize_tokens(new)  # [T, KV, D], [T, KV]
        capacity = pages.shape[1] * pages.shape[2]
        return QuantizedPages(write_kv(pages.data, q, slots),
                              kv_quant.write_scales(pages.scales, scales, distinct_slots(slots, capacity), UNIQUE))
    kv, n, ps, d = pages.shape
    rows = stored(new.transpose(1, 0, 2), pages.dtype)  # [KV, T, D]
    flat = pages.reshape(kv, n * ps, d).at[:, distinct_slots(slots, n * ps)].set(rows, **UNIQUE)
    return flat.reshape(kv, n, ps, d)


def write_keys(
    pages: jax.Array | QuantizedPages,  # [KV, num_pages, D, page_size]
    new: jax.Array,  # [T, KV, D]
    slots: jax.Array,  # i32[T]
) -> jax.Array | QuantizedPages:
    """Scatter one layer's new keys into their slots of the transposed key pages."""
    n, ps = pages.shape[1], pages.shape[3]
    if isinstance(pages, QuantizedPages):
        q, scales = kv_quant.quantize_tokens(new)  # [T, KV, D], [T, KV]
        return QuantizedPages(write_keys(pages.data, q, slots),
                              kv_quant.write_scales(pages.scales, scales, distinct_slots(slots, n * ps), UNIQUE))
    slots = distinct_slots(slots, n * ps)
    # pages[:, page, :, offset] with the two index arrays apart: the token axis comes first, [T, KV, D]
    return pages.at[:, slots // ps, :, slots % ps].set(stored(new, pages.dtype), **UNIQUE)


def write_pages(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array):
    """One layer's new keys and values (k, v [T, KV, D]) into their slots -> (k_pages, v_pages)."""
    return write_keys(k_pages, k, slots), write_kv(v_pages, v, slots)


def key_rows(gathered: jax.Array) -> jax.Array:
    """Gathered key pages [..., D, page_size] -> [..., page_size, D], as numbers."""
    return jnp.swapaxes(page_values(gathered), -1, -2)


def paged_attention(
    q: jax.Array,  # [S, Q, H, D]: up to Q query tokens for each of S sequences
    k_pages: jax.Array,  # [KV, num_pages, D, page_size]
    v_pages: jax.Array,  # [KV, num_pages, page_size, D]
    page_tables: jax.Array,  # i32[S, P]
    positions: jax.Array,  # i32[S, Q]: absolute position of each query token
    context_lens: jax.Array,  # i32[S]: tokens with K/V in the pages (this step's included)
    window: int | None = None,  # sliding window: key j visible to query i iff i - j < window
) -> jax.Array:  # [S, Q, H, D]
    """Causal attention of each query over its own sequence's pages (reference implementation)."""
    s, q_len, h, d = q.shape
    kv, _, ps, _ = v_pages.shape
    p = page_tables.shape[1]
    keys = jnp.swapaxes(gather_keys(k_pages, page_tables), -1, -2).reshape(kv, s, p * ps, d)  # [KV, S, L, D]
    values = gather_values(v_pages, page_tables).reshape(kv, s, p * ps, d)  # [KV, S, L, D]
    qg = q.reshape(s, q_len, kv, h // kv, d)  # [S, Q, KV, G, D]
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    scores = jnp.einsum("sqkgd,ksld->skgql", qg, keys, preferred_element_type=jnp.float32) * scale
    j = jnp.arange(p * ps)[None, None, :]  # [1, 1, L]
    pos = positions[:, :, None]  # [S, Q, 1]
    visible = (j <= pos) & (j < context_lens[:, None, None])  # [S, Q, L]
    if window is not None:
        visible &= (pos - j) < window
    scores = jnp.where(visible[:, None, None], scores, MASKED)  # [S, KV, G, Q, L]
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)  # the compute dtype, whatever the pages hold
    out = jnp.einsum("skgql,ksld->sqkgd", probs, values, preferred_element_type=jnp.float32)
    return out.reshape(s, q_len, h, d).astype(q.dtype)


def paged_decode_attention(
    q: jax.Array,  # [S, H, D]: one query token per sequence
    k_pages: jax.Array,  # [KV, num_pages, D, page_size]
    v_pages: jax.Array,  # [KV, num_pages, page_size, D]
    page_tables: jax.Array,  # i32[S, P]
    positions: jax.Array,  # i32[S]: position of each query token
    context_lens: jax.Array,  # i32[S]
    window: int | None = None,
    pages_per_block: int | None = None,
) -> jax.Array:  # [S, H, D]
    """Decode attention (one query per sequence), a block of pages at a time with an online softmax.

    Same result as `paged_attention`. Each block gathers `pages_per_block` pages of every
    sequence (default: about `BLOCK_BYTES` of keys), small enough to stay in cache while both
    matmuls read it, so memory traffic is one read of the context instead of a gather written to
    and read back from RAM.
    """
    s, h, d = q.shape
    kv, _, ps, _ = v_pages.shape
    p = page_tables.shape[1]
    block = min(pages_per_block or default_block_pages(s, kv, ps, d, k_pages.dtype.itemsize), p)
    if p % block:
        block = 1
    g = h // kv
    qg = q.reshape(s, kv, g, d).transpose(1, 0, 2, 3).astype(jnp.float32) / jnp.sqrt(jnp.float32(d))  # [KV, S, G, D]
    tables = page_tables.reshape(s, p // block, block).transpose(1, 0, 2)  # [P/B, S, B]

    def body(carry, xs):
        m, l, acc = carry  # [KV, S, G], [KV, S, G], [KV, S, G, D]
        idx, table = xs  # block index, i32[S, B]
        keys = gather_keys(k_pages, table)  # [KV, S, B, D, ps]: contracted over D as stored, no transpose
        values = gather_values(v_pages, table).reshape(kv, s, block * ps, d)
        scores = jnp.einsum("ksgd,ksbdt->ksgbt", qg, keys, preferred_element_type=jnp.float32)
        scores = scores.reshape(kv, s, g, block * ps)  # [KV, S, G, B*ps]
        j = idx * block * ps + jnp.arange(block * ps)[None, :]  # [1, B*ps]
        visible = (j <= positions[:, None]) & (j < context_lens[:, None])  # [S, B*ps]
        if window is not None:
            visible &= (positions[:, None] - j) < window
        scores = jnp.where(visible[None, :, None], scores, MASKED)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        scale = jnp.exp(m - m_new)
        probs = jnp.exp(scores - m_new[..., None])
        l = l * scale + probs.sum(axis=-1)
        acc = acc * scale[..., None] + jnp.einsum("ksgl,ksld->ksgd", probs, values, preferred_element_type=jnp.float32)
        return (m_new, l, acc), None

    init = (jnp.full((kv, s, g), MASKED, jnp.float32), jnp.zeros((kv, s, g), jnp.float32),
            jnp.zeros((kv, s, g, d), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(body, init, (jnp.arange(p // block), tables))
    out = acc / l[..., None]  # [KV, S, G, D]
    return out.transpose(1, 0, 2, 3).reshape(s, h, d).astype(q.dtype)


def default_block_pages(num_seqs: int, kv_heads: int, page_size: int, head_dim: int, itemsize: int) -> int:
    """Largest power of two of pages whose gathered keys for all sequences fit in BLOCK_BYTES."""
    per_page = num_seqs * kv_heads * page_size * head_dim * itemsize
    block = 1
    while block * 2 * per_page <= BLOCK_BYTES:
        block *= 2
    return block


@dataclass(frozen=True)
class AttentionOps:
    """The attention a step runs: `decode` for one-query rows (q [S, H, D], positions [S]) and
    `prefill` for rows of Q queries (q [S, Q, H, D], positions [S, Q]), both with the contract of
    `paged_attention`. `reads_own_context`: cost follows each row's context, not the page-table
    width, so every step can use the widest table (fewer compiled variants). `ragged` (optional):
    rows of any length packed back to back (q [T, H, D], positions [T], row r the tokens
    `[q_starts[r], q_starts[r] + q_lens[r])`); with it a step packs prefill chunks without padding
    each to a common row length (`batch.StepShape.packed`). `write`: how a layer's new keys and
    values go into the pages, with the contract of `write_pages`. `write_decode` (optional): both
    for a step of decode rows alone, (q, k, v, slots, k_pages, v_pages, page_tables, positions,
    context_lens, window) -> (out, k_pages, v_pages), the same as `write` then `decode`."""

    name: str
    decode: Callable
    prefill: Callable
    reads_own_context: bool
    ragged: Callable | None = None
    write: Callable = write_pages
    write_decode: Callable | None = None


JNP = AttentionOps("jnp", paged_decode_attention, paged_attention, reads_own_context=False)
