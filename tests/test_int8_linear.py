"""int8 projections (worker/engine/int8_linear.py, `--quantization int8`) against torchao, the
PyTorch quantization library whose scheme they follow: the quantized weights and activations equal
torchao's, the VNNI kernel equals XLA's int8 dot bit for bit, and models and the engine give what
transformers gives with torchao's `Int8DynamicActivationInt8WeightConfig` applied."""

from __future__ import annotations

import json
import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from tests.engine_support import demo_text_figures, drain, hf_greedy, tokenizer  # noqa: F401 (a fixture)
from tests.hf_models import checkpoint, make_hf_model  # noqa: F401 (a fixture)
from worker.engine import cpu_matmul, int8_linear
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.models.llama import Linear
from worker.models.loader import load_model

with warnings.catch_warnings():  # torchao warns that its CUDA extensions do not load on this CPU host
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    from torchao.quantization.quantize_.common.quantize_tensor_kwargs import _choose_quant_func_and_quantize_tensor
    logging.disable(logging.NOTSET)

VNNI = cpu_matmul.has_cpu_flag("avx512_vnni")


def torchao_linear(w: np.ndarray, bias: np.ndarray | None = None) -> torch.nn.Linear:
    """A torch Linear of our [in, out] weight, quantized by torchao."""
    linear = torch.nn.Linear(*w.shape, bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor(w.T))
        if bias is not None:
            linear.bias.copy_(torch.tensor(bias))
    holder = torch.nn.Sequential(linear)
    quantize_(holder, Int8DynamicActivationInt8WeightConfig())
    return holder[0]


