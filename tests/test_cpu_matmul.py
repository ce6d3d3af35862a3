"""The compiled panel-matmul kernel (worker/engine/cpu_matmul.py) against float64 numpy, and a model
with packed projections against transformers' forward of the same checkpoint."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.hf_models import ARCHITECTURES, make_hf_model
from worker.engine import cpu_matmul
from worker.engine.config import EngineConfig
from worker.models.llama import Linear
from worker.models.loader import load_model


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_matmul.load(), "the CPU matmul kernel did not build (is a C++ compiler installed?)"


# rows below, at and above the 12-row register tile, with a short remainder merged into the last
# full tile (13, 17, 25, 62, 64 rows) and not (18, 100); columns not a multiple of the 32-column
# panel; 64 panels and more: x copied into k-major tiles first (kPackPanels)
@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (5, 100, 33), (12, 7, 1), (13, 64, 97), (64, 256, 512), (100, 48, 200),
                                   (17, 30, 64), (18, 30, 64), (5, 16, 2048), (25, 33, 2081), (62, 40, 4096),
                                   (64, 24, 2048)])
def test_products_equal_float64_numpy(m, k, n):
    rng = np.random.default_rng(m * 1000 + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    panels = cpu_matmul.pack(jnp.asarray(w))
    assert panels.shape == (-(-n // cpu_matmul.PANEL), k, cpu_matmul.PANEL)
    got = np.asarray(jax.jit(lambda x, p: cpu_matmul.matmul(x, p, n))(jnp.asarray(x), panels))
    ref = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_leading_dimensions_and_an_empty_batch():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 70), dtype=np.float32)
    panels = cpu_matmul.pack(jnp.asarray(w))
    x = rng.standard_normal((2, 3, 40), dtype=np.float32)
    got = np.asarray(cpu_matmul.matmul(jnp.asarray(x), panels, 70))
    assert got.shape == (2, 3, 70)
    np.testing.assert_allclose(got, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)
    assert cpu_matmul.matmul(jnp.zeros((0, 40)), panels, 70).shape == (0, 70)


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, make_hf_model(request.param, path)


def test_packed_model_matches_transformers_and_leaves_the_original_alone(checkpoint):
    name, path, hf = checkpoint
    model = load_model(path)
    packed = cpu_matmul.pack_model(model)
    layer = packed.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, cpu_matmul.PanelLinear)
    assert isinstance(layer.mlp.down_proj, cpu_matmul.PanelLinear)
    assert isinstance(packed.lm_head, cpu_matmul.PanelLinear)  # tied heads get their own panels too
    assert isinstance(model.model.layers[0].self_attn.q_proj, Linear)  # the original is unchanged
    assert (model.lm_head is None) == model.cfg.tie_word_embeddings
    tokens = np.random.default_rng(3).integers(0, model.cfg.vocab_size, (2, 11)).astype(np.int32)
    ours = np.asarray(jax.jit(lambda t: packed(t))(jnp.asarray(tokens)))  # [B, T, V]
    unpacked = np.asarray(jax.jit(lambda t: model(t))(jnp.asarray(tokens)))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() <= 1e-4 * scale, name
    assert np.abs(ours - unpacked).max() <= 1e-5 * scale, name


def test_choice_of_matmul(tmp_path, monkeypatch):
    make_hf_model("llama", tmp_path)
    # float32 on the CPU backend: the kernel where its register tile fits (AVX-512)
    auto = "kernel" if cpu_matmul.has_avx512() else "xla"
    assert cpu_matmul.choose_matmul("auto", 1, load_model(tmp_path)) == auto
    monkeypatch.setattr(cpu_matmul, "has_avx512", lambda: False)
    assert cpu_matmul.choose_matmul("auto", 1, load_model(tmp_path)) == "xla"
    assert cpu_matmul.choose_matmul("kernel", 1, load_model(tmp_path)) == "kernel"  # asked for: runs anyway
    assert cpu_matmul.choose_matmul("xla", 1, load_model(tmp_path)) == "xla"
    bf16 = load_model(tmp_path, "bfloat16")
    assert cpu_matmul.choose_matmul("auto", 1, bf16) == "xla"  # bfloat16 products stay with XLA
    with pytest.raises(ValueError, match="float32 model"):
        cpu_matmul.choose_matmul("kernel", 1, bf16)
    with pytest.raises(ValueError, match="matmul must be"):
        EngineConfig(matmul="onednn")


@pytest.mark.parametrize("n", [200, 2100])  # x used in place, and copied into tiles
def test_a_row_comes_out_the_same_in_any_batch(n):
    # a request recomputed in a prefill chunk (resumed by another worker, or after preemption)
    # must continue exactly as its decode rows did: each output sums over K in one fixed order
    rng = np.random.default_rng(1)
    w = rng.standard_normal((256, n), dtype=np.float32)
    panels = cpu_matmul.pack(jnp.asarray(w))
    x = rng.standard_normal((100, 256), dtype=np.float32)
    full = np.asarray(cpu_matmul.matmul(jnp.asarray(x), panels, n))
    for lo, hi in ((0, 1), (7, 8), (3, 11), (50, 63), (88, 100)):
        part = np.asarray(cpu_matmul.matmul(jnp.asarray(x[lo:hi]), panels, n))
        assert np.array_equal(part, full[lo:hi]), (lo, hi)
