"""int4 projections (worker/engine/int4_linear.py, `--quantization int4`) against torchao, the
PyTorch quantization library whose 8da4w scheme they follow: the quantized weights and activations
equal torchao's, the VNNI kernel and the XLA path give torchao's products to float32 rounding, and
models and the engine give what transformers gives with torchao's
`Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4)` applied."""

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
from worker.engine import cpu_matmul, int4_linear
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.models.llama import Linear
from worker.models.loader import load_model

with warnings.catch_warnings():  # torchao warns that its CUDA extensions do not load on this CPU host
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
        _apply_int8_act_asym_per_token_quant_dequant,
    )
    logging.disable(logging.NOTSET)

VNNI = cpu_matmul.has_cpu_flag("avx512_vnni")


def torchao_config(group: int) -> Int8DynamicActivationIntxWeightConfig:
    return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group))


def torchao_linear(w: np.ndarray, group: int, bias: np.ndarray | None = None) -> torch.nn.Linear:
    """A torch Linear of our [in, out] weight, quantized by torchao."""
    linear = torch.nn.Linear(*w.shape, bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor(w.T))
        if bias is not None:
            linear.bias.copy_(torch.tensor(bias))
    holder = torch.nn.Sequential(linear)
    quantize_(holder, torchao_config(group))
    return holder[0]


def our_linear(w: np.ndarray, bias: np.ndarray | None, kernel: bool, group: int) -> int4_linear.Int4Linear:
    linear = Linear(*w.shape, bias is not None, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    linear.weight.set_value(jnp.asarray(w))
    if bias is not None:
        linear.bias.set_value(jnp.asarray(bias))
    return int4_linear.Int4Linear(linear, group, kernel)


def test_quantized_weights_and_activations_equal_torchaos():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 70), dtype=np.float32) * rng.uniform(0.01, 3, 70).astype(np.float32)
    w[:128, 5] = 0.0  # a zero group: the smallest scale
    w[7, 9] = -np.abs(w[:128, 9]).max() * 1.2  # the group's most negative value at -8
    theirs = torchao_linear(w, 128).weight
    q, scale = int4_linear.quantize_weight(w, 128)
    assert np.array_equal(q, theirs.qdata.numpy().T)
    assert np.array_equal(scale, theirs.scale.numpy().reshape(70, 2).T)
    assert q.min() == -8 and q.max() == 7
    x = rng.standard_normal((50, 256), dtype=np.float32) * rng.uniform(0.1, 30, (50, 1)).astype(np.float32)
    x[3], x[4], x[5] = 0.0, np.abs(x[4]), -np.abs(x[5])  # zero, all positive, all negative
    qx, sx, zx = jax.jit(int4_linear.quantize_rows)(jnp.asarray(x))
    ours = (np.asarray(qx) - np.asarray(zx)[:, None]) * np.asarray(sx)[:, None]  # as torchao dequantizes
    assert np.array_equal(ours, _apply_int8_act_asym_per_token_quant_dequant(torch.tensor(x)).numpy())
    assert np.asarray(qx).min() >= -128 and np.asarray(qx).max() <= 127


