"""Projections on the CPU backend through the compiled panel-matmul kernel
(`cpu_kernels/panel_matmul.cc`), with the weights packed once when the engine starts.

XLA's CPU matmuls repack the weight operand on every call; at decode's few rows that is about a
third of each product. `pack_model` returns the model with every projection (and the LM head,
tied or not) holding its weight as column panels, which the kernel streams once per product:
float32 weights as `[ceil(N / PANEL), K, PANEL]`, bfloat16 weights (on a CPU with AVX512-BF16) as
`[ceil(N / PANEL), ceil(K / 2), 2 * PANEL]`, each panel row the PANEL columns of two consecutive k.
Outputs match XLA's to float32 rounding (the sums run in a different order; a bfloat16 product
rounds x to bfloat16 first, as `Linear` does); tests hold the kernel to `x @ W` and the packed
model to the unpacked one.
"""

from __future__ import annotations

from functools import lru_cache, partial

import jax
import jax.numpy as jnp
from flax import nnx

from worker.engine import cpu_build
from worker.models.llama import LlamaForCausalLM, Linear

TARGETS = {jnp.dtype(jnp.float32): "redjax_panel_matmul", jnp.dtype(jnp.bfloat16): "redjax_panel_matmul_bf16"}
PANEL = 32  # columns per panel: kPanel in the kernel
AMX_TARGET = "redjax_amx_matmul_bf16"  # bfloat16 panels on AMX tiles (cpu_kernels/amx_matmul.cc)
AMX_K = 32  # the AMX kernel's K must be a multiple of this (one tile step); others keep PanelMatmulBf16


def load(dtype=jnp.float32) -> bool:
    """Build (once per source and flags) and register the kernel for `dtype` weights (float32, or
    bfloat16 where the CPU has AVX512-BF16); False if it cannot be built."""
    return _load(jnp.dtype(dtype).name)


@lru_cache(maxsize=None)
def _load(dtype: str) -> bool:  # once per dtype, however it is spelled
    if dtype == "bfloat16":
        if not (has_cpu_flag("avx512_bf16") and cpu_build.register("panel_matmul.cc", "PanelMatmulBf16",
                                                                   TARGETS[jnp.dtype(jnp.bfloat16)])):
            return False
        amx()  # registered now, before traces on several compile threads ask for it
        return True
    return cpu_build.register("panel_matmul.cc", "PanelMatmul", TARGETS[jnp.dtype(jnp.float32)])


@lru_cache(maxsize=None)
def amx() -> bool:
    """Whether bfloat16 products run on AMX tiles: the CPU has AMX-BF16, the kernel builds, and
    Linux grants the process the tile state (Intel Sapphire Rapids and later). On such a CPU the
    AVX-512 bfloat16 kernel reads 120-170 GFLOP/s, XLA's products 250-790, AMX's 600-1100 (session 32)."""
    return (has_cpu_flag("amx_bf16") and has_cpu_flag("avx512_bf16")
            and cpu_build.register("amx_matmul.cc", "AmxMatmulBf16", AMX_TARGET, permit="RedjaxAmxPermit"))


@partial(jax.jit, static_argnames="transposed")
def pack(weight: jax.Array, transposed: bool = False) -> jax.Array:
    """[K, N] (or with `transposed` [N, K], as an embedding table holds a tied head) -> the kernel's
    panels, zero-padded past N (and past K): float32 weights (or any other dtype but bfloat16) as
    f32[ceil(N / PANEL), K, PANEL], bfloat16 ones as bf16[ceil(N / PANEL), ceil(K / 2), 2 * PANEL]
    (a row: each column's k and k + 1 in turn). One program: the padding and the moves make one
    copy of the weight, not three (llama3-8b's head is 1 GB in bfloat16)."""
    weight = weight.T if transposed else weight
    k, n = weight.shape
    panels = -(-n // PANEL)
    if weight.dtype == jnp.bfloat16:
        steps = -(-k // 2)
        padded = jnp.pad(weight, ((0, 2 * steps - k), (0, panels * PANEL - n)))  # [2 * steps, P * PANEL]
        pairs = padded.reshape(steps, 2, panels, PANEL).transpose(2, 0, 3, 1)  # [P, steps, PANEL, 2]
        return pairs.reshape(panels, steps, 2 * PANEL)
    padded = jnp.pad(weight.astype(jnp.float32), ((0, 0), (0, panels * PANEL - n)))  # [K, P * PANEL]
    return padded.reshape(k, panels, PANEL).transpose(1, 0, 2)


def matmul(x: jax.Array, panels: jax.Array, n: int) -> jax.Array:
    """x [..., K] @ the weight packed in `panels` -> f32[..., n] (bfloat16 panels: x rounded to
    bfloat16 first). Call `load(panels.dtype)` first."""
    *lead, k = x.shape
    rows = x.reshape(-1, k).astype(jnp.float32)  # [M, K]
    target = TARGETS[jnp.dtype(panels.dtype)]
    if panels.dtype == jnp.bfloat16 and k % AMX_K == 0 and amx():
        target = AMX_TARGET
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32))
    return call(rows, panels).reshape(*lead, n)


