"""The compiled norm and rotary kernels (worker/engine/cpu_layer_ops.py) against the model's own
XLA modules and float64 numpy, and a model running them against transformers' forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from tests.hf_models import checkpoint  # noqa: F401 (a fixture)
from worker.engine import cpu_layer_ops, cpu_matmul
from worker.models.config import ModelConfig
from worker.models.llama import Embedding, RMSNorm, Rotary
from worker.models.loader import load_model
from worker.models.rope import apply_rope, rope_table


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_layer_ops.load(), "the CPU norm / rope kernels did not build (is a C++ compiler installed?)"


def _norm64(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


# hidden sizes a multiple of 64 and not (vector tails), one row and many (several work items), leading dims
@pytest.mark.parametrize("shape", [(1, 64), (64, 768), (37, 100), (3, 5, 40), (1030, 256), (2, 7)])
def test_rms_norm_and_the_add_before_it(shape):
    rng = np.random.default_rng(shape[0] * 7 + shape[-1])
    x, y = (rng.standard_normal(shape, dtype=np.float32) * 3 for _ in range(2))
    w = rng.standard_normal(shape[-1], dtype=np.float32)
    eps = 1e-5
    norm = jax.jit(lambda x, w: cpu_layer_ops.rms_norm(x, w, eps))(x, w)
    total, added = jax.jit(lambda x, y, w: cpu_layer_ops.add_rms_norm(x, y, w, eps))(x, y, w)
    assert norm.shape == added.shape == total.shape == shape
    np.testing.assert_allclose(np.asarray(norm), _norm64(x, w, eps), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(total), x + y)  # the add is exact
    np.testing.assert_allclose(np.asarray(added), _norm64(x + y, w, eps), rtol=1e-5, atol=1e-5)
    module = RMSNorm(shape[-1], eps, param_dtype=jnp.float32)
    module.weight[...] = jnp.asarray(w)
    kernel = cpu_layer_ops.KernelRMSNorm(module)
    np.testing.assert_allclose(np.asarray(kernel(jnp.asarray(x))), np.asarray(module(jnp.asarray(x))), rtol=2e-6,
                               atol=2e-6)
    ref_total, ref_added = module.add_norm(jnp.asarray(x), jnp.asarray(y))
    got_total, got_added = kernel.add_norm(jnp.asarray(x), jnp.asarray(y))
    np.testing.assert_array_equal(np.asarray(got_total), np.asarray(ref_total))
    np.testing.assert_allclose(np.asarray(got_added), np.asarray(ref_added), rtol=2e-6, atol=2e-6)


# head dims whose half is a multiple of 16 (the vector path: 32, 64, 128) and not (8, 40); q-like and
# k-like head counts; a batch dimension in front
@pytest.mark.parametrize("lead,heads,dim", [((64,), 12, 64), ((5,), 4, 32), ((1030,), 2, 128), ((3,), 3, 8),
                                            ((2, 9), 4, 40)])
def test_rope_equals_apply_rope(lead, heads, dim):
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=heads * dim, intermediate_size=8,
                      num_layers=1, num_heads=heads, num_kv_heads=heads, head_dim=dim, max_position_embeddings=4096)
    rng = np.random.default_rng(dim + heads)
    positions = jnp.asarray(rng.integers(0, 4000, lead), jnp.int32)
    x = jnp.asarray(rng.standard_normal((*lead, heads, dim), dtype=np.float32))
    table = rope_table(positions, cfg)
    got = np.asarray(jax.jit(cpu_layer_ops.rope)(x, table))
    ref = np.asarray(jax.jit(apply_rope)(x, table))
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    cos, sin = (np.asarray(t, np.float64) for t in table)
    xs = np.asarray(x, np.float64)
    swapped = np.concatenate([xs[..., dim // 2:], xs[..., : dim // 2]], axis=-1)
    np.testing.assert_allclose(got, xs * cos + swapped * sin, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(cpu_layer_ops.KernelRotary()(x, table)), np.asarray(Rotary()(x, table)),
                               rtol=1e-6, atol=1e-6)


def test_bad_shapes_are_refused():
    with pytest.raises(Exception, match="rms_norm"):
        jax.ffi.ffi_call(cpu_layer_ops.NORM, jax.ShapeDtypeStruct((2, 4), jnp.float32))(
            jnp.ones((2, 4)), jnp.ones((5,)), eps=np.float32(1e-5)).block_until_ready()
    with pytest.raises(Exception, match="rope"):
        jax.ffi.ffi_call(cpu_layer_ops.ROPE, jax.ShapeDtypeStruct((2, 1, 4), jnp.float32))(
            jnp.ones((2, 1, 4)), jnp.ones((3, 4)), jnp.ones((3, 4))).block_until_ready()


def test_a_model_on_the_kernels_matches_transformers(checkpoint):
    name, path, hf = checkpoint
    model = load_model(path)
    assert cpu_matmul.load()
    fast = cpu_layer_ops.with_kernels(cpu_matmul.pack_model(model))
    layer = fast.model.layers[0]
    assert isinstance(layer.input_layernorm, cpu_layer_ops.KernelRMSNorm)
    assert isinstance(layer.self_attn.rotary, cpu_layer_ops.KernelRotary)
    assert isinstance(fast.model.norm, cpu_layer_ops.KernelRMSNorm)
    if model.cfg.qk_norm:
        assert isinstance(layer.self_attn.q_norm, cpu_layer_ops.KernelRMSNorm)
    assert isinstance(model.model.layers[0].input_layernorm, RMSNorm)  # the original is unchanged
    tokens = np.random.default_rng(5).integers(0, model.cfg.vocab_size, (2, 13)).astype(np.int32)
    ours = np.asarray(jax.jit(lambda t: fast(t))(jnp.asarray(tokens)))  # [B, T, V]
    plain = np.asarray(jax.jit(lambda t: model(t))(jnp.asarray(tokens)))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() <= 1e-4 * scale, name
    assert np.abs(ours - plain).max() <= 1e-5 * scale, name


def test_a_bfloat16_model_on_the_kernels_matches_its_plain_self(checkpoint):
    """bfloat16 norm weights are widened exactly (the activations stay float32), so the kernels
    give the plain bfloat16 forward's answers; with bfloat16 products on the panel kernel where the
    CPU has AVX512-BF16, else on XLA."""
    name, path, _ = checkpoint
    model = load_model(path, "bfloat16")
    packed = cpu_matmul.pack_model(model) if cpu_matmul.load(jnp.bfloat16) else model
    fast = cpu_layer_ops.with_kernels(nnx.merge(*nnx.split(packed)))  # a copy: `model` stays plain
    assert isinstance(fast.model.layers[0].post_attention_layernorm, cpu_layer_ops.KernelRMSNorm)
    assert fast.model.norm.weight[...].dtype == jnp.bfloat16
    tokens = np.random.default_rng(6).integers(0, model.cfg.vocab_size, (2, 13)).astype(np.int32)
    # the embedding table as its bits: the same rows, and a loop over its rows (as fused decode steps
    # take them) never widens the whole table, as XLA's bfloat16 gather does
    embed = fast.model.embed_tokens
    assert isinstance(embed, cpu_layer_ops.BitsEmbedding) and isinstance(model.model.embed_tokens, Embedding)
    np.testing.assert_array_equal(np.asarray(embed(jnp.asarray(tokens))), np.asarray(model.model.embed_tokens(jnp.asarray(tokens))))
    table = f"f32[{model.cfg.vocab_size},{model.cfg.hidden_size}]"
    for module, widens in ((model.model.embed_tokens, True), (embed, False)):
        steps = jax.jit(lambda t, m=module: jax.lax.fori_loop(0, 2, lambda i, a: a + m(t + i).sum(), 0.0))
        assert (table in steps.lower(jnp.asarray(tokens)).compile().as_text()) == widens
    ours = np.asarray(jax.jit(lambda t: fast(t))(jnp.asarray(tokens)))
    plain = np.asarray(jax.jit(lambda t: model(t))(jnp.asarray(tokens)))
    # a sum in another order can round an activation to the neighbouring bfloat16 at the next product
    assert np.abs(ours - plain).max() <= 1e-2 * np.abs(plain).max(), name