def our_linear(w: np.ndarray, bias: np.ndarray | None, kernel: bool) -> int8_linear.Int8Linear:
    linear = Linear(*w.shape, bias is not None, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    linear.weight.set_value(jnp.asarray(w))
    if bias is not None:
        linear.bias.set_value(jnp.asarray(bias))
    return int8_linear.Int8Linear(linear, kernel)


def test_quantized_weights_and_activations_equal_torchaos():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((300, 70), dtype=np.float32) * rng.uniform(0.01, 3, 70).astype(np.float32)
    w[:, 5] = 0.0  # a zero column: the smallest scale
    w[7, 9] = -np.abs(w[:, 9]).max() * 1.5  # the most negative value at -128
    theirs = torchao_linear(w).weight
    q, scale = int8_linear.quantize(jnp.asarray(w), axis=0)
    assert np.array_equal(np.asarray(q), theirs.qdata.numpy().T)
    assert np.array_equal(np.asarray(scale), theirs.scale.numpy().ravel())
    assert np.asarray(q).min() == -128
    x = rng.standard_normal((50, 300), dtype=np.float32) * rng.uniform(0.1, 30, (50, 1)).astype(np.float32)
    x[3] = 0.0
    act = _choose_quant_func_and_quantize_tensor(torch.tensor(x), theirs.act_quant_kwargs)
    qx, sx = jax.jit(lambda x: int8_linear.quantize(x, axis=1))(jnp.asarray(x))
    assert np.array_equal(np.asarray(qx), act.qdata.numpy())
    assert np.array_equal(np.asarray(sx), act.scale.numpy().ravel())


# rows around the 12-row tile and past 16 tiles (row blocks); K not a multiple of 4 (zero padding);
# columns not a multiple of the 32-column panel; many panels (x copied into k-major tiles)
@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (5, 101, 33), (13, 64, 97), (64, 256, 512), (200, 48, 70),
                                   (62, 2048, 200), (7, 40, 2081), (0, 40, 70)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_kernel_equals_xla_bit_for_bit_and_torchao_to_rounding(m, k, n, with_bias):
    rng = np.random.default_rng(m * 1000 + k + n)
    w = rng.standard_normal((k, n), dtype=np.float32) * 0.1
    bias = rng.standard_normal(n, dtype=np.float32) if with_bias else None
    x = rng.standard_normal((m, k), dtype=np.float32) * 2
    layer = our_linear(w, bias, False)
    xla = np.asarray(jax.jit(lambda x: layer(x))(jnp.asarray(x)))
    if VNNI:
        assert int8_linear.load()
        packed = our_linear(w, bias, True)
        kernel = np.asarray(jax.jit(lambda x: packed(x))(jnp.asarray(x)))
        if bias is None:
            assert np.array_equal(kernel, xla)
        else:  # XLA may add the bias in a fused multiply-add
            np.testing.assert_allclose(kernel, xla, rtol=1e-6, atol=1e-6)
    assert xla.shape == (m, n)
    if m:  # (torchao's quantizer fails on an empty batch)
        with torch.no_grad():
            ref = torchao_linear(w, bias)(torch.tensor(x)).numpy()
        exact = x.astype(np.float64) @ w + (0 if bias is None else bias)
        assert np.abs(xla - ref).max() <= 1e-5 * np.abs(ref).max()
        assert np.abs(xla - exact).max() > 1e-3 * np.abs(ref).max()  # quantized: not the float product


def test_a_row_that_is_not_finite_gives_nan_and_leaves_the_others_alone():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((40, 50), dtype=np.float32)
    x = rng.standard_normal((6, 40), dtype=np.float32)
    clean = np.asarray(our_linear(w, None, False)(jnp.asarray(x)))
    x[2, 3], x[4, 0] = np.inf, np.nan
    for kernel in (False, True) if VNNI else (False,):
        layer = our_linear(w, None, kernel)
        got = np.asarray(jax.jit(lambda x: layer(x))(jnp.asarray(x)))
        assert np.isnan(got[[2, 4]]).all()
        assert np.array_equal(got[[0, 1, 3, 5]], clean[[0, 1, 3, 5]])


def torchao_model(hf):
    """A copy of the transformers model with torchao's int8 on every layer's projections (not the head)."""
    quantized = type(hf)(hf.config).eval()
    quantized.load_state_dict(hf.state_dict())
    quantize_(quantized, Int8DynamicActivationInt8WeightConfig(),
              filter_fn=lambda module, name: isinstance(module, torch.nn.Linear) and "lm_head" not in name)
    return quantized


def test_quantized_models_match_torchao_transformers(checkpoint):
    # one token per sequence: every projection, norm and the head. Sums in another order (the norms,
    # SiLU) leave an activation a float32 rounding apart from transformers', which now and then puts
    # it on the other side of a rounding boundary of its int8 grid: one step, 1/127 of its row's
    # largest value, moves that row's logits by up to a few percent. The rows without such a step
    # match torchao's to float32 rounding; with another scheme (scales of max / 127, one scale per
    # tensor, a float activation) none would.
    name, path, hf = checkpoint
    tokens = np.arange(0, hf.config.vocab_size, 8, dtype=np.int32)[:, None]  # [32, 1]
    with torch.no_grad():
        ref = torchao_model(hf)(torch.tensor(tokens, dtype=torch.long)).logits.numpy()[:, 0]  # [32, V]
        full = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()[:, 0]
    scale = np.abs(ref).max()
    for kernel in (False, True) if VNNI else (False,):
        model = int8_linear.quantize_model(load_model(path), kernel)
        assert isinstance(model.model.layers[1].mlp.down_proj, int8_linear.Int8Linear)
        assert model.lm_head is None or isinstance(model.lm_head, Linear)  # the head stays float
        ours = np.asarray(jax.jit(lambda t: model(t))(jnp.asarray(tokens)))[:, 0]
        exact = np.abs(ours - ref).max(axis=1) <= 1e-5 * scale  # [32]
        assert exact.sum() >= 8, (name, kernel, exact.sum())
        assert np.abs(ours - ref).max() <= 0.1 * scale, (name, kernel)
    assert (np.abs(full - ref).max(axis=1) > 1e-3 * scale).all()  # int8 moved every row this far


def test_engine_serves_int8_greedy_as_torchao_transformers(tmp_path, tokenizer):
    # batched, prompts in chunks beside decode rows, fused decode steps; every page back at the end.
    # Both paths give transformers-with-torchao's tokens for most prompts: a prompt can meet a
    # rounding-boundary step (above) where its top logits are close, and the two paths can too, as
    # XLA compiles the norms before a product differently with the kernel than with its own dot
    hf = make_hf_model("llama", tmp_path, vocab_size=len(tokenizer))
    quantized = torchao_model(hf)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, len(tokenizer), n).tolist() for n in (1, 6, 11, 24, 41)]
    want = [hf_greedy(quantized, p, 12) for p in prompts]
    sizes = dict(max_num_seqs=4, page_size=4, num_pages=40, max_num_batched_tokens=16, decode_steps=3)
    for matmul, how in (("auto", "kernel" if VNNI else "xla"), ("xla", "xla")):
        engine = LLMEngine(load_model(tmp_path), tokenizer, EngineConfig(quantization="int8", matmul=matmul, **sizes))
        assert engine.quantization == f"int8 ({how})"
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        got = drain(engine)
        tokens = [got[(f"r{i}", 0)].token_ids for i in range(len(prompts))]
        assert sum(a == b for a, b in zip(tokens, want)) >= 3, (matmul, tokens, want)
        assert engine.allocator.num_free_pages == engine.allocator.num_usable_pages


