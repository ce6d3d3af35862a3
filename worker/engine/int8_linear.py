"""int8 projections (`EngineConfig.quantization = "int8"`): weights quantized once at load, one
scale per output column, and activations quantized at run time, one scale per token row; the
products run in int32 and are scaled back to float32 (W8A8, dynamic).

The scheme is torchao's `Int8DynamicActivationInt8WeightConfig` (per-row symmetric int8 in
[-128, 127], scale = max|v| / 127.5, at least float32's epsilon, q = round-half-even(v * (1 /
scale))), so a checkpoint served here gives what that library gives in PyTorch; tests hold the
quantized values to torchao's and the logits to a torchao-quantized transformers model. The LM
head and the embeddings stay in the model's dtype.

Two paths compute the same numbers bit for bit: XLA's int8 dot (any backend; on GPUs cuBLAS's int8
products), and on a CPU with AVX512-VNNI `cpu_kernels/panel_matmul.cc`'s VPDPBUSD panels, which
quantize the rows themselves (`quantize_row_w8a8` in cpu_kernels/i8_rows.h: the same float32
operations, its divisions kept IEEE divisions under -ffast-math). Both take the int32 sums exactly and scale them as float32(sum) * (row scale * column scale); a bias
is added after, which XLA may fuse into a multiply-add (one rounding fewer).
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from worker.engine import cpu_build, cpu_matmul
from worker.models.config import ModelConfig
from worker.models.llama import LlamaForCausalLM, Linear

W8A8_TARGET = "redjax_panel_matmul_w8a8"  # cpu_kernels/panel_matmul.cc's PanelMatmulW8A8
EPS = float(np.finfo(np.float32).eps)  # the smallest scale (torchao's, for float32 and bfloat16 alike)


class Quantized(nnx.Variable):
    """An int8 projection's arrays: not `nnx.Param`, so that the dtype checks of the float paths
    (cpu_matmul.kernel_dtype) see only the model's float parameters."""


