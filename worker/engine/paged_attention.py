"""Paged attention: the pure `jax.numpy` reference, the oracle for any faster kernel.

Keys and values live in fixed-size pages shared by all sequences; a sequence's page table
lists its pages in order, so token t of a sequence sits in page `page_table[t // page_size]`
at offset `t % page_size`. Page 0 is reserved: padding tokens write there and nobody reads it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED = -1e30  # finite, so an all-masked padding row gives garbage instead of NaN


def write_kv(
    pages: jax.Array,  # [num_pages, page_size, kv_heads, head_dim]
    new: jax.Array,  # [T, kv_heads, head_dim]
    slots: jax.Array,  # i32[T]: page * page_size + offset for each token
) -> jax.Array:
    """Scatter one layer's new keys (or values) into their slots; returns the updated pages."""
    n, ps, kv, d = pages.shape
    return pages.reshape(n * ps, kv, d).at[slots].set(new.astype(pages.dtype)).reshape(n, ps, kv, d)


def paged_attention(
    q: jax.Array,  # [S, Q, H, D]: up to Q query tokens for each of S sequences
    k_pages: jax.Array,  # [num_pages, page_size, KV, D]
    v_pages: jax.Array,  # [num_pages, page_size, KV, D]
    page_tables: jax.Array,  # i32[S, P]
    positions: jax.Array,  # i32[S, Q]: absolute position of each query token
    context_lens: jax.Array,  # i32[S]: tokens with K/V in the pages (this step's included)
    window: int | None = None,  # sliding window: key j visible to query i iff i - j < window
) -> jax.Array:  # [S, Q, H, D]
    """Causal attention of each query over its own sequence's pages (reference implementation)."""
    s, q_len, h, d = q.shape
    _, ps, kv, _ = k_pages.shape
    p = page_tables.shape[1]
    keys = k_pages[page_tables].reshape(s, p * ps, kv, d)  # [S, L, KV, D]
    values = v_pages[page_tables].reshape(s, p * ps, kv, d)  # [S, L, KV, D]
    qg = q.reshape(s, q_len, kv, h // kv, d)  # [S, Q, KV, G, D]
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    scores = jnp.einsum("sqkgd,slkd->skgql", qg, keys, preferred_element_type=jnp.float32) * scale
    j = jnp.arange(p * ps)[None, None, :]  # [1, 1, L]
    pos = positions[:, :, None]  # [S, Q, 1]
    visible = (j <= pos) & (j < context_lens[:, None, None])  # [S, Q, L]
    if window is not None:
        visible &= (pos - j) < window
    scores = jnp.where(visible[:, None, None], scores, MASKED)  # [S, KV, G, Q, L]
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("skgql,slkd->sqkgd", probs, values, preferred_element_type=jnp.float32)
    return out.reshape(s, q_len, h, d).astype(q.dtype)


def paged_decode_attention(
    q: jax.Array,  # [S, H, D]: one query token per sequence
    k_pages: jax.Array,  # [num_pages, page_size, KV, D]
    v_pages: jax.Array,  # [num_pages, page_size, KV, D]
    page_tables: jax.Array,  # i32[S, P]
    positions: jax.Array,  # i32[S]: position of each query token
    context_lens: jax.Array,  # i32[S]
    window: int | None = None,
    pages_per_block: int | None = None,
) -> jax.Array:  # [S, H, D]
    """Decode attention (one query per sequence), a page block at a time with an online softmax.

    Same result as `paged_attention`. With `pages_per_block=None` the whole table is one block
    (fastest on CPU for short contexts: the query-major layout compiles to better loops than the
    general reference); smaller blocks bound the gathered context for long ones.
    """
    s, h, d = q.shape
    _, ps, kv, _ = k_pages.shape
    p = page_tables.shape[1]
    block = min(pages_per_block or p, p)
    if p % block:
        block = 1
    g = h // kv
    qg = q.reshape(s, kv, g, d).astype(jnp.float32) / jnp.sqrt(jnp.float32(d))  # [S, KV, G, D]
    tables = page_tables.reshape(s, p // block, block).transpose(1, 0, 2)  # [P/B, S, B]

    def body(carry, xs):
        m, l, acc = carry  # [S, KV, G], [S, KV, G], [S, KV, G, D]
        idx, table = xs  # block index, i32[S, B]
        keys = k_pages[table].reshape(s, block * ps, kv, d)  # [S, B*ps, KV, D]
        values = v_pages[table].reshape(s, block * ps, kv, d)
        scores = jnp.einsum("skgd,slkd->skgl", qg, keys, preferred_element_type=jnp.float32)  # [S, KV, G, B*ps]
        j = idx * block * ps + jnp.arange(block * ps)[None, :]  # [1, B*ps]
        visible = (j <= positions[:, None]) & (j < context_lens[:, None])  # [S, B*ps]
        if window is not None:
            visible &= (positions[:, None] - j) < window
        scores = jnp.where(visible[:, None, None], scores, MASKED)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        scale = jnp.exp(m - m_new)
        probs = jnp.exp(scores - m_new[..., None])
        l = l * scale + probs.sum(axis=-1)
        acc = acc * scale[..., None] + jnp.einsum("skgl,slkd->skgd", probs, values, preferred_element_type=jnp.float32)
        return (m_new, l, acc), None

    init = (jnp.full((s, kv, g), MASKED, jnp.float32), jnp.zeros((s, kv, g), jnp.float32),
            jnp.zeros((s, kv, g, d), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(body, init, (jnp.arange(p // block), tables))
    return (acc / l[..., None]).reshape(s, h, d).astype(q.dtype)
