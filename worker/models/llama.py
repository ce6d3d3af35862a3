"""The Llama family in Flax (nnx): Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm).

Parameter names mirror Hugging Face (`model.layers.0.self_attn.q_proj.weight`), so checkpoint
loading is a near-identity name table. Projection weights are stored `[in_features,
out_features]` (Hugging Face saves `[out, in]`; the loader transposes once): `x @ W` with a
row-major `[in, out]` weight is the faster matmul for the few-row decode case.

The trunk is written once. How attention reads and writes keys/values is a function passed in
(`Attend`): the plain forward uses causal attention over the whole sequence, the serving path
(worker/engine) writes K/V into pages and attends through page tables.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from worker.models.config import ModelConfig
from worker.models.rope import apply_rope, rope_table

# attend(layer, q [..., H, D], k [..., KV, D], v [..., KV, D], cache) -> (out [..., H, D], new cache)
Attend = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]

weight_init = nnx.initializers.normal(0.02)  # projections and embeddings (the loader's dummy weights too)


class Linear(nnx.Module):
    def __init__(self, d_in: int, d_out: int, bias: bool, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(weight_init(rngs.params(), (d_in, d_out), param_dtype))  # [in, out]
        self.bias = nnx.Param(jnp.zeros((d_out,), param_dtype)) if bias else None  # [out]
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> f32[..., out]
        # Operands in the compute dtype, accumulated and returned in float32: activations between
        # projections stay float32 (a bfloat16 model multiplies in bfloat16 only). On CPU, bfloat16
        # products into a float32 accumulator are what XLA runs natively on AVX512-BF16, twice
        # float32's speed; a bfloat16 result or residual stream costs a conversion per op.
        y = jnp.einsum("...i,io->...o", x.astype(self.dtype), self.weight[...].astype(self.dtype),
                       preferred_element_type=jnp.float32)
        return y if self.bias is None else y + self.bias[...].astype(jnp.float32)


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, param_dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(weight_init(rngs.params(), (vocab, dim), param_dtype))  # [vocab, dim]

    def __call__(self, tokens: jax.Array) -> jax.Array:  # i32[...] -> f32[..., dim]
        return jnp.take(self.weight[...], tokens, axis=0).astype(jnp.float32)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))  # [dim]
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., dim], normalised in float32 like HF
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * x32.astype(x.dtype)

    def add_norm(self, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The residual add and the norm after it: (x + y, norm(x + y)), one kernel on the CPU path."""
        x = x + y
        return x, self(x)


