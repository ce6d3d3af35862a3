"""How a model's layer projections are held: quantized (`EngineConfig.quantization`), packed for
the CPU matmul kernel, or as loaded; and when that is done.

The loader does it as it reads (`projection`, given to loader.load_model and build_model): each
layer projection becomes its int8 or int4 form, or the kernel's panels, as soon as its float
weights are in, and those are freed, so host memory peaks at about the model the engine runs plus
one float tensor: llama3-8b with int4 projections builds in ~7 GB, where its bfloat16 weights alone
are 16 GB, and a bfloat16 model on the kernel no longer holds its weights twice (loaded, then
packed). A model built some other way reaches the engine as loaded, and the engine quantizes
(`quantize`) and packs (cpu_matmul.pack_model) what is left.
"""

from __future__ import annotations

import logging

import jax
from flax import nnx

from worker.engine import cpu_matmul, int4_linear, int8_linear
from worker.engine.config import EngineConfig
from worker.models.config import ModelConfig
from worker.models.llama import LlamaForCausalLM
from worker.models.loader import DTYPES, Project

log = logging.getLogger(__name__)

SCHEMES = {"int8": (int8_linear, int8_linear.Int8Linear), "int4": (int4_linear, int4_linear.Int4Linear)}


def uses_kernel(config: EngineConfig) -> bool:
    """Whether `config`'s quantized projections run on their VNNI kernel (False without quantization)."""
    if config.quantization is None:
        return False
    return SCHEMES[config.quantization][0].uses_kernel(config.matmul, config.tensor_parallel)


def projection(config: EngineConfig, cfg: ModelConfig) -> Project | None:
    """The loader's replacement for each layer projection of a model of `cfg` under `config`
    (resolved for the backend): its quantized form, or with no quantization its panels where the
    engine will run the CPU matmul kernel (cpu_matmul.matmul_for); None: the projections stay as loaded."""
    if config.quantization is not None:
        return SCHEMES[config.quantization][0].projection(cfg, uses_kernel(config))
    return cpu_matmul.pack_linear if _float_kernel(config, cfg) else None


def head_projection(config: EngineConfig, cfg: ModelConfig) -> Project | None:
    """The loader's replacement for the LM head (untied, without a bias, as Llama's): the CPU
    kernel's panels where the engine will run its float products there, so the loaded head is freed
    before the engine builds the greedy head's screen from its panels (1 GB at llama3-8b's shape);
    None: it stays as loaded, and the engine packs it (cpu_matmul.pack_model) if it runs the kernel."""
    if not _float_kernel(config, cfg):
        return None
    return lambda head: head if head.bias is not None else cpu_matmul.pack_linear(head)


def load_forms(config: EngineConfig, cfg: ModelConfig) -> tuple[Project | None, Project | None]:
    """What the loader turns a model of `cfg`'s layer projections and LM head into (`projection`,
    `head_projection`): the `project` and `project_head` of loader.load_model and build_model."""
    return projection(config, cfg), head_projection(config, cfg)


def _float_kernel(config: EngineConfig, cfg: ModelConfig) -> bool:
    """Whether the engine runs a model of `cfg`'s float products (all its products unquantized, or
    with quantization the LM head) on the CPU matmul kernel (cpu_matmul.matmul_for)."""
    dtype = DTYPES[config.dtype or cfg.dtype]
    return jax.default_backend() == "cpu" and cpu_matmul.matmul_for(config.matmul, config.tensor_parallel, dtype) == "kernel"


def quantize(model: LlamaForCausalLM, config: EngineConfig) -> tuple[LlamaForCausalLM, str | None]:
    """`model` with the layer projections the loader left float quantized as `config` asks, in place,
    and how they run ("int8 (kernel)", "int4 (xla)"...; None without quantization). ValueError if
    projections the loader quantized are of another scheme or path than `config`'s."""
    quantized = [m for _, m in nnx.iter_modules(model.model) if isinstance(m, tuple(c for _, c in SCHEMES.values()))]
    if config.quantization is None:
        if quantized:
            raise ValueError("the model's projections are quantized, but the engine's quantization is None")
        return model, None
    scheme, kind = SCHEMES[config.quantization]
    kernel = uses_kernel(config)
    packed = any(isinstance(m, cpu_matmul.PanelLinear) for _, m in nnx.iter_modules(model.model))
    if packed or any(type(m) is not kind or m.kernel != kernel for m in quantized):
        raise ValueError(f"the model's projections were quantized or packed otherwise than quantization="
                         f"{config.quantization!r} on the {'kernel' if kernel else 'xla'} path")
    if config.quantization == "int4" and not kernel:
        log.warning("int4 projections without the VNNI kernel: XLA dequantizes the weights (a byte each in memory) on "
                    "every step, as torchao does, no faster than the float weights; int8 is the faster choice here")
    int8_linear.replace_projections(model, scheme.projection(model.cfg, kernel))
    return model, f"{config.quantization} ({'kernel' if kernel else 'xla'})"
