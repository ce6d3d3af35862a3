"""int4 projections (`EngineConfig.quantization = "int4"`): weights quantized once at load to 4 bits
in groups of G inputs with a scale per group and output column, activations quantized at run time to
int8 per token row with a scale and a zero point; the products run in int32 (W4A8, dynamic).

The scheme is torchao's `Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
weight_granularity=PerGroup(G))` ("8da4w"): symmetric weights, q = round-half-even(w * (1 / s)) in
[-8, 7] with s = max|w| / 7.5 over the group; asymmetric activations, s = (max(x, 0) - min(x, 0)) /
255 and zero point z = -128 - round(min(x, 0) / s), q = round(x * (1 / s)) + z in [-128, 127]. G is
the largest of 128, 64, 32 that divides every projection's inputs (`group_size`), the same for every
layer as torchao's config. The LM head and the embeddings stay in the model's dtype.

On a CPU with AVX512-VNNI the products run on `cpu_kernels/int4_matmul.cc` (the weight read as
half a byte per value: the point of int4 where a decode step is bound by reading its weights);
elsewhere XLA computes what torchao does, the dequantized activations times the dequantized weights
in float32 (the weights held a byte each and dequantized on every step: right, not fast, and the
engine says so in its log). The two agree to float32 rounding (the kernel sums exact int32
products per group).
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from worker.engine import cpu_build, cpu_matmul
from worker.engine.int8_linear import Quantized, kernel_applies, replace_projections
from worker.models.config import ModelConfig
from worker.models.llama import LlamaForCausalLM, Linear

W4A8_TARGET = "redjax_panel_matmul_w4a8"  # cpu_kernels/int4_matmul.cc's PanelMatmulW4A8
GROUP_SIZES = (128, 64, 32)  # the group size is the first of these that divides every projection's inputs
PANEL = 32  # columns per panel: kPanel in the kernel
TINY = float(np.finfo(np.float32).tiny)  # the smallest scale (torchao's: float32's smallest normal)


def group_size(in_features: list[int]) -> int:
    """The group size for projections with these input widths; ValueError if none fits."""
    for g in GROUP_SIZES:
        if all(k % g == 0 for k in in_features):
            return g
    raise ValueError(f"quantization='int4' needs every projection's inputs divisible by 32 (got {sorted(set(in_features))})")


def model_group_size(model: LlamaForCausalLM) -> int:
    return config_group_size(model.cfg)


def config_group_size(cfg: ModelConfig) -> int:
    """The group size of a model of `cfg`: its projections take hidden_size (q, k, v, gate, up),
    the heads' width (o) or intermediate_size (down) inputs."""
    return group_size([cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size])


