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
