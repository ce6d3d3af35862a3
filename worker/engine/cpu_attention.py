"""The compiled CPU paged-attention kernel (`cpu_kernels/paged_attention.cc`), built on first use
with the system C++ compiler and called from jitted code through the XLA FFI, for decode rows and
prefill rows alike.

On XLA's CPU backend the jnp decode path spends most of its time gathering pages into a copy
(and, on two threads, fighting over it), and the jnp prefill path scores every query against the
whole padded page table; the kernel follows each row's page table in place and visits only the
keys each query can see, so the page-table width costs nothing and every step can use the widest.
The shared library is cached under `~/.cache/redjax/kernels` (override: `REDJAX_KERNEL_DIR`),
keyed by the source, the compiler and its flags, the jaxlib version and the CPU, and published
with an atomic rename so workers starting together never load a half-written file. Without a
compiler the engine keeps the jnp path (`paged_attention.paged_decode_attention`), which gives
the same result; tests hold the kernel to that reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from worker.engine.paged_attention import JNP, AttentionOps

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "cpu_kernels" / "paged_attention.cc"
TARGET = "redjax_paged_attention"
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-w")


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def cpu_signature() -> str:
    """The CPU model and feature flags (Linux), or the platform's processor string."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        return "|".join(sorted({line.split(":", 1)[1].strip() for line in info
                                if line.startswith(("model name", "flags"))}))
    except OSError:
        import platform

        return platform.processor() or platform.machine()


@lru_cache(maxsize=1)
def load() -> bool:
    """Build (once per source and flags) and register the kernel; False if it cannot be built."""
    cxx = compiler()
    if cxx is None:
        log.warning("no C++ compiler found: CPU attention uses the jnp path")
        return False
    source = SOURCE.read_bytes()
    # -march=native: a library built for one CPU must not be loaded on another sharing the cache
    stamp = " ".join((cxx, *FLAGS, jax.lib.__version__, cpu_signature()))
    key = hashlib.sha256(source + stamp.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("REDJAX_KERNEL_DIR") or Path.home() / ".cache" / "redjax" / "kernels")
    library = cache / f"paged_attention-{key}.so"
    if not library.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            partial = Path(tmp) / library.name
            cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(partial)]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                log.warning("building the CPU attention kernel failed, using the jnp path:\n%s",
                            result.stderr[-2000:])
                return False
            os.replace(partial, library)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(ctypes.CDLL(str(library)).PagedAttention),
                                platform="cpu")
    return True


def ragged_paged_attention(
    q: jax.Array,  # [T, H, D]: query tokens of all rows, packed
    k_pages: jax.Array,  # [KV, num_pages, D, page_size], float32 or bfloat16
    v_pages: jax.Array,  # [KV, num_pages, page_size, D]
    page_tables: jax.Array,  # i32[R, P]
    positions: jax.Array,  # i32[T]
    q_starts: jax.Array,  # i32[R]: row r holds query tokens [q_starts[r], q_starts[r] + q_lens[r])
    q_lens: jax.Array,  # i32[R]: 0 for a padding row
    context_lens: jax.Array,  # i32[R]
    window: int | None = None,
) -> jax.Array:  # [T, H, D]; zeros for tokens in no row
    """Each row's queries over its own sequence's pages, with the masking of
    `paged_attention.paged_attention`; rows need no padding to a common length. Call `load()` first."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    i32 = lambda x: x.astype(jnp.int32)  # noqa: E731
    out = call(q.astype(jnp.float32), k_pages, v_pages, i32(page_tables), i32(positions), i32(q_starts), i32(q_lens),
               i32(context_lens), window=np.int64(window or 0))
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
                      ragged=ragged_paged_attention)


def choose_attention(mode: str, tensor_parallel: int) -> AttentionOps:
    """The attention an engine runs for `EngineConfig.attention`: "kernel", "jnp", or "auto" (the
    kernel on the CPU backend without tensor parallelism if it builds, else jnp)."""
    if mode == "jnp":
        return JNP
    usable = jax.default_backend() == "cpu" and tensor_parallel == 1  # the FFI call is not partitioned
    if mode == "kernel":
        if not usable:
            raise ValueError("attention='kernel' needs the CPU backend and tensor_parallel 1")
        if not load():
            raise RuntimeError("the CPU attention kernel could not be built (see the log)")
        return KERNEL
    return KERNEL if usable and load() else JNP
