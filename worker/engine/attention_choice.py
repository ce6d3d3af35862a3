"""Which paged attention an engine runs (`EngineConfig.attention`).

- "kernel": the compiled C++ kernel (cpu_attention.py): CPU backend, no tensor parallelism.
- "pallas": the Pallas/Triton decode kernel (gpu_attention.py): GPU backend, no tensor
  parallelism, head dim and page size powers of two >= 16.
- "jnp": pure jax.numpy (paged_attention.py), anywhere.
- "auto": the kernel for the backend where it applies (and, for Pallas, compiles on this GPU),
  else jnp. A kernel that does not apply or fails is logged, never silent.

With the Pallas kernel, prefill rows run the Pallas prefill kernel (gpu_prefill.py) where it
compiles, unless `pallas_prefill` is False: then the reference, rounded like the kernel.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np

from worker.engine import cpu_attention, gpu_attention, gpu_prefill
from worker.engine.kv_quant import QuantizedPages
from worker.engine.paged_attention import JNP, AttentionOps, storage_dtype

log = logging.getLogger(__name__)


class AttentionUnavailable(ValueError):
    """The settings ask for an attention this machine or model cannot run: the CLIs report it as
    a usage error before serving anything."""


def choose_attention(mode: str, tensor_parallel: int, head_dim: int, page_size: int, dtype, kv_dtype,
                     tuning: tuple[int, int, int, int] | None = None, prefill_kernel: bool | None = None) -> AttentionOps:
    """The attention for these settings; `tuning` (EngineConfig.pallas_tuning) and `prefill_kernel`
    (EngineConfig.pallas_prefill) apply to the Pallas kernels alone, and are errors where another
    attention runs. `prefill_kernel` None: the Pallas prefill kernel if it compiles here (a failure
    is logged and the reference runs), True: it or an error, False: the reference."""
    settings = None if tuning is None else gpu_attention.Tuning(*tuning)
    ops = _choose(mode, tensor_parallel, head_dim, page_size, dtype, kv_dtype, settings)
    pallas = ops.name == gpu_attention.PALLAS.name
    for asked, name in ((tuning is not None, "pallas_tuning"), (prefill_kernel is True, "pallas_prefill")):
        if asked and not pallas:
            raise AttentionUnavailable(f"{name} applies to the Pallas decode kernel, and this engine runs {ops.name} attention")
    if pallas and prefill_kernel is not False:
        if prefill_compiles(head_dim, page_size, jnp.dtype(dtype).name, jnp.dtype(kv_dtype).name):
            return replace(ops, prefill=gpu_prefill.pallas_prefill_attention)
        if prefill_kernel:
            raise RuntimeError("the Pallas prefill kernel did not compile on this GPU (see the log)")
    return ops


def _choose(mode: str, tensor_parallel: int, head_dim: int, page_size: int, dtype, kv_dtype,
            tuning: gpu_attention.Tuning | None) -> AttentionOps:
    if mode == "jnp":
        return JNP
    backend = jax.default_backend()
    if mode == "kernel" or (mode == "auto" and backend == "cpu"):
        usable = backend == "cpu" and tensor_parallel == 1  # the FFI call is not partitioned
        if mode == "kernel" and not usable:
            raise AttentionUnavailable("attention='kernel' needs the CPU backend and tensor_parallel 1")
        if usable and cpu_attention.load():
            return cpu_attention.KERNEL
        if mode == "kernel":
            raise RuntimeError("the CPU attention kernel could not be built (see the log)")
        return JNP
    usable = backend == "gpu" and tensor_parallel == 1 and gpu_attention.supported(head_dim, page_size)
    if mode == "pallas" and not usable:
        raise AttentionUnavailable("attention='pallas' needs the GPU backend, tensor_parallel 1, and head dim and page size "
                         "powers of two >= 16")
    if usable and pallas_compiles(head_dim, page_size, jnp.dtype(dtype).name, jnp.dtype(kv_dtype).name,
                                  tuning or gpu_attention.DEFAULT):
        return gpu_attention.PALLAS if tuning is None else gpu_attention.tuned(tuning)
    if mode == "pallas":
        raise RuntimeError("the Pallas attention kernel did not compile on this GPU (see the log)")
    return JNP


@lru_cache(maxsize=8)
def pallas_compiles(head_dim: int, page_size: int, dtype: str, kv_dtype: str,
                    tuning: gpu_attention.Tuning = gpu_attention.DEFAULT) -> bool:
    """Compile and run the kernel once on a small problem of the model's shapes and dtypes and
    the engine's work split (tables two blocks of pages wide, so a block is as many pages as it
    will be): a GPU or Triton version it does not build for costs a log line, not the engine."""
    kv, s, width = 1, 2, 2 * tuning.pages_per_block
    q = jnp.zeros((s, 4, head_dim), dtype)
    k, v = (zero_pages((kv, s * width) + shape, page_size, kv_dtype)
            for shape in ((head_dim, page_size), (page_size, head_dim)))
    tables = jnp.asarray(np.arange(s * width, dtype=np.int32).reshape(s, width))
    lens = jnp.asarray([width * page_size, 1], jnp.int32)
    try:
        out = jax.jit(partial(gpu_attention.pallas_decode_attention, tuning=tuning))(q, k, v, tables, lens - 1, lens)
        jax.block_until_ready(out)
        return True
    except Exception:  # noqa: BLE001: whatever Triton or the driver reports, the engine keeps jnp
        log.warning("the Pallas attention kernel failed to compile or run here; using the jnp path", exc_info=True)
        return False


def zero_pages(shape: tuple[int, ...], page_size: int, kv_dtype: str):
    """Zeroed pages of `shape` [KV, N, ...] as the engine stores `kv_dtype` (int8 with their scales)."""
    if kv_dtype == "int8":
        return QuantizedPages(jnp.zeros(shape, jnp.int8), jnp.zeros(shape[:2] + (page_size,), jnp.float32))
    return jnp.zeros(shape, storage_dtype(kv_dtype))


@lru_cache(maxsize=8)
def prefill_compiles(head_dim: int, page_size: int, dtype: str, kv_dtype: str) -> bool:
    """Compile and run the prefill kernel once on a small problem of the model's shapes and dtypes
    (two rows of 16 queries over tables of 4 pages)."""
    kv, s, width = 1, 2, 4
    q = jnp.zeros((s, 16, 4, head_dim), dtype)
    k, v = (zero_pages((kv, s * width) + shape, page_size, kv_dtype)
            for shape in ((head_dim, page_size), (page_size, head_dim)))
    tables = jnp.asarray(np.arange(s * width, dtype=np.int32).reshape(s, width))
    lens = jnp.asarray([width * page_size, 16], jnp.int32)
    positions = lens[:, None] - 16 + jnp.arange(16, dtype=jnp.int32)[None, :]
    try:
        jax.block_until_ready(jax.jit(gpu_prefill.pallas_prefill_attention)(q, k, v, tables, positions, lens))
        return True
    except Exception:  # noqa: BLE001: whatever Triton or the driver reports
        log.warning("the Pallas prefill kernel failed to compile or run here", exc_info=True)
        return False
