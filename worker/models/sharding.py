"""Tensor parallelism over a 1-D device mesh ("tp"), declared once per parameter name.

Attention heads and MLP columns are split across devices (q/k/v and gate/up by output columns,
o and down by input rows of their `[in, out]` weights, lm_head by vocabulary); KV pages are
split by KV head. XLA
(GSPMD) inserts the all-reduces, so the model code stays unaware of the mesh.
"""

from __future__ import annotations

import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from worker.models.config import ModelConfig

AXIS = "tp"

# parameter-name suffix -> how its [in, out] weight (or bias [out]) is split
RULES: tuple[tuple[str, P], ...] = (
    ("self_attn.q_proj.weight", P(None, AXIS)),
    ("self_attn.k_proj.weight", P(None, AXIS)),
    ("self_attn.v_proj.weight", P(None, AXIS)),
    ("self_attn.q_proj.bias", P(AXIS)),
    ("self_attn.k_proj.bias", P(AXIS)),
    ("self_attn.v_proj.bias", P(AXIS)),
    ("self_attn.o_proj.weight", P(AXIS, None)),
    ("mlp.gate_proj.weight", P(None, AXIS)),
    ("mlp.up_proj.weight", P(None, AXIS)),
    ("mlp.gate_proj.bias", P(AXIS)),
    ("mlp.up_proj.bias", P(AXIS)),
    ("mlp.down_proj.weight", P(AXIS, None)),
    ("lm_head.weight", P(None, AXIS)),
)


def make_mesh(tensor_parallel: int) -> Mesh:
    devices = jax.devices()
    if tensor_parallel > len(devices):
        raise ValueError(f"tensor_parallel={tensor_parallel} but only {len(devices)} devices are visible")
    return Mesh(np.array(devices[:tensor_parallel]), (AXIS,))


def check_divisible(cfg: ModelConfig, tp: int) -> None:
    for name, value in (("num_key_value_heads", cfg.num_kv_heads), ("num_attention_heads", cfg.num_heads),
                        ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)):
        if value % tp:
            raise ValueError(f"tensor_parallel={tp} does not divide {name}={value}")


def param_sharding(name: str, mesh: Mesh) -> NamedSharding:
    """Sharding of the parameter with this Hugging Face name (replicated unless a rule splits it)."""
    for suffix, spec in RULES:
        if name.endswith(suffix):
            return NamedSharding(mesh, spec)
    return NamedSharding(mesh, P())


def kv_sharding(mesh: Mesh) -> NamedSharding:
    """KV pages [kv_heads, num_pages, page_size, head_dim] split by KV head."""
    return NamedSharding(mesh, P(AXIS, None, None, None))
