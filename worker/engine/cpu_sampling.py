"""Sampling on the CPU backend through compiled kernels (`cpu_kernels/sampling.cc`): top-k/top-p
cutoffs without sorting the vocabulary, Gumbel-max draws with hashed noise, greedy argmax in one
pass per row, and the N largest logprobs (requests asking for logprobs) in one pass per row.

The jnp sampler (accelerators, tensor-parallel workers) finds the same top-k/top-p cut by
bisection (`sampler.top_k_top_p_cut`, 64 masked passes over each row) and draws by the same rule
(`sampler.gumbel_draw`) with the same noise from the row's (seed, choice, position) key. On XLA's
CPU backend those passes cost more than the kernels' one or two (64 rows, top_k 50, top_p 0.95:
cut 1.9 / 25 / 172 ms against 0.56 / 1.1 / 2.9 ms at V = 4096 / 32000 / 128256, 0.85 / 6.4 / 24
before session 58's buffered top-k; top_p 0.95 alone 0.47 / 2.1 / 8.2 ms, and a flat row, which
keeps most of the vocabulary, no slower; a sort, the jnp cut until session 51, took 35 / 335 /
1568 ms). Tests hold both paths to a descending sort's cut and to transformers' warpers, so a seed
gives the same tokens on either, up to noise within rounding of a tie between two tokens.
"""

from __future__ import annotations

from functools import lru_cache

import jax
import jax.numpy as jnp

from worker.engine import cpu_build
from worker.engine.sampler import SamplingKernels

CUTOFFS, DRAW, ARGMAX = "redjax_sampling_cutoffs", "redjax_sampling_draw", "redjax_sampling_argmax"
TOP_N = "redjax_sampling_top_n"


@lru_cache(maxsize=1)
def load() -> bool:
    """Build (once per source and flags) and register the kernels; False if they cannot be built."""
    return (cpu_build.register("sampling.cc", "SamplingCutoffs", CUTOFFS)
            and cpu_build.register("sampling.cc", "SamplingDraw", DRAW)
            and cpu_build.register("sampling.cc", "SamplingArgmax", ARGMAX)
            and cpu_build.register("sampling.cc", "SamplingTopN", TOP_N))


def cutoffs(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits f32[R, V] (temperature applied), top_k i32[R] (0: off), top_p f32[R] -> f32[R]: the
    sampler masks every logit below its row's value (-inf: nothing). Call `load()` first."""
    call = jax.ffi.ffi_call(CUTOFFS, jax.ShapeDtypeStruct((logits.shape[0],), jnp.float32))
    return call(logits.astype(jnp.float32), top_k.astype(jnp.int32), top_p.astype(jnp.float32))


def draw(logits: jax.Array, temperature: jax.Array, keys: jax.Array) -> jax.Array:
    """logits f32[R, V] (masked entries -inf), temperature f32[R], keys u32[R, 2] -> i32[R]: per
    row, the first largest of logit_j + T g_j (`sampler.gumbel_draw`). Call `load()` first."""
    call = jax.ffi.ffi_call(DRAW, jax.ShapeDtypeStruct((logits.shape[0],), jnp.int32))
    return call(logits.astype(jnp.float32), temperature.astype(jnp.float32), keys.astype(jnp.uint32))


def argmax(logits: jax.Array) -> jax.Array:
    """logits f32[R, V] -> i32[R]: the first index of each row's maximum (V - 1 for a row with a
    NaN), as `sampler.first_argmax`. Call `load()` first."""
    call = jax.ffi.ffi_call(ARGMAX, jax.ShapeDtypeStruct((logits.shape[0],), jnp.int32))
    return call(logits.astype(jnp.float32))


def top_n(x: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """x f32[R, V], n <= V -> (values f32[R, n], ids i32[R, n]): each row's n largest, as
    `jax.lax.top_k` orders them (descending, equal values by lower index). Call `load()` first."""
    r = x.shape[0]
    call = jax.ffi.ffi_call(TOP_N, (jax.ShapeDtypeStruct((r, n), jnp.float32), jax.ShapeDtypeStruct((r, n), jnp.int32)))
    return call(x.astype(jnp.float32))


KERNELS = SamplingKernels(cutoffs, draw, argmax, top_n)


def choose(mode: str, tensor_parallel: int) -> SamplingKernels | None:
    """The kernels for `EngineConfig.sampler`, or None for jnp: "auto" takes them on the CPU backend
    of one device when they build (an FFI call is not split over a mesh, and an accelerator sorts
    and draws fast), "kernel" requires them, "jnp" never takes them."""
    if mode == "jnp":
        return None
    usable = jax.default_backend() == "cpu" and tensor_parallel == 1
    if mode == "kernel":
        if not usable:
            raise ValueError("sampler='kernel' needs the CPU backend and tensor_parallel 1")
        if not load():
            raise RuntimeError("the sampling kernels could not be built (see the log)")
        return KERNELS
    return KERNELS if usable and load() else None