def test_settings():
    with pytest.raises(ValueError, match="quantization must be int8"):
        EngineConfig(quantization="int2")
    assert not int8_linear.uses_kernel("xla", 1)
    assert int8_linear.uses_kernel("auto", 1) == VNNI
    if not VNNI:
        with pytest.raises(ValueError, match="AVX512-VNNI"):
            int8_linear.uses_kernel("kernel", 1)
    with pytest.raises(ValueError, match="AVX512-VNNI"):
        int8_linear.uses_kernel("kernel", 2)


def test_bench_offline_reports_int8_against_its_own_roofline(tmp_path, monkeypatch):
    # against transformers with torchao's int8, and its own roofline: the projections' weights a byte each at the int8 probe's speed, the head and attention as before
    from tests.bench_support import run_bench
    from worker.bench import roofline
    from worker.models.config import ModelConfig

    from worker.bench import hf_baseline

    baselines = []  # the transformers models the baseline ran, after torchao's quantization
    quantize = hf_baseline.quantize_torchao
    monkeypatch.setattr(hf_baseline, "quantize_torchao", lambda model, q: (quantize(model, q), baselines.append(model)))
    make_hf_model("llama", tmp_path)
    code, out = run_bench("offline", "--model", str(tmp_path), "--num-prompts", "4", "--input-len", "8",
                          "--output-len", "8", "--quantization", "int8", "--compare", "hf", "--json")
    report = json.loads(out)
    assert code == 0 and report["output_tokens"] == 4 * 8
    # the baseline runs the same int8 model: transformers with torchao's quantization
    assert "torchao int8" in report["baseline"] and report["ratio"] > 0 and baselines
    for model in baselines:
        assert type(model.model.layers[1].mlp.down_proj.weight).__name__ == "Int8Tensor"
        assert type(model.lm_head.weight).__name__ != "Int8Tensor"  # the head stays float
    assert report["greedy_first_token_match_fraction"] >= 0.5
    assert report["quantization"] == f"int8 ({'kernel' if VNNI else 'xla'})"
    assert report["engine"]["quantization"] == "int8" and report["matmul_gflops_int8"] > 0
    cfg = ModelConfig.from_dir(tmp_path)
    batch, context = report["decode_mean_batch"], report["decode_mean_context"]
    memory = roofline.decode_step_bytes(cfg, 4, batch, context, 4, 1) / (report["memory_bandwidth_gbs"] * 1e9)
    assert report["decode_memory_step_ms"] == pytest.approx(memory * 1e3)
    compute = (roofline.product_s(cfg, batch, report["matmul_gflops"], report["matmul_gflops_int8"])
               + batch * roofline.attention_flops(cfg, context) / (report["matmul_gflops"] * 1e9))
    assert report["decode_compute_step_ms"] == pytest.approx(compute * 1e3)
    ideal = roofline.prefill_token_s(cfg, report["prefill_mean_context"], report["matmul_gflops"], report["matmul_gflops_int8"])
    assert report["prefill_ideal_token_us"] == pytest.approx(ideal * 1e6)


def test_demo_model_keeps_its_text_in_int8():
    # real weights: the shipped demo model, which has nearly memorized its book. In int8 it still
    # continues chapter openings with the book's next sentence, and its perplexity over book
    # paragraphs (prompt logprobs) stays within a percent of float32's (all 53 passages and 200
    # paragraphs, session 66: 50 of 53 against 51, perplexity 1.0918 against 1.0914)
    figures = {value: demo_text_figures(quantization=value) for value in (None, "int8")}
    assert figures["int8"][0] >= figures[None][0] - 1 >= 12 - 2, figures
    assert figures["int8"][1] <= 1.01 * figures[None][1], figures
    assert figures["int8"][1] != figures[None][1]  # int8 ran: its logits are not float32's
