"""Rotary position embeddings (Hugging Face `rotate_half` layout), with llama3 and linear scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from worker.models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """f32[head_dim // 2]: per-pair rotation speed, scaled as the config's rope_scaling says."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = dict(cfg.rope_scaling)
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        inv = _llama3(inv, scaling)
    return inv.astype(np.float32)


def _llama3(inv: np.ndarray, s: dict) -> np.ndarray:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled)


def rope_table(positions: jnp.ndarray, cfg: ModelConfig) -> tuple[jnp.ndarray, jnp.ndarray]:
    """positions i32[..., T] -> (cos, signed sin), each f32[..., T, 1, head_dim], computed once per
    forward and shared by every layer's q and k: `apply_rope` is then x * cos + swap(x) * sin."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inverse_frequencies(cfg))  # [..., T, head_dim // 2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    table = jnp.concatenate([cos, cos], axis=-1)[..., None, :], jnp.concatenate([-sin, sin], axis=-1)[..., None, :]
    # the barrier keeps the table materialized: without it XLA fuses sin and cos back into every
    # rotation, recomputed for each head of each layer (4-5 % of a CPU decode step, 12 layers)
    return jax.lax.optimization_barrier(table)


def apply_rope(x: jnp.ndarray, rope: tuple[jnp.ndarray, jnp.ndarray]) -> jnp.ndarray:
    """x: [..., T, heads, head_dim], rope: rope_table(positions) -> same shape as x.

    Hugging Face's rotate_half: out = x * cos + concat(-x2, x1) * sin, written with the halves
    swapped by a reverse (the sign is in the table) so the fusion is plain elementwise code."""
    cos, sin = rope
    x32 = x.astype(jnp.float32)
    halves = x32.reshape(*x.shape[:-1], 2, x.shape[-1] // 2)  # [..., 2, head_dim // 2]
    swapped = jnp.flip(halves, axis=-2).reshape(x.shape)  # (x2, x1)
    return (x32 * cos + swapped * sin).astype(x.dtype)
