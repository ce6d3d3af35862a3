"""The compiled CPU paged-attention kernel (`cpu_kernels/paged_attention.cc`), built on first use
(worker/engine/cpu_build.py) and called from jitted code through the XLA FFI, for decode rows and
prefill rows alike.

On XLA's CPU backend the jnp decode path spends most of its time gathering pages into a copy
(and, on two threads, fighting over it), and the jnp prefill path scores every query against the
whole padded page table; the kernel follows each row's page table in place and visits only the
keys each query can see, so the page-table width costs nothing and every step can use the widest.
Without a compiler the engine keeps the jnp path (`paged_attention.paged_decode_attention`), which
gives the same result; tests hold the kernel to that reference.
"""

from __future__ import annotations

from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from worker.engine import cpu_build
from worker.engine.kv_quant import QuantizedPages, quantize_tokens
from worker.engine.paged_attention import AttentionOps, stored

TARGET, WRITE = "redjax_paged_attention", "redjax_kv_write"
WRITE_ATTEND = "redjax_paged_attention_write"  # decode rows: each row's new token written, then attended
I8 = "_i8"  # each target's handler for int8 pages with their scales (kv_quant.py)
HANDLERS = (  # (source in cpu_kernels/, handler symbol, FFI target)
    ("paged_attention.cc", "PagedAttention", TARGET), ("paged_attention.cc", "PagedAttentionI8", TARGET + I8),
    ("paged_attention.cc", "PagedAttentionWrite", WRITE_ATTEND),
    ("paged_attention.cc", "PagedAttentionWriteI8", WRITE_ATTEND + I8),
    ("kv_write.cc", "KvWrite", WRITE), ("kv_write.cc", "KvWriteI8", WRITE + I8))


def _like(*arrays: jax.Array) -> tuple[jax.ShapeDtypeStruct, ...]:
    return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)


@lru_cache(maxsize=1)
def load() -> bool:
    """Build (once per source and flags) and register the kernels (attention, page writes, and
    the two together for decode rows); False if they cannot be built."""
    return all(cpu_build.register(source, symbol, target) for source, symbol, target in HANDLERS)