@partial(jax.jit, static_argnames="group")
def quantize_weight(weight: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
    """w f[K, N] -> (q i8[K, N] in [-8, 7], scale f32[K / group, N]): torchao's symmetric int4 per
    group of `group` consecutive inputs of each column, in float32 (one XLA program: at load, both
    cores and no host copies)."""
    k, n = weight.shape
    w = weight.astype(jnp.float32).reshape(k // group, group, n)
    most = jnp.max(jnp.abs(w), axis=1)  # [G, N]
    # an IEEE division (XLA turns one by a broadcast constant into a product by its reciprocal)
    scale = jnp.maximum(most / jax.lax.optimization_barrier(jnp.full_like(most, 7.5)), jnp.float32(TINY))
    q = jnp.clip(jnp.round(w * (jnp.float32(1) / scale)[:, None, :]), -8, 7).astype(jnp.int8)
    return q.reshape(k, n), scale


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x f32[M, K] -> (q f32[M, K] integers in [-128, 127], scale f32[M], zero point f32[M]): torchao's
    per-token asymmetric int8. A row holding a value that is not finite gets a NaN scale."""
    lo = jnp.minimum(jnp.min(x, axis=1, keepdims=True), 0.0)
    hi = jnp.maximum(jnp.max(x, axis=1, keepdims=True), 0.0)
    # IEEE divisions: XLA turns one by a broadcast constant into a product by its reciprocal
    scale = jnp.maximum((hi - lo) / jax.lax.optimization_barrier(jnp.full_like(hi, 255.0)), jnp.float32(TINY))
    zero = jnp.clip(-128.0 - jnp.round(lo / scale), -128.0, 127.0)
    q = jnp.clip(jnp.round(x * (jnp.float32(1) / scale)) + zero, -128.0, 127.0)
    scale = jnp.where(jnp.all(jnp.isfinite(x), axis=1, keepdims=True), scale, jnp.nan)
    return q, scale[:, 0], zero[:, 0]


@jax.jit
def pack(q: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q i8[K, N], scale f32[G, N]) -> the kernel's (panels u8[P, K / 4, 64], scales f32[P, G, 32],
    c f32[P * 32]): a panel step's byte j holds column j // 4's input k + j % 4 in its low nibble and
    column 16 + j // 4's in its high one, each as q + 8; columns past N hold 8 (a zero) and scale 0.
    c[n] = sum over groups of scale * the group's q summed: the zero point's share of a product."""
    k, n = q.shape
    panels, groups = -(-n // PANEL), scale.shape[0]
    pad = ((0, 0), (0, panels * PANEL - n))
    u = jnp.pad((q + 8).astype(jnp.uint8), pad, constant_values=8)  # [K, P * 32]
    lanes = u.reshape(k // 4, 4, panels, PANEL).transpose(2, 0, 3, 1)  # [P, steps, 32 columns, 4 k]
    nibbles = lanes[:, :, :16, :] | (lanes[:, :, 16:, :] << 4)  # [P, steps, 16, 4]
    scales = jnp.pad(scale, pad).reshape(groups, panels, PANEL).transpose(1, 0, 2)  # [P, G, 32]
    sums = q.reshape(groups, k // groups, n).sum(axis=1, dtype=jnp.int32).astype(jnp.float32)  # [G, N]
    c = jnp.pad((scale * sums).sum(axis=0), pad[1])  # [P * 32]
    return nibbles.reshape(panels, k // 4, 64), scales, c


@lru_cache(maxsize=1)
def load() -> bool:
    """The VNNI kernel built and registered; False where the CPU or compiler lacks it."""
    return cpu_matmul.has_cpu_flag("avx512_vnni") and cpu_build.register("int4_matmul.cc", "PanelMatmulW4A8",
                                                                           W4A8_TARGET)


def uses_kernel(matmul: str, tensor_parallel: int) -> bool:
    """Whether int4 projections run on the VNNI kernel for `EngineConfig.matmul` (as int8's do)."""
    return kernel_applies(matmul, tensor_parallel, load, "int4")


class Int4Linear(nnx.Module):
    """A projection with int4 weights (made from a `Linear`): x [..., in] -> f32[..., out]."""

    def __init__(self, linear: Linear, group: int, kernel: bool):
        q, scale = quantize_weight(linear.weight[...], group)
        self.d_in, self.d_out = q.shape
        self.kernel = kernel
        self.bias = Quantized(linear.bias[...].astype(jnp.float32)) if linear.bias is not None else None
        if not kernel:
            q, scale = split_like(linear.weight[...], q, scale)
            self.weight, self.scale = Quantized(q), Quantized(scale)  # i8[in, out], f32[G, out]
            return
        if not load():
            raise RuntimeError("the int4 kernel needs AVX512-VNNI and a build of cpu_kernels/int4_matmul.cc")
        panels, scales, c = pack(q, scale)
        self.panels = Quantized(panels)  # u8[P, in / 4, 64]
        self.scale = Quantized(scales)  # f32[P, G, 32]
        self.c = Quantized(c)  # f32[P * 32]

    def __call__(self, x: jax.Array) -> jax.Array:
        *lead, k = x.shape
        rows = x.reshape(-1, k).astype(jnp.float32)  # [M, in]
        if self.kernel:  # quantizes each row itself, as `quantize_rows` does
            call = jax.ffi.ffi_call(W4A8_TARGET, jax.ShapeDtypeStruct((rows.shape[0], self.d_out), jnp.float32))
            y = call(rows, self.panels[...], self.scale[...], self.c[...])
        else:  # torchao's own arithmetic: dequantized x times dequantized w
            q, row_scale, zero = quantize_rows(rows)
            scale = self.scale[...]  # [G, out]
            w = (self.weight[...].astype(jnp.float32).reshape(scale.shape[0], -1, self.d_out) * scale[:, None, :])
            y = jnp.dot((q - zero[:, None]) * row_scale[:, None], w.reshape(self.d_in, self.d_out),
                        precision=jax.lax.Precision.HIGHEST)
        y = y.reshape(*lead, self.d_out)
        return y if self.bias is None else y + self.bias[...]


def split_like(weight: jax.Array, q: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q and scale (groups x columns) placed over `weight`'s tensor-parallel mesh as `weight` is
    (models/sharding.py): by output columns both; by input rows q, and the scales by their groups
    where the devices split the groups evenly (else every device holds them all)."""
    sharding = getattr(weight, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.size == 1:
        return jnp.asarray(q), jnp.asarray(scale)
    rows, columns = (tuple(sharding.spec) + (None, None))[:2]
    spec = P(None, columns) if rows is None else P(rows, None) if scale.shape[0] % sharding.mesh.shape[rows] == 0 else P()
    return jax.device_put(q, sharding), jax.device_put(scale, NamedSharding(sharding.mesh, spec))


def projection(cfg: ModelConfig, kernel: bool) -> Callable[[Linear], Int4Linear]:
    """A layer projection of a model of `cfg` -> its int4 form (loader.Project), every layer's in
    groups of `config_group_size`; `kernel`: on the VNNI kernel (`uses_kernel`)."""
    return partial(Int4Linear, group=config_group_size(cfg), kernel=kernel)


def quantize_model(model: LlamaForCausalLM, kernel: bool) -> LlamaForCausalLM:
    """`model` with every projection of its layers (not the LM head) int4, in place; `kernel`: on
    the VNNI kernel (`uses_kernel`)."""
    return replace_projections(model, projection(model.cfg, kernel))