def quantize(v: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """v f32[...] -> (q i8[...], scale f32[...] without `axis`): each slice along `axis` by its own
    scale. A slice holding a value that is not finite gets a NaN scale, so its products are NaN."""
    v = v.astype(jnp.float32)
    most = jnp.max(jnp.abs(v), axis=axis, keepdims=True)
    # an IEEE division: XLA turns one by a broadcast constant into a product by its reciprocal,
    # which rounds twice (a scale one ulp off torchao's in about 70 % of slices)
    scale = jnp.maximum(most / jax.lax.optimization_barrier(jnp.full_like(most, 127.5)), jnp.float32(EPS))
    q = jnp.clip(jnp.round(v * (jnp.float32(1) / scale)), -128, 127).astype(jnp.int8)
    scale = jnp.where(jnp.all(jnp.isfinite(v), axis=axis, keepdims=True), scale, jnp.nan)
    return q, jnp.squeeze(scale, axis)


@jax.jit
def quantize_columns(weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w f[in, out] -> (q i8[in, out], scale f32[out]): `quantize` by columns, as one XLA program."""
    return quantize(weight, axis=0)


@jax.jit
def kernel_arrays(weight: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """w f[in, out] -> the VNNI kernel's (panels i8[P, ceil(in / 4), 4 * PANEL], scale f32[P * PANEL],
    sums i32[P * PANEL]), columns past `out` zero; one XLA program (at load: both cores, no host copy)."""
    from worker.engine.screened_head import pack_int8

    q, scale = quantize(weight, axis=0)  # i8[in, out], f32[out]
    pad = (0, -q.shape[1] % cpu_matmul.PANEL)
    return pack_int8(q.T), jnp.pad(scale, pad), jnp.pad(q.sum(axis=0, dtype=jnp.int32), pad)


@lru_cache(maxsize=1)
def load() -> bool:
    """The VNNI kernel built and registered; False where the CPU or compiler lacks it."""
    return cpu_matmul.has_cpu_flag("avx512_vnni") and cpu_build.register("panel_matmul.cc", "PanelMatmulW8A8",
                                                                           W8A8_TARGET)


def uses_kernel(matmul: str, tensor_parallel: int) -> bool:
    """Whether int8 projections run on the VNNI kernel for `EngineConfig.matmul` (`kernel_applies`)."""
    return kernel_applies(matmul, tensor_parallel, load, "int8")


def kernel_applies(matmul: str, tensor_parallel: int, loaded, scheme: str) -> bool:
    """Whether a quantized projection's VNNI kernel (`loaded()`: built and registered) runs for
    `EngineConfig.matmul`: "auto" where it applies (the CPU backend, one device, AVX512-VNNI, it
    builds), "kernel" there or fail, "xla" never."""
    if matmul == "xla":
        return False
    usable = jax.default_backend() == "cpu" and tensor_parallel == 1
    if matmul == "kernel" and not (usable and loaded()):
        raise ValueError(f"matmul='kernel' with quantization='{scheme}' needs the CPU backend, tensor_parallel 1 "
                         "and a CPU with AVX512-VNNI whose kernel builds")
    return usable and loaded()


class Int8Linear(nnx.Module):
    """A projection with int8 weights (made from a `Linear`): x [..., in] -> f32[..., out]."""

    def __init__(self, linear: Linear, kernel: bool):
        self.d_in, self.d_out = linear.weight.shape
        self.kernel = kernel
        self.bias = Quantized(linear.bias[...].astype(jnp.float32)) if linear.bias is not None else None
        if not kernel:
            q, scale = quantize_columns(linear.weight[...])
            self.weight, self.scale = Quantized(q), Quantized(scale)  # i8[in, out], f32[out]
            return
        if not load():
            raise RuntimeError("the int8 kernel needs AVX512-VNNI and a build of cpu_kernels/panel_matmul.cc")
        panels, scale, sums = kernel_arrays(linear.weight[...])
        self.panels = Quantized(panels)  # i8[P, ceil(in / 4), 4 * PANEL]
        self.scale = Quantized(scale)  # f32[P * PANEL], zero past out
        self.sums = Quantized(sums)  # i32[P * PANEL]: each column's quantized weights summed

    def __call__(self, x: jax.Array) -> jax.Array:
        *lead, k = x.shape
        rows = x.reshape(-1, k).astype(jnp.float32)  # [M, in]
        if self.kernel:  # quantizes each row itself, as `quantize` does
            call = jax.ffi.ffi_call(W8A8_TARGET, jax.ShapeDtypeStruct((rows.shape[0], self.d_out), jnp.float32))
            y = call(rows, self.panels[...], self.scale[...], self.sums[...])
        else:
            q, row_scale = quantize(rows, axis=1)  # i8[M, in], f32[M]
            sums = jax.lax.dot_general(q, self.weight[...], (((1,), (0,)), ((), ())),
                                       preferred_element_type=jnp.int32)  # i32[M, out], exact
            y = sums.astype(jnp.float32) * (row_scale[:, None] * self.scale[...][None, :])
        y = y.reshape(*lead, self.d_out)
        return y if self.bias is None else y + self.bias[...]


def projection(cfg: ModelConfig, kernel: bool) -> Callable[[Linear], Int8Linear]:
    """A layer projection of a model of `cfg` -> its int8 form (loader.Project); `kernel`: on the VNNI
    kernel (`uses_kernel`)."""
    return partial(Int8Linear, kernel=kernel)


def quantize_model(model: LlamaForCausalLM, kernel: bool) -> LlamaForCausalLM:
    """`model` with every projection of its layers (not the LM head) int8, in place; `kernel`: on
    the VNNI kernel (`uses_kernel`)."""
    return replace_projections(model, projection(model.cfg, kernel))


def replace_projections(model: LlamaForCausalLM, project: Callable[[Linear], nnx.Module]) -> LlamaForCausalLM:
    """`model` with each float projection of its layers (not the LM head) replaced by `project(it)`, in place."""
    for _, module in list(nnx.iter_modules(model.model)):  # the layers (the head is the model's own child)
        for name, child in list(vars(module).items()):
            if isinstance(child, Linear):
                setattr(module, name, project(child))
    return model