def write_pages(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array):
    """`paged_attention.write_pages` in place through `cpu_kernels/kv_write.cc`: k_pages
    [KV, N, D, page_size], v_pages [KV, N, page_size, D], k and v [T, KV, D], slots i32[T] ->
    (k_pages, v_pages); int8 pages (QuantizedPages) take k and v quantized as the jnp writes
    quantize them. Call `load()` first."""
    if isinstance(k_pages, QuantizedPages):
        (k8, k_scale), (v8, v_scale) = quantize_tokens(k), quantize_tokens(v)  # [T, KV, D], [T, KV]
        call = jax.ffi.ffi_call(WRITE + I8, _like(k_pages.data, v_pages.data, k_pages.scales, v_pages.scales),
                                input_output_aliases={0: 0, 1: 1, 5: 2, 6: 3})
        kd, vd, ks, vs = call(k_pages.data, v_pages.data, k8, v8, slots.astype(jnp.int32), k_pages.scales,
                              v_pages.scales, k_scale, v_scale)
        return QuantizedPages(kd, ks), QuantizedPages(vd, vs)
    call = jax.ffi.ffi_call(WRITE, (jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                                    jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
                            input_output_aliases={0: 0, 1: 1})
    return call(k_pages, v_pages, stored(k, k_pages.dtype), stored(v, v_pages.dtype), slots.astype(jnp.int32))


def write_decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array, k_pages: jax.Array,
                           v_pages: jax.Array, page_tables: jax.Array, positions: jax.Array, context_lens: jax.Array,
                           window: int | None = None):
    """`write_pages` then `paged_decode_attention` in one call, in place: q [S, H, D], k and v
    [S, KV, D] (row r's new token), slots i32[S] -> (out [S, H, D], k_pages, v_pages). Each
    (row, KV head) work item writes its token just before it reads the row's pages, so the step
    has no page-write pass of its own (`AttentionOps.write_decode`). Call `load()` first."""
    s, h, d = q.shape
    i32 = lambda x: x.astype(jnp.int32)  # noqa: E731
    rows = (i32(page_tables), i32(positions), jnp.arange(s, dtype=jnp.int32), jnp.ones((s,), jnp.int32),
            i32(context_lens))
    if isinstance(k_pages, QuantizedPages):
        (k8, k_scale), (v8, v_scale) = quantize_tokens(k), quantize_tokens(v)  # [S, KV, D], [S, KV]
        call = jax.ffi.ffi_call(WRITE_ATTEND + I8, (jax.ShapeDtypeStruct(q.shape, jnp.float32),)
                                + _like(k_pages.data, v_pages.data, k_pages.scales, v_pages.scales),
                                input_output_aliases={1: 1, 2: 2, 11: 3, 12: 4})
        out, kd, vd, ks, vs = call(q.astype(jnp.float32), k_pages.data, v_pages.data, *rows, k8, v8, i32(slots),
                                   k_pages.scales, v_pages.scales, k_scale, v_scale, window=np.int64(window or 0))
        return out.astype(q.dtype), QuantizedPages(kd, ks), QuantizedPages(vd, vs)
    call = jax.ffi.ffi_call(WRITE_ATTEND, (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                           jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                                           jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
                            input_output_aliases={1: 1, 2: 2})
    out, k_pages, v_pages = call(q.astype(jnp.float32), k_pages, v_pages, *rows,
                                 stored(k, k_pages.dtype), stored(v, v_pages.dtype), i32(slots),
                                 window=np.int64(window or 0))
    return out.astype(q.dtype), k_pages, v_pages


def ragged_paged_attention(
    q: jax.Array,  # [T, H, D]: query tokens of all rows, packed
    k_pages: jax.Array | QuantizedPages,  # [KV, num_pages, D, page_size], float32, bfloat16 or int8
    v_pages: jax.Array | QuantizedPages,  # [KV, num_pages, page_size, D]
    page_tables: jax.Array,  # i32[R, P]
    positions: jax.Array,  # i32[T]
    q_starts: jax.Array,  # i32[R]: row r holds query tokens [q_starts[r], q_starts[r] + q_lens[r])
    q_lens: jax.Array,  # i32[R]: 0 for a padding row
    context_lens: jax.Array,  # i32[R]
    window: int | None = None,
) -> jax.Array:  # [T, H, D]; zeros for tokens in no row
    """Each row's queries over its own sequence's pages, with the masking of
    `paged_attention.paged_attention`; rows need no padding to a common length. Call `load()` first."""
    i32 = lambda x: x.astype(jnp.int32)  # noqa: E731
    rows = (i32(page_tables), i32(positions), i32(q_starts), i32(q_lens), i32(context_lens))
    result = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    if isinstance(k_pages, QuantizedPages):
        out = jax.ffi.ffi_call(TARGET + I8, result)(q.astype(jnp.float32), k_pages.data, v_pages.data, *rows,
                                                    k_pages.scales, v_pages.scales, window=np.int64(window or 0))
    else:
        out = jax.ffi.ffi_call(TARGET, result)(q.astype(jnp.float32), k_pages, v_pages, *rows,
                                               window=np.int64(window or 0))
    return out.astype(q.dtype)


def paged_attention(
    q: jax.Array,  # [S, Q, H, D]
    k_pages: jax.Array,  # [KV, num_pages, D, page_size], float32 or bfloat16
    v_pages: jax.Array,  # [KV, num_pages, page_size, D]
    page_tables: jax.Array,  # i32[S, P]
    positions: jax.Array,  # i32[S, Q]
    context_lens: jax.Array,  # i32[S]
    window: int | None = None,
) -> jax.Array:  # [S, Q, H, D]
    """Same contract as `paged_attention.paged_attention` (rows of Q queries; queries with no
    visible key get zeros where the reference averages garbage)."""
    s, n, h, d = q.shape
    starts = jnp.arange(s, dtype=jnp.int32) * n
    out = ragged_paged_attention(q.reshape(s * n, h, d), k_pages, v_pages, page_tables, positions.reshape(s * n),
                                 starts, jnp.full((s,), n, jnp.int32), context_lens, window)
    return out.reshape(s, n, h, d)


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_tables: jax.Array,
                           positions: jax.Array, context_lens: jax.Array, window: int | None = None) -> jax.Array:
    """One query per row: q [S, H, D], positions i32[S] -> [S, H, D]."""
    return paged_attention(q[:, None], k_pages, v_pages, page_tables, positions[:, None], context_lens, window)[:, 0]


KERNEL = AttentionOps("cpu-kernel", paged_decode_attention, paged_attention, reads_own_context=True,
                      ragged=ragged_paged_attention, write=write_pages, write_decode=write_decode_attention)
