"""Projections on the CPU backend through the compiled panel-matmul kernel
(`cpu_kernels/panel_matmul.cc`), with the weights packed once when the engine starts.

XLA's CPU matmuls repack the weight operand on every call; at decode's few rows that is about a
third of each product. `pack_model` returns the model with every float32 projection (and the LM
head, tied or not) holding its weight as column panels `[ceil(N / PANEL), K, PANEL]`, which the
kernel streams once per product. Outputs match XLA's to float32 rounding (the sums run in a
different order); tests hold the kernel to `x @ W` and the packed model to the unpacked one.
"""

from __future__ import annotations

from functools import lru_cache

import jax
import jax.numpy as jnp
from flax import nnx

from worker.engine import cpu_build
from worker.models.llama import LlamaForCausalLM, Linear

TARGET = "redjax_panel_matmul"
PANEL = 32  # columns per panel: kPanel in the kernel


@lru_cache(maxsize=1)
def load() -> bool:
    """Build (once per source and flags) and register the kernel; False if it cannot be built."""
    return cpu_build.register("panel_matmul.cc", "PanelMatmul", TARGET)


def pack(weight: jax.Array) -> jax.Array:
    """f32[K, N] -> the kernel's panels f32[ceil(N / PANEL), K, PANEL], zero-padded past N."""
    k, n = weight.shape
    panels = -(-n // PANEL)
    padded = jnp.pad(weight.astype(jnp.float32), ((0, 0), (0, panels * PANEL - n)))  # [K, P * PANEL]
    return padded.reshape(k, panels, PANEL).transpose(1, 0, 2)


def matmul(x: jax.Array, panels: jax.Array, n: int) -> jax.Array:
    """x [..., K] @ the weight packed in `panels` -> f32[..., n]. Call `load()` first."""
    *lead, k = x.shape
    rows = x.reshape(-1, k).astype(jnp.float32)  # [M, K]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32))
    return call(rows, panels).reshape(*lead, n)


class PanelLinear(nnx.Module):
    """A float32 projection whose weight lives as the kernel's panels (made from a `Linear`)."""

    def __init__(self, weight: jax.Array, bias: jax.Array | None):  # weight [in, out], bias [out]
        self.panels = nnx.Param(pack(weight))  # f32[P, in, PANEL]
        self.bias = nnx.Param(bias.astype(jnp.float32)) if bias is not None else None
        self.d_out = weight.shape[1]

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> f32[..., out]
        y = matmul(x, self.panels[...], self.d_out)
        return y if self.bias is None else y + self.bias[...]


def packable(model: LlamaForCausalLM) -> bool:
    """True for a float32 model: bfloat16 products stay with XLA (AVX512-BF16 beats this kernel)."""
    return all(jnp.dtype(v[...].dtype) == jnp.float32 for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))


def pack_model(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """A copy of `model` (sharing its unpacked parameters) whose projections and LM head use the
    kernel; `model` itself is left as it was."""
    packed = nnx.merge(*nnx.split(model))
    for _, module in list(nnx.iter_modules(packed)):
        for name, child in list(vars(module).items()):
            if isinstance(child, Linear):
                bias = child.bias[...] if child.bias is not None else None
                setattr(module, name, nnx.data(PanelLinear(child.weight[...], bias)))
    if packed.lm_head is None:  # tied: the embedding table [vocab, hidden] doubles as the head
        packed.lm_head = nnx.data(PanelLinear(packed.model.embed_tokens.weight[...].T, None))
    return packed


def has_avx512() -> bool:
    """True on an x86 CPU with AVX-512F: the kernel's register tile (24 accumulators of 16 floats)
    is sized for its 32 vector registers; with narrower vectors it would spill, and XLA is the
    better choice."""
    return any("avx512f" in part.split() for part in cpu_build.cpu_signature().split("|"))


def choose_matmul(mode: str, tensor_parallel: int, model: LlamaForCausalLM) -> str:
    """Which projections an engine runs for `EngineConfig.matmul`: "kernel", "xla", or "auto" (the
    kernel for a float32 model on the CPU backend without tensor parallelism, on an AVX-512 CPU, if
    it builds)."""
    if mode == "xla":
        return "xla"
    usable = jax.default_backend() == "cpu" and tensor_parallel == 1 and packable(model)
    if mode == "kernel":
        if not usable:
            raise ValueError("matmul='kernel' needs a float32 model on the CPU backend and tensor_parallel 1")
        if not load():
            raise RuntimeError("the CPU matmul kernel could not be built (see the log)")
        return "kernel"
    return "kernel" if usable and has_avx512() and load() else "xla"