class PanelLinear(nnx.Module):
    """A projection whose weight lives as the kernel's panels (made from a `Linear`)."""

    def __init__(self, weight: jax.Array, bias: jax.Array | None, transposed: bool = False):
        # weight [in, out] (transposed: [out, in]), bias [out]
        self.panels = nnx.Param(pack(weight, transposed))  # f32[P, in, PANEL] or bf16[P, in / 2, 2 * PANEL]
        self.bias = nnx.Param(bias.astype(jnp.float32)) if bias is not None else None
        self.d_out = weight.shape[0 if transposed else 1]

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> f32[..., out]
        y = matmul(x, self.panels[...], self.d_out)
        return y if self.bias is None else y + self.bias[...]


def kernel_dtype(model: LlamaForCausalLM):
    """The dtype the kernel would run `model`'s products in: float32 or bfloat16, where every
    parameter and every product (`Linear`, the tied head) is in that one dtype; else None (XLA)."""
    params = {jnp.dtype(v[...].dtype) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    computes = {jnp.dtype(m.dtype) for _, m in nnx.iter_modules(model) if isinstance(m, Linear)}
    dtypes = params | computes | {jnp.dtype(model.model.dtype)}
    return dtypes.pop() if len(dtypes) == 1 and dtypes <= set(TARGETS) else None


def pack_model(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """A copy of `model` (sharing its unpacked parameters) whose projections and LM head use the
    kernel; `model` itself is left as it was. (Projections the loader packed stay as they are.)"""
    packed = nnx.merge(*nnx.split(model))
    for _, module in list(nnx.iter_modules(packed)):
        for name, child in list(vars(module).items()):
            if isinstance(child, Linear):
                setattr(module, name, nnx.data(pack_linear(child)))
    if packed.lm_head is None:  # tied: the embedding table [vocab, hidden] doubles as the head
        packed.lm_head = nnx.data(PanelLinear(packed.model.embed_tokens.weight[...], None, transposed=True))
    return packed


def has_cpu_flag(flag: str) -> bool:
    """Whether /proc/cpuinfo lists `flag` ("avx512f": the kernel's register tile, 24 accumulators
    of 16 floats, is sized for AVX-512's 32 vector registers, and would spill with narrower ones;
    "avx512_bf16": its bfloat16 products)."""
    return any(flag in part.split() for part in cpu_build.cpu_signature().split("|"))


def choose_matmul(mode: str, tensor_parallel: int, model: LlamaForCausalLM) -> str:
    """Which projections an engine runs for `EngineConfig.matmul`: "kernel", "xla", or "auto" (the
    kernel for a float32 model, or a bfloat16 one on a CPU with AVX512-BF16 (and AMX where the CPU
    has it), on the CPU backend without tensor parallelism, on an AVX-512 CPU, if it builds). A model
    whose projections the loader packed (`PanelLinear`) runs on the kernel."""
    if any(isinstance(m, PanelLinear) for _, m in nnx.iter_modules(model.model)):
        if mode == "xla":
            raise ValueError("matmul='xla' for a model whose projections were packed for the CPU kernel as it loaded")
        return "kernel"
    return matmul_for(mode, tensor_parallel, kernel_dtype(model))


def matmul_for(mode: str, tensor_parallel: int, dtype) -> str:
    """`choose_matmul` for a model whose parameters and products are all `dtype` (None: mixed, or
    another than float32 and bfloat16)."""
    if mode == "xla":
        return "xla"
    dtype = jnp.dtype(dtype) if dtype is not None and jnp.dtype(dtype) in TARGETS else None
    usable = jax.default_backend() == "cpu" and tensor_parallel == 1 and dtype is not None
    if mode == "kernel":
        if not usable:
            raise ValueError("matmul='kernel' needs a float32 or bfloat16 model on the CPU backend and "
                             "tensor_parallel 1")
        if not load(dtype):
            raise RuntimeError(f"the CPU matmul kernel for {dtype} weights could not be built or this CPU "
                               "lacks the instructions (see the log)")
        return "kernel"
    if dtype == jnp.bfloat16 and has_cpu_flag("amx_bf16") and not amx():
        return "xla"  # AMX refused: on these CPUs XLA's bfloat16 products outrun the AVX-512 kernel's 3x
    return "kernel" if usable and has_cpu_flag("avx512f") and load(dtype) else "xla"


def pack_linear(linear: Linear) -> PanelLinear:
    """A projection as the kernel holds it (the loader's `Project` for float projections on the kernel)."""
    return PanelLinear(linear.weight[...], linear.bias[...] if linear.bias is not None else None)
