"""Quantized layer projections (`EngineConfig.quantization`): the scheme, and when its weights are made.

The loader quantizes as it reads (`projection`, given to loader.load_model and build_model): each
layer projection becomes its int8 or int4 form as soon as its float weights are in, and those are
freed, so host memory peaks at about the quantized model plus one float tensor (llama3-8b with int4
projections: ~7 GB, where its bfloat16 weights alone are 16 GB). A model built some other way
reaches the engine with float projections, and `quantize` does the rest there.
"""

from __future__ import annotations

import logging

from flax import nnx

from worker.engine import int4_linear, int8_linear
from worker.engine.config import EngineConfig
from worker.models.config import ModelConfig
from worker.models.llama import LlamaForCausalLM
from worker.models.loader import Project

log = logging.getLogger(__name__)

SCHEMES = {"int8": (int8_linear, int8_linear.Int8Linear), "int4": (int4_linear, int4_linear.Int4Linear)}


def uses_kernel(config: EngineConfig) -> bool:
    """Whether `config`'s quantized projections run on their VNNI kernel (False without quantization)."""
    if config.quantization is None:
        return False
    return SCHEMES[config.quantization][0].uses_kernel(config.matmul, config.tensor_parallel)


def projection(config: EngineConfig, cfg: ModelConfig) -> Project | None:
    """The loader's replacement for each layer projection of a model of `cfg` under `config`
    (None: no quantization, the float projections stay)."""
    if config.quantization is None:
        return None
    return SCHEMES[config.quantization][0].projection(cfg, uses_kernel(config))


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
    if any(type(m) is not kind or m.kernel != kernel for m in quantized):
        raise ValueError(f"the model's projections were quantized otherwise than quantization="
                         f"{config.quantization!r} on the {'kernel' if kernel else 'xla'} path")
    if config.quantization == "int4" and not kernel:
        log.warning("int4 projections without the VNNI kernel: XLA dequantizes the weights (a byte each in memory) on "
                    "every step, as torchao does, no faster than the float weights; int8 is the faster choice here")
    int8_linear.replace_projections(model, projection(config, model.cfg))
    return model, f"{config.quantization} ({'kernel' if kernel else 'xla'})"