class Rotary(nnx.Module):
    """Rotary position embeddings on q or k (a module so that the CPU path can swap in its kernel)."""

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:  # [..., T, heads, D]
        return apply_rope(x, rope)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = Linear(h, cfg.num_heads * d, cfg.qkv_bias, **kw)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, cfg.qkv_bias, **kw)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, cfg.qkv_bias, **kw)
        self.o_proj = Linear(cfg.num_heads * d, h, cfg.o_bias, **kw)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype=param_dtype)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.rotary = Rotary()
        self.cfg = cfg

    def __call__(self, layer: int, x: jax.Array, rope: tuple[jax.Array, jax.Array], attend: Attend, cache: Any,
                 rows: jax.Array | None = None):
        """x: [..., T, hidden], rope: rope_table(positions) -> ([..., T, hidden], cache).

        rows (i32[R], a flat x [T, hidden] only): queries and outputs for those rows alone, while
        keys and values still come from every row -> ([R, hidden], cache)."""
        cfg = self.cfg
        xq, rope_q = (x, rope) if rows is None else (x[rows], (rope[0][rows], rope[1][rows]))
        q = self.q_proj(xq).reshape(*xq.shape[:-1], cfg.num_heads, cfg.head_dim)  # [..., T|R, H, D]
        k = self.k_proj(x).reshape(*x.shape[:-1], cfg.num_kv_heads, cfg.head_dim)  # [..., T, KV, D]
        v = self.v_proj(x).reshape(*x.shape[:-1], cfg.num_kv_heads, cfg.head_dim)  # [..., T, KV, D]
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, rope_q), self.rotary(k, rope)
        out, cache = attend(layer, q, k, v, cache)  # [..., T|R, H, D]
        return self.o_proj(out.reshape(*xq.shape[:-1], cfg.num_heads * cfg.head_dim)), cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, **kw)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, **kw)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., hidden] -> [..., hidden]
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = Attention(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.mlp = MLP(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, layer: int, x: jax.Array, delta: jax.Array | None, rope: tuple[jax.Array, jax.Array],
                 attend: Attend, cache: Any, rows: jax.Array | None = None):
        """x: the residual stream [..., T, hidden]; delta: the last layer's MLP output, not yet added
        (None before the first layer), so that the add and this layer's norm run as one ->
        (residual stream, this layer's MLP output, cache); with rows, for those rows alone."""
        x, h = (x, self.input_layernorm(x)) if delta is None else self.input_layernorm.add_norm(x, delta)
        attn, cache = self.self_attn(layer, h, rope, attend, cache, rows)
        x, h = self.post_attention_layernorm.add_norm(x if rows is None else x[rows], attn)
        return x, self.mlp(h), cache


class LlamaModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List(
            [DecoderLayer(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs) for _ in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.dtype = dtype


class LlamaForCausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=None, rngs: nnx.Rngs):
        param_dtype = param_dtype or dtype
        self.cfg = cfg
        self.model = LlamaModel(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        # None when tied: the embedding table doubles as the head (worker.engine.cpu_matmul gives
        # a packed model a head of its own)
        self.lm_head = nnx.data(None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, False, dtype=dtype, param_dtype=param_dtype, rngs=rngs))

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Plain forward, the reference path: tokens i32[B, T] -> logits f32[B, T, vocab].

        Rows are causal and independent, so right-padded batches give exact logits for the
        real tokens of every row.
        """
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1], dtype=jnp.int32), tokens.shape)
        hidden, _ = self.trunk(tokens, positions, self._causal_attend, None)
        return self.logits(hidden)

    def trunk(self, tokens: jax.Array, positions: jax.Array, attend: Attend, cache: Any,
              out_rows: jax.Array | None = None):
        """tokens i32[..., T], positions i32[..., T] -> (final-normed hidden [..., T, hidden], cache).

        out_rows (i32[R], flat tokens [T] only): the hidden states of those rows alone -> [R, hidden].
        The last layer then writes keys and values for every row but runs its queries, output
        projection and MLP on those rows only; `attend` gets q [R, H, D] with k/v [T, KV, D] there.
        A prefill chunk needs only its last row's logits, so a step of long chunks skips most of
        one layer."""
        # the residual stream is float32 in every compute dtype
        x = self.model.embed_tokens(tokens)  # f32[..., T, hidden]
        rope = rope_table(positions, self.cfg)
        last, delta = len(self.model.layers) - 1, None
        for i, layer in enumerate(self.model.layers):
            x, delta, cache = layer(i, x, delta, rope, attend, cache, out_rows if i == last else None)
        return self.model.norm.add_norm(x, delta)[1], cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., hidden] -> logits f32[..., vocab]."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        dtype = self.model.dtype  # the compute dtype of the product
        weight = self.model.embed_tokens.weight[...].astype(dtype)  # tied: the table [vocab, hidden]
        return jnp.einsum("...h,vh->...v", hidden.astype(dtype), weight, preferred_element_type=jnp.float32)

    def _causal_attend(self, layer: int, q, k, v, cache):
        return causal_attention(q, k, v, self.cfg.window(layer)), cache


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None) -> jax.Array:
    """q [B, T, H, D], k/v [B, T, KV, D] -> [B, T, H, D]; key j visible to query i iff j <= i (and i - j < window)."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)  # [B, T, KV, G, D]
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(d).astype(jnp.float32)
    i = jnp.arange(t)[:, None]
    j = jnp.arange(t)[None, :]
    visible = j <= i
    if window is not None:
        visible &= (i - j) < window
    scores = jnp.where(visible, scores, -jnp.inf)  # [B, KV, G, T, T]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)
