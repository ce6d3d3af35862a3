"""KV pages on device, one key and one value array per layer, and how many pages fit."""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from worker.engine.config import EngineConfig
from worker.engine.kv_quant import QuantizedPages
from worker.engine.paged_attention import BF16_BITS, storage_dtype
from worker.models.config import ModelConfig

RESERVED_PAGES = 1  # page 0: padding tokens have slot 0 (and write nothing); padded page tables point there


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    # int8 pages (kv_quant.py) are QuantizedPages of these shapes, with their scales
    keys: tuple[jax.Array | QuantizedPages, ...]  # per layer [kv_heads, num_pages, head_dim, page_size] (transposed pages)
    values: tuple[jax.Array | QuantizedPages, ...]  # per layer [kv_heads, num_pages, page_size, head_dim]

    @classmethod
    def create(cls, model: ModelConfig, num_pages: int, page_size: int, dtype, sharding=None) -> "KVCache":
        """Zeroed pages; `sharding` (tensor parallel) splits them by KV head. The pages are committed
        to their devices from the start, as every step's outputs are: a jit traced on uncommitted
        pages misses its cache once they are committed, and compiles the same variant again."""
        sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])

        def make(shape, stored):
            split = sharding  # by KV head, the first axis, at any rank (int8 pages' scales are [KV, N, ps])
            if isinstance(sharding, jax.sharding.NamedSharding):
                split = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
                    sharding.spec[0], *[None] * (len(shape) - 1)))
            return jax.jit(lambda: tuple(jnp.zeros(shape, stored) for _ in range(model.num_layers)),
                           out_shardings=(split,) * model.num_layers)()

        def layers(shape):
            if jnp.dtype(dtype) == jnp.int8:  # int8 pages and a scale per slot [KV, N, ps]
                data, scales = make(shape, jnp.int8), make(shape[:2] + (page_size,), jnp.float32)
                return tuple(QuantizedPages(d, s) for d, s in zip(data, scales))
            return make(shape, storage_dtype(dtype))

        kv, d = model.num_kv_heads, model.head_dim
        return cls(layers((kv, num_pages, d, page_size)), layers((kv, num_pages, page_size, d)))

    @property
    def dtype(self) -> jnp.dtype:
        """The pages' logical dtype (bfloat16 pages are stored as BF16_BITS)."""
        stored = self.keys[0].dtype
        return jnp.dtype(jnp.bfloat16) if stored == BF16_BITS else stored

    @property
    def num_pages(self) -> int:
        return self.keys[0].shape[1]

    @property
    def bytes_per_element(self) -> float:
        """Bytes a key or value element takes, its share of an int8 page's scales included."""
        return element_bytes(self.dtype, self.keys[0].shape[2])


def element_bytes(dtype, head_dim: int) -> float:
    """Bytes per stored key or value element of `dtype`: int8 pages add a float32 scale per
    head_dim elements."""
    return 1 + 4 / head_dim if jnp.dtype(dtype) == jnp.int8 else jnp.dtype(dtype).itemsize


def page_bytes(model: ModelConfig, page_size: int, itemsize: float) -> int:
    """Bytes one page takes across all layers, keys and values (`itemsize`: `element_bytes`)."""
    return int(2 * model.num_layers * page_size * model.num_kv_heads * model.head_dim * itemsize)


def choose_num_pages(engine: EngineConfig, model: ModelConfig, max_model_len: int, itemsize: float, shards: int = 1) -> int:
    """Pages to allocate: the configured number, or a share of free device memory.

    Never more than every sequence at full context could use, never fewer than one
    full-context sequence needs.
    """
    if engine.num_pages is not None:
        return engine.num_pages
    per_seq = engine.pages_for(max_model_len)
    useful = engine.max_num_seqs * per_seq + RESERVED_PAGES
    # each of `shards` devices holds 1/shards of every page (KV heads split)
    budget = int(free_device_bytes() * engine.kv_cache_memory_fraction) * shards // page_bytes(
        model, engine.page_size, itemsize)
    return max(min(budget, useful), per_seq + RESERVED_PAGES)


def free_device_bytes() -> int:
    """Free memory of the first device (accelerator stats, or host RAM on CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
