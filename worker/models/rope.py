"""Rotary position embeddings (Hugging Face `rotate_half` layout), with llama3 and linear scaling."""

from __future__ import annotations

import math

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


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: jnp.ndarray) -> jnp.ndarray:
    """x: [..., T, heads, head_dim], positions: i32[..., T] -> same shape as x."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [..., T, head_dim // 2]
    cos = jnp.cos(angles)[..., None, :]  # [..., T, 1, head_dim // 2]
    sin = jnp.sin(angles)[..., None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
