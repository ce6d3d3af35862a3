"""A layer's small operations on the CPU backend through compiled kernels: RMSNorm together with
the residual add before it (`cpu_kernels/rms_norm.cc`) and rotary embeddings
(`cpu_kernels/rope.cc`); and a bfloat16 embedding table held as its bits (`BitsEmbedding`).

XLA runs each of these as several passes, each a task on its intra-op pool; at decode's few rows
the tasks cost more than their arithmetic (llama-100m decode: 2.3 % less time with the kernels,
session 21; the demo model showed no change beyond the noise). `with_kernels` returns the model with its norms and rotations swapped for the kernels'; the
arithmetic is the same (the sums of squares in another order), and tests hold both to the XLA
modules.
"""

from __future__ import annotations

from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from worker.engine import cpu_build
from worker.models.llama import Embedding, LlamaForCausalLM, RMSNorm, Rotary

NORM, ADD_NORM, ROPE = "redjax_rms_norm", "redjax_add_rms_norm", "redjax_rope"


@lru_cache(maxsize=1)
def load() -> bool:
    """Build (once per source and flags) and register the kernels; False if they cannot be built."""
    return (cpu_build.register("rms_norm.cc", "RmsNorm", NORM) and cpu_build.register("rms_norm.cc", "AddRmsNorm", ADD_NORM)
            and cpu_build.register("rope.cc", "Rope", ROPE))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """f32[..., H], f32[H] -> f32[..., H]: weight * (x / sqrt(mean(x^2) + eps)). Call `load()` first."""
    rows = x.reshape(-1, x.shape[-1])
    call = jax.ffi.ffi_call(NORM, jax.ShapeDtypeStruct(rows.shape, jnp.float32))
    return call(rows, weight, eps=np.float32(eps)).reshape(x.shape)


def add_rms_norm(x: jax.Array, y: jax.Array, weight: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """f32[..., H] twice, f32[H] -> (x + y, rms_norm(x + y)). Call `load()` first."""
    rows = x.reshape(-1, x.shape[-1])
    out = jax.ShapeDtypeStruct(rows.shape, jnp.float32)
    total, normed = jax.ffi.ffi_call(ADD_NORM, (out, out))(rows, y.reshape(rows.shape), weight, eps=np.float32(eps))
    return total.reshape(x.shape), normed.reshape(x.shape)


def rope(x: jax.Array, table: tuple[jax.Array, jax.Array]) -> jax.Array:
    """`worker.models.rope.apply_rope` for float32: x [..., T, N, D], table (cos, signed sin) each
    [..., T, 1, D] -> [..., T, N, D]. Call `load()` first."""
    *lead, n, d = x.shape
    flat = x.reshape(-1, n, d)  # [tokens, N, D]
    cos, sin = (t.reshape(flat.shape[0], d) for t in table)  # [tokens, D]
    return jax.ffi.ffi_call(ROPE, jax.ShapeDtypeStruct(flat.shape, jnp.float32))(flat, cos, sin).reshape(x.shape)


class KernelRMSNorm(nnx.Module):
    """An RMSNorm over float32 activations (made from an `RMSNorm`, sharing its weight, float32 or
    bfloat16: widened exactly, as `RMSNorm` does) that runs the kernels."""

    def __init__(self, norm: RMSNorm):
        self.weight = norm.weight  # [dim]
        self.eps = norm.eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...].astype(jnp.float32), self.eps)

    def add_norm(self, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        return add_rms_norm(x, y, self.weight[...].astype(jnp.float32), self.eps)


class KernelRotary(nnx.Module):
    def __call__(self, x: jax.Array, table: tuple[jax.Array, jax.Array]) -> jax.Array:
        return rope(x, table)


class Bits(nnx.Variable):
    """A bfloat16 table as its bit patterns (uint16): not an `nnx.Param`, so that the dtype checks of
    the float paths (cpu_matmul.kernel_dtype) see the model's bfloat16 parameters alone."""


class BitsEmbedding(nnx.Module):
    """A bfloat16 embedding table held as its bits (made from an `Embedding`), its rows gathered as
    integers and widened to float32 exactly. XLA's CPU backend gathers bfloat16 in float32: it widens
    the whole table first, and in a call of fused decode steps hoists that out of the loop as a float32
    copy of the table per call (llama-100m in bfloat16: 98 MB, ~11 ms a call, 1.1 ms a step at batch
    1, session 68)."""

    def __init__(self, embedding: Embedding):
        self.bits = Bits(jax.lax.bitcast_convert_type(embedding.weight[...], jnp.uint16))  # u16[vocab, dim]

    def __call__(self, tokens: jax.Array) -> jax.Array:  # i32[...] -> f32[..., dim]
        rows = jnp.take(self.bits[...], tokens, axis=0).astype(jnp.uint32) << 16  # a bfloat16's bits atop a float32's
        return jax.lax.bitcast_convert_type(rows, jnp.float32)


def with_kernels(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """`model` (float32 activations, on the CPU backend) with its norms and rotations on the kernels
    (unchanged if they cannot be built) and a bfloat16 embedding table as its bits, in place."""
    for _, module in list(nnx.iter_modules(model)):
        for name, child in list(vars(module).items()):
            if isinstance(child, Embedding) and child.weight[...].dtype == jnp.bfloat16:
                setattr(module, name, BitsEmbedding(child))
    if not load():
        return model
    for _, module in list(nnx.iter_modules(model)):
        for name, child in list(vars(module).items()):
            if isinstance(child, RMSNorm):
                setattr(module, name, KernelRMSNorm(child))
            elif isinstance(child, Rotary):
                setattr(module, name, KernelRotary())
    return model