# rows around the 12-row tile and past a 96-row block; columns not a multiple of the 32-column
# panel; groups of 32, 64 and 128; K = 4096, where rows in place would share L1 sets
@pytest.mark.parametrize("m,k,n,group", [(1, 128, 32, 128), (5, 96, 33, 32), (13, 256, 97, 128), (64, 192, 512, 64),
                                         (200, 128, 70, 128), (11, 4096, 40, 128), (0, 64, 70, 64)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_kernel_and_xla_give_torchaos_products(m, k, n, group, with_bias):
    rng = np.random.default_rng(m * 1000 + k + n)
    w = rng.standard_normal((k, n), dtype=np.float32) * 0.1
    bias = rng.standard_normal(n, dtype=np.float32) if with_bias else None
    x = rng.standard_normal((m, k), dtype=np.float32) * 2 + 0.5  # not centred: the zero point matters
    layer = our_linear(w, bias, False, group)
    xla = np.asarray(jax.jit(lambda x: layer(x))(jnp.asarray(x)))
    assert xla.shape == (m, n)
    outputs = {"xla": xla}
    if VNNI:
        assert int4_linear.load()
        packed = our_linear(w, bias, True, group)
        outputs["kernel"] = np.asarray(jax.jit(lambda x: packed(x))(jnp.asarray(x)))
        assert outputs["kernel"].shape == (m, n)
    if m:  # (torchao's quantizer fails on an empty batch)
        with torch.no_grad():
            ref = torchao_linear(w, group, bias)(torch.tensor(x)).numpy()
        exact = x.astype(np.float64) @ w + (0 if bias is None else bias)
        for name, got in outputs.items():
            assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max() * max(1, k / 512), name
        assert np.abs(xla - exact).max() > 1e-2 * np.abs(ref).max()  # quantized: not the float product


def test_a_row_that_is_not_finite_gives_nan_and_leaves_the_others_alone():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 50), dtype=np.float32)
    x = rng.standard_normal((6, 64), dtype=np.float32)
    clean = np.asarray(our_linear(w, None, False, 32)(jnp.asarray(x)))
    x[2, 3], x[4, 0] = np.inf, np.nan
    for kernel in (False, True) if VNNI else (False,):
        layer = our_linear(w, None, kernel, 32)
        got = np.asarray(jax.jit(lambda x: layer(x))(jnp.asarray(x)))
        assert np.isnan(got[[2, 4]]).all()
        np.testing.assert_allclose(got[[0, 1, 3, 5]], clean[[0, 1, 3, 5]], rtol=1e-5, atol=1e-5)


def test_group_size_is_the_largest_that_divides_every_projection():
    assert int4_linear.group_size([768, 2048]) == 128
    assert int4_linear.group_size([64, 128]) == 64
    assert int4_linear.group_size([576, 1536]) == 64
    assert int4_linear.group_size([96]) == 32
    with pytest.raises(ValueError, match="divisible by 32"):
        int4_linear.group_size([100])


def torchao_model(hf, group: int):
    """A copy of the transformers model with torchao's 8da4w on every layer's projections (not the head)."""
    quantized = type(hf)(hf.config).eval()
    quantized.load_state_dict(hf.state_dict())
    quantize_(quantized, torchao_config(group),
              filter_fn=lambda module, name: isinstance(module, torch.nn.Linear) and "lm_head" not in name)
    return quantized


def test_quantized_models_match_torchao_transformers(checkpoint):
    # one token per sequence: every projection, norm and the head. As with int8, an activation a
    # float32 rounding apart from transformers' now and then lands on the other side of a step of its
    # int8 grid, which moves its row's logits; the other rows match torchao's to float32 rounding
    name, path, hf = checkpoint
    tokens = np.arange(0, hf.config.vocab_size, 8, dtype=np.int32)[:, None]  # [32, 1]
    model = load_model(path)
    group = int4_linear.model_group_size(model)
    with torch.no_grad():
        ref = torchao_model(hf, group)(torch.tensor(tokens, dtype=torch.long)).logits.numpy()[:, 0]  # [32, V]
        full = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()[:, 0]
    scale = np.abs(ref).max()
    for kernel in (False, True) if VNNI else (False,):
        model = int4_linear.quantize_model(load_model(path), kernel)
        assert isinstance(model.model.layers[1].mlp.down_proj, int4_linear.Int4Linear)
        assert model.lm_head is None or isinstance(model.lm_head, Linear)  # the head stays float
        ours = np.asarray(jax.jit(lambda t: model(t))(jnp.asarray(tokens)))[:, 0]
        exact = np.abs(ours - ref).max(axis=1) <= 1e-5 * scale  # [32]
        assert exact.sum() >= 8, (name, kernel, exact.sum())
        assert np.abs(ours - ref).max() <= 0.1 * scale, (name, kernel)
    assert (np.abs(full - ref).max(axis=1) > 1e-3 * scale).all()  # int4 moved every row this far


