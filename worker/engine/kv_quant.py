"""int8 KV pages (`EngineConfig.kv_cache_dtype = "int8"`): each token's key and value, for each KV
head, stored as D int8 values and one float32 scale, a quarter of float32 pages' bytes (plus
4 / D for the scale), so a memory-bound decode step reads less and the same memory holds about
four times the pages.

A token's vector is quantized once, when its step writes it, with the symmetric scheme of the
int8 projections (`int8_linear.quantize`: scale = max|v| / 127.5, q = round-half-even(v / scale)
in [-128, 127]); it reads back as q * scale. Every reader takes the scales out of the sums rather
than widening pages into a copy: a query's score against key j is scale_j * (q . k8_j), and key j's
value enters the weighted sum as (p_j * scale_j) * v8_j. The jnp reference (paged_attention.py)
dequantizes gathered pages; the CPU kernel (cpu_kernels/paged_attention.cc) applies the scales to
a page's scores and probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from worker.engine.int8_linear import quantize


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedPages:
    """One layer's int8 key or value pages with their scales."""

    data: jax.Array  # i8: keys [KV, num_pages, D, page_size] (transposed pages) or values [KV, num_pages, page_size, D]
    scales: jax.Array  # f32[KV, num_pages, page_size]: each slot's scale

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> jnp.dtype:
        return self.data.dtype

    @property
    def sharding(self):
        return self.data.sharding


def quantize_tokens(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """New keys or values x [T, KV, D] -> (i8[T, KV, D], f32[T, KV]): one scale per token and head."""
    return quantize(x, axis=-1)


def key_numbers(pages: QuantizedPages, index) -> jax.Array:
    """Key pages `pages.data[:, index]` [KV, ..., D, ps] as float32 numbers."""
    return pages.data[:, index].astype(jnp.float32) * pages.scales[:, index][..., None, :]


def value_numbers(pages: QuantizedPages, index) -> jax.Array:
    """Value pages `pages.data[:, index]` [KV, ..., ps, D] as float32 numbers."""
    return pages.data[:, index].astype(jnp.float32) * pages.scales[:, index][..., None]


def write_scales(scales: jax.Array, new: jax.Array, slots: jax.Array, unique: dict) -> jax.Array:
    """scales f32[KV, N, ps] with new f32[T, KV] at `slots` (distinct, padding past the end)."""
    kv, n, ps = scales.shape
    return scales.reshape(kv, n * ps).at[:, slots].set(new.T, **unique).reshape(kv, n, ps)
