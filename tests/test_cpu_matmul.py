"""The compiled panel-matmul kernel (worker/engine/cpu_matmul.py) against float64 numpy (float32
weights) and XLA's bfloat16 product (bfloat16 weights), and models with packed projections against
transformers' forward of the same checkpoint and against their unpacked selves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.engine_support import drain, tokenizer  # noqa: F401 (a fixture)
from tests.hf_models import checkpoint, make_hf_model  # noqa: F401 (a fixture)
from worker.engine import cpu_matmul
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.models.llama import Linear
from worker.models.loader import load_model


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_matmul.load(), "the CPU matmul kernel did not build (is a C++ compiler installed?)"


# rows below, at and above the 12-row register tile, with a short remainder merged into the last
# full tile (13, 17, 25, 62, 64 rows) and not (18, 100); columns not a multiple of the 32-column
# panel; 64 panels and more: x copied into k-major tiles first (kPackPanels); 16 row tiles and more
# (prefill): work items by row blocks, the last block short (193, 300, 931 rows), x in place and copied;
# rows 4 KB apart (K = 1024, 2048): copied from tiles of 11 rows on (11, 12, 62, 193 rows), not in
# tiles of 10 or 8 (10, 16 rows)
@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (5, 100, 33), (12, 7, 1), (13, 64, 97), (64, 256, 512), (100, 48, 200),
                                   (17, 30, 64), (18, 30, 64), (5, 16, 2048), (25, 33, 2081), (62, 40, 4096),
                                   (64, 24, 2048), (193, 48, 200), (300, 40, 2081), (931, 64, 97),
                                   (10, 1024, 97), (11, 1024, 97), (12, 2048, 64), (16, 1024, 33), (62, 2048, 200),
                                   (193, 1024, 70)])
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
    auto = "kernel" if cpu_matmul.has_cpu_flag("avx512f") else "xla"
    assert cpu_matmul.choose_matmul("auto", 1, load_model(tmp_path)) == auto
    bf16 = load_model(tmp_path, "bfloat16")
    # bfloat16: the kernel where the CPU multiplies bfloat16 pairs (AVX512-BF16), else XLA
    assert cpu_matmul.choose_matmul("auto", 1, bf16) == ("kernel" if BF16_KERNEL else "xla")
    if not BF16_KERNEL:
        with pytest.raises(RuntimeError, match="bfloat16"):
            cpu_matmul.choose_matmul("kernel", 1, bf16)
    mixed = load_model(tmp_path)
    mixed.model.layers[0].mlp.down_proj.dtype = jnp.bfloat16  # float32 weights, one bfloat16 product
    assert cpu_matmul.kernel_dtype(mixed) is None
    with pytest.raises(ValueError, match="float32 or bfloat16 model"):
        cpu_matmul.choose_matmul("kernel", 1, mixed)
    if BF16_KERNEL:  # a CPU with AMX whose OS refuses the tile state: XLA, not the slower AVX-512 kernel
        with monkeypatch.context() as patch:
            patch.setattr(cpu_matmul, "has_cpu_flag", lambda flag: True)
            patch.setattr(cpu_matmul, "amx", lambda: False)
            assert cpu_matmul.choose_matmul("auto", 1, bf16) == "xla"
            assert cpu_matmul.choose_matmul("kernel", 1, bf16) == "kernel"  # asked for: runs anyway
    monkeypatch.setattr(cpu_matmul, "has_cpu_flag", lambda flag: False)
    assert cpu_matmul.choose_matmul("auto", 1, load_model(tmp_path)) == "xla"
    assert cpu_matmul.choose_matmul("kernel", 1, load_model(tmp_path)) == "kernel"  # asked for: runs anyway
    assert cpu_matmul.choose_matmul("xla", 1, load_model(tmp_path)) == "xla"
    with pytest.raises(ValueError, match="matmul must be"):
        EngineConfig(matmul="onednn")


BF16_KERNEL = cpu_matmul.has_cpu_flag("avx512_bf16")  # this CPU multiplies bfloat16 pairs


def test_bfloat16_kernel_builds_exactly_where_the_cpu_has_the_instructions():
    assert cpu_matmul.load(jnp.bfloat16) == BF16_KERNEL


# odd K (a zero k pads the last pair), N not a multiple of the panel, rows around the tile; pairs
# 4 KB apart (K = 2048, 4096, 4095): rounded tile by tile into the copied tiles
@pytest.mark.parametrize("m,k,n", [(1, 40, 70), (5, 41, 33), (13, 257, 97), (64, 768, 256), (100, 48, 2081),
                                   (0, 40, 70), (250, 41, 200), (193, 48, 2081), (10, 2048, 97), (12, 2048, 97),
                                   (62, 4095, 64), (193, 4096, 33)])
def test_bfloat16_products_equal_xlas(m, k, n):
    if not BF16_KERNEL:  # no kernel to hold to XLA: the engine keeps XLA's products
        assert not cpu_matmul.load(jnp.bfloat16)
        return
    assert cpu_matmul.load(jnp.bfloat16)
    rng = np.random.default_rng(m * 1000 + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    panels = cpu_matmul.pack(w)
    assert panels.shape == (-(-n // cpu_matmul.PANEL), -(-k // 2), 2 * cpu_matmul.PANEL) and panels.dtype == w.dtype
    got = np.asarray(jax.jit(lambda x, p: cpu_matmul.matmul(x, p, n))(x, panels))
    # what Linear computes: x rounded to bfloat16, products summed in float32
    ref = np.asarray(jnp.einsum("mk,kn->mn", x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32))
    exact = np.asarray(x.astype(jnp.bfloat16)).astype(np.float64) @ np.asarray(w).astype(np.float64)
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    # rounding x is part of the product: the float32 x would give another answer
    if m:
        assert np.abs(got - np.asarray(x, np.float64) @ np.asarray(w).astype(np.float64)).max() > 1e-3


AMX = BF16_KERNEL and cpu_matmul.has_cpu_flag("amx_bf16")  # this CPU has AMX tiles for bfloat16


# K a multiple of 32 (AMX) and not (the AVX-512 kernel takes it); rows past and inside a 32-row
# block; N not a multiple of the panel; one row (batch-1 decode); rows past a group of 256 (a work
# item's rows: the last group here holds 2 blocks, the last one part-filled)
@pytest.mark.parametrize("m,k,n", [(1, 32, 32), (5, 64, 33), (31, 96, 64), (33, 2048, 97), (64, 768, 2081),
                                   (100, 256, 70), (300, 64, 70), (7, 40, 64), (0, 64, 32)])
def test_amx_products_where_the_cpu_has_amx(m, k, n):
    assert cpu_matmul.amx() == AMX
    if not BF16_KERNEL:  # no bfloat16 kernel of either kind: XLA's products
        return
    assert cpu_matmul.load(jnp.bfloat16)
    rng = np.random.default_rng(m + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    product = jax.jit(lambda x, p: cpu_matmul.matmul(x, p, n))
    panels = cpu_matmul.pack(w)
    assert (cpu_matmul.AMX_TARGET in product.lower(x, panels).as_text()) == (AMX and k % cpu_matmul.AMX_K == 0)
    got = np.asarray(product(x, panels))
    exact = np.asarray(x.astype(jnp.bfloat16)).astype(np.float64) @ np.asarray(w).astype(np.float64)
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_packed_bfloat16_model_matches_its_unpacked_self(checkpoint):
    name, path, _ = checkpoint
    model = load_model(path, "bfloat16")
    if not BF16_KERNEL:
        assert cpu_matmul.choose_matmul("auto", 1, model) == "xla"
        return
    assert cpu_matmul.load(jnp.bfloat16)
    packed = cpu_matmul.pack_model(model)
    assert isinstance(packed.model.layers[0].mlp.up_proj, cpu_matmul.PanelLinear)
    assert packed.model.layers[0].mlp.up_proj.panels[...].dtype == jnp.bfloat16
    assert isinstance(packed.lm_head, cpu_matmul.PanelLinear)
    tokens = np.random.default_rng(4).integers(0, model.cfg.vocab_size, (2, 11)).astype(np.int32)
    ours = np.asarray(jax.jit(lambda t: packed(t))(jnp.asarray(tokens)))
    unpacked = np.asarray(jax.jit(lambda t: model(t))(jnp.asarray(tokens)))
    assert np.abs(ours - unpacked).max() <= 1e-4 * np.abs(unpacked).max(), name


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("k,n", [(256, 200), (256, 2100), (2048, 200)])  # x in place; copied: many panels, rows 4 KB apart
def test_a_row_comes_out_the_same_in_any_batch(k, n, dtype):
    # a request recomputed in a prefill chunk (resumed by another worker, or after preemption)
    # must continue exactly as its decode rows did: each output sums over K in one fixed order
    rng = np.random.default_rng(1)
    w = rng.standard_normal((k, n), dtype=np.float32)
    if not cpu_matmul.load(dtype):  # bfloat16 weights without AVX512-BF16: XLA's products
        assert dtype == jnp.bfloat16 and not BF16_KERNEL
        return
    panels = cpu_matmul.pack(jnp.asarray(w, dtype))
    x = rng.standard_normal((300, k), dtype=np.float32)  # by row blocks; the parts below by panels
    full = np.asarray(cpu_matmul.matmul(jnp.asarray(x), panels, n))
    for lo, hi in ((0, 1), (7, 8), (3, 11), (50, 63), (88, 100), (100, 300)):
        part = np.asarray(cpu_matmul.matmul(jnp.asarray(x[lo:hi]), panels, n))
        assert np.array_equal(part, full[lo:hi]), (lo, hi)


def test_a_handler_missing_from_the_build_leaves_the_xla_path(caplog):
    # PanelMatmulBf16 is compiled only where the compiler targets AVX512-BF16: asking for a handler
    # the library lacks must say so and return False, not raise
    from worker.engine import cpu_build

    assert not cpu_build.register("panel_matmul.cc", "PanelMatmulNoSuchHandler", "redjax_missing_handler")
    assert "PanelMatmulNoSuchHandler" in caplog.text


def test_bfloat16_model_runs_its_products_on_the_kernel_where_the_cpu_has_it(tmp_path, tokenizer):
    """A bfloat16 model's products run on the packed bfloat16 kernel where the CPU multiplies
    bfloat16 pairs (AVX512-BF16; on AMX tiles where it has them, as every K of this model is a
    multiple of 32), and give XLA's bfloat16 products' answers: the same greedy tokens,
    and logprobs within bfloat16 rounding (sums in another order can round an activation to the
    next bfloat16 at a later product), batched and fused."""
    make_hf_model("qwen2", tmp_path, vocab_size=len(tokenizer))
    bf16 = load_model(tmp_path, "bfloat16")
    sizes = dict(max_num_seqs=8, page_size=4, num_pages=20, max_num_batched_tokens=16, decode_steps=4)
    kernel = LLMEngine(bf16, tokenizer, EngineConfig(**sizes))
    xla = LLMEngine(bf16, tokenizer, EngineConfig(**sizes, matmul="xla"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, len(tokenizer), n).tolist() for n in (1, 3, 6, 11, 17, 24, 30, 41)]
    assert kernel.matmul == ("kernel" if cpu_matmul.has_cpu_flag("avx512_bf16") else "xla") and xla.matmul == "xla"
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    results = []
    for engine in (kernel, xla):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        results.append(drain(engine))
    assert kernel.allocator.num_free_pages == xla.allocator.num_free_pages
    for key, got in results[0].items():
        ref = results[1][key]
        assert got.token_ids == ref.token_ids, key
        np.testing.assert_allclose([e["logprob"] for e in got.logprobs], [e["logprob"] for e in ref.logprobs],
                                   atol=1e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_the_kernel_refuses_inconsistent_shapes(dtype):
    if not cpu_matmul.load(dtype):  # bfloat16 weights without AVX512-BF16: no kernel to call
        assert dtype == jnp.bfloat16 and not BF16_KERNEL
        return
    target = cpu_matmul.TARGETS[jnp.dtype(dtype)]
    panels = cpu_matmul.pack(jnp.ones((40, 70), dtype))
    def call(x, w, n):
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(x, w)

    assert call(jnp.ones((3, 40)), panels, 70).shape == (3, 70)
    with pytest.raises(Exception, match="inconsistent shapes"):
        call(jnp.ones((3, 41 if dtype == jnp.float32 else 42)), panels, 70).block_until_ready()  # another K
    with pytest.raises(Exception, match="inconsistent shapes"):
        call(jnp.ones((3, 40)), panels, 100).block_until_ready()  # more columns than the panels hold
    with pytest.raises(Exception, match="expected x"):
        call(jnp.ones((3, 4, 40)), panels, 70).block_until_ready()