def test_engine_serves_int4_greedy_as_torchao_transformers(tmp_path, tokenizer):
    # batched, prompts in chunks beside decode rows, fused decode steps; every page back at the end
    hf = make_hf_model("llama", tmp_path, vocab_size=len(tokenizer))
    quantized = torchao_model(hf, int4_linear.model_group_size(load_model(tmp_path)))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, len(tokenizer), n).tolist() for n in (1, 6, 11, 24, 41)]
    want = [hf_greedy(quantized, p, 12) for p in prompts]
    sizes = dict(max_num_seqs=4, page_size=4, num_pages=40, max_num_batched_tokens=16, decode_steps=3)
    for matmul, how in (("auto", "kernel" if VNNI else "xla"), ("xla", "xla")):
        engine = LLMEngine(load_model(tmp_path), tokenizer, EngineConfig(quantization="int4", matmul=matmul, **sizes))
        assert engine.quantization == f"int4 ({how})"
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        got = drain(engine)
        tokens = [got[(f"r{i}", 0)].token_ids for i in range(len(prompts))]
        assert sum(a == b for a, b in zip(tokens, want)) >= 3, (matmul, tokens, want)
        assert engine.allocator.num_free_pages == engine.allocator.num_usable_pages


def test_bench_offline_reports_int4_against_its_own_roofline(tmp_path, monkeypatch):
    # against transformers with torchao's 8da4w, and its own roofline: the projections' weights half
    # a byte each and their group scales, at the int4 probe's speed
    from tests.bench_support import run_bench
    from worker.bench import hf_baseline, roofline
    from worker.models.config import ModelConfig

    baselines = []  # the transformers models the baseline ran, after torchao's quantization
    quantize = hf_baseline.quantize_torchao
    monkeypatch.setattr(hf_baseline, "quantize_torchao", lambda model, q: (quantize(model, q), baselines.append(model)))
    make_hf_model("llama", tmp_path)
    code, out = run_bench("offline", "--model", str(tmp_path), "--num-prompts", "4", "--input-len", "8",
                          "--output-len", "8", "--quantization", "int4", "--compare", "hf", "--json")
    report = json.loads(out)
    assert code == 0 and report["output_tokens"] == 4 * 8
    assert "torchao int4" in report["baseline"] and report["ratio"] > 0 and baselines
    for model in baselines:
        assert type(model.model.layers[1].mlp.down_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
        assert type(model.lm_head.weight).__name__ == "Parameter"  # the head stays float
    assert report["greedy_first_token_match_fraction"] >= 0.5
    assert report["quantization"] == f"int4 ({'kernel' if VNNI else 'xla'})"
    assert report["engine"]["quantization"] == "int4" and report["matmul_gflops_int8"] > 0
    cfg = ModelConfig.from_dir(tmp_path)
    batch, context = report["decode_mean_batch"], report["decode_mean_context"]
    itemsize = 0.5 + 4 / 64  # hidden 64, intermediate 128: groups of 64, a float32 scale each
    assert roofline.quantized_itemsize(report["quantization"], cfg) == itemsize
    memory = roofline.decode_step_bytes(cfg, 4, batch, context, 4, itemsize) / (report["memory_bandwidth_gbs"] * 1e9)
    assert report["decode_memory_step_ms"] == pytest.approx(memory * 1e3)


def test_demo_model_keeps_most_of_its_text_in_int4():
    # real weights: the shipped demo model, which has nearly memorized its book. With 4-bit weights it
    # still continues most chapter openings with the book's next sentence, and its perplexity over
    # book paragraphs stays within a few percent of float32's
    figures = {value: demo_text_figures(quantization=value) for value in (None, "int4")}
    assert figures["int4"][0] >= figures[None][0] - 3, figures
    assert figures["int4"][1] <= 1.05 * figures[None][1], figures
    assert figures["int4"][1] != figures[None][1]  # int4 ran: its logits are not float32's


def test_settings():
    assert EngineConfig(quantization="int4").quantization == "int4"
    with pytest.raises(ValueError, match="quantization must be int8, int4 or None"):
        EngineConfig(quantization="int3")
    assert not int4_linear.uses_kernel("xla", 1)
    assert int4_linear.uses_kernel("auto", 1) == VNNI
    if not VNNI:
        with pytest.raises(ValueError, match="AVX512-VNNI"):
            int4_linear.uses_kernel("kernel", 1)
    with pytest.raises(ValueError, match="AVX512-VNNI|tensor_parallel"):
        int4_linear.uses_kernel("kernel", 2)
