"""int8 KV pages (worker/engine/kv_quant.py, `kv_cache_dtype="int8"`): the quantization against
torchao's per-token int8, the jnp reference and the compiled CPU kernel (decode, prefill, packed
rows, page writes) against attention over the dequantized pages, and the engine against
transformers whose cache holds what int8 pages hold."""

from __future__ import annotations

import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DynamicCache

from tests.engine_support import demo_text_figures, drain, tokenizer  # noqa: F401 (a fixture)
from tests.hf_models import make_hf_model
from tests.test_cpu_attention import packed_rows
from tests.test_paged_attention import KERNEL_SHAPES
from worker.engine import cpu_attention, kv_quant
from worker.engine import paged_attention as pa
from worker.engine.config import EngineConfig
from worker.engine.kv_quant import QuantizedPages
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.models.loader import load_model

with warnings.catch_warnings():  # torchao warns that its CUDA extensions do not load on this CPU host
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    from torchao.quantization.quantize_.common.quantize_tensor_kwargs import _choose_quant_func_and_quantize_tensor
    logging.disable(logging.NOTSET)

paged_attention = jax.jit(pa.paged_attention, static_argnames="window")


def torchao_per_token():
    """torchao's int8 dynamic activation quantization (per row, symmetric), as its W8A8 linear applies it."""
    holder = torch.nn.Sequential(torch.nn.Linear(16, 16))
    quantize_(holder, Int8DynamicActivationInt8WeightConfig())
    kwargs = holder[0].weight.act_quant_kwargs
    return lambda x: _choose_quant_func_and_quantize_tensor(x, kwargs)


def int8_pages(rng, kv, n, d, ps):
    """Random int8 key and value pages with scales, and the same pages dequantized (float32)."""
    kd = rng.integers(-128, 128, (kv, n, d, ps), dtype=np.int8)
    vd = rng.integers(-128, 128, (kv, n, ps, d), dtype=np.int8)
    ks = rng.uniform(0.002, 0.03, (kv, n, ps)).astype(np.float32)
    vs = rng.uniform(0.002, 0.03, (kv, n, ps)).astype(np.float32)
    quantized = QuantizedPages(jnp.asarray(kd), jnp.asarray(ks)), QuantizedPages(jnp.asarray(vd), jnp.asarray(vs))
    return quantized, (jnp.asarray(kd * ks[:, :, None, :]), jnp.asarray(vd * vs[..., None]))


def test_tokens_quantize_as_torchaos_per_token_int8():
    # one scale per (token, KV head) over the head dimension: torchao's per-row scheme, bit for bit
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 4, 64), dtype=np.float32) * rng.uniform(0.01, 40, (9, 4, 1)).astype(np.float32)
    x[2, 1] = 0.0
    q, scale = jax.jit(kv_quant.quantize_tokens)(jnp.asarray(x))
    theirs = torchao_per_token()(torch.tensor(x.reshape(36, 64)))
    assert q.dtype == jnp.int8 and q.shape == (9, 4, 64) and scale.shape == (9, 4)
    assert np.array_equal(np.asarray(q).reshape(36, 64), theirs.qdata.numpy())
    assert np.array_equal(np.asarray(scale).ravel(), theirs.scale.numpy().ravel())
    back = np.asarray(q, np.float32) * np.asarray(scale)[..., None]
    assert (np.abs(back - x) <= 0.5 * np.asarray(scale)[..., None] * (1 + 1e-4)).all()  # the largest: 127.5 steps


@pytest.mark.parametrize("window", [None, 5])
def test_reference_attends_over_the_dequantized_pages(window):
    rng = np.random.default_rng(1)
    (kq, vq), (kf, vf) = int8_pages(rng, 2, 24, 16, 8)
    tables = jnp.asarray(rng.permutation(24)[:20].reshape(4, 5), jnp.int32)
    ctx = jnp.asarray([1, 9, 23, 40], jnp.int32)
    q = jnp.asarray(rng.normal(size=(4, 4, 16)), jnp.float32)
    want = paged_attention(q[:, None], kf, vf, tables, (ctx - 1)[:, None], ctx, window)[:, 0]
    got = paged_attention(q[:, None], kq, vq, tables, (ctx - 1)[:, None], ctx, window)[:, 0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)
    blocked = jax.jit(pa.paged_decode_attention, static_argnames=("window", "pages_per_block"))
    for block in (1, 5):
        np.testing.assert_allclose(np.asarray(blocked(q, kq, vq, tables, ctx - 1, ctx, window, block)),
                                   np.asarray(want), atol=1e-5, rtol=1e-5)


def kernel_ready():
    assert cpu_attention.load(), "the CPU kernel did not build (is a C++ compiler installed?)"


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 2), (8, 2), (16, 2)], ids=["g2", "g3", "g4", "g8"])
@pytest.mark.parametrize("shape", KERNEL_SHAPES)
@pytest.mark.parametrize("window", [None, 3, 21])
def test_kernel_decode_on_int8_pages_matches_the_reference(window, shape, heads, kv_heads):
    # scales applied to each page's scores and probabilities, on the plain loops (page size 4),
    # the vector paths and whole 64-key pages; contexts on and off page boundaries, and positions
    # short of the context (later keys already written must not be seen)
    kernel_ready()
    ps, d = KERNEL_SHAPES[shape]
    rng = np.random.default_rng(2)
    (kq, vq), (kf, vf) = int8_pages(rng, kv_heads, 40, d, ps)
    tables = jnp.asarray(rng.permutation(40)[:36].reshape(6, 6), jnp.int32)
    ctx = jnp.asarray([1, ps - 1, ps, 2 * ps + 1, 4 * ps + 1, 6 * ps], jnp.int32)
    q = jnp.asarray(rng.normal(size=(6, heads, d)), jnp.float32)
    kernel = jax.jit(cpu_attention.paged_decode_attention, static_argnames="window")
    for positions in (ctx - 1, jnp.maximum(ctx - 3, 0)):
        want = paged_attention(q[:, None], kf, vf, tables, positions[:, None], ctx, window)[:, 0]
        np.testing.assert_allclose(np.asarray(kernel(q, kq, vq, tables, positions, ctx, window)), np.asarray(want),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", [(4, 2), (3, 1), (8, 2)], ids=["g2", "g3", "g4"])
@pytest.mark.parametrize("shape", KERNEL_SHAPES)
@pytest.mark.parametrize("window", [None, 5])
def test_kernel_on_packed_int8_rows_equals_the_reference_row_by_row(window, shape, heads):
    # decode rows and prefill chunks longer than a 16-query block, packed, with padding rows and tokens
    kernel_ready()
    (h, kv), n, p = heads, 64, 12
    ps, d = KERNEL_SHAPES[shape]
    rng = np.random.default_rng(5)
    (kq, vq), (kf, vf) = int8_pages(rng, kv, n, d, ps)
    spans = [(9, 1), (30, 1), (0, 37), (21, 3), (11, 20), (0, 0)]  # (first position, query tokens) per row
    tables, q_starts, q_lens, ctx, positions = packed_rows(rng, spans, n, p, trailing=5)
    q = jnp.asarray(rng.normal(size=(len(positions), h, d)), jnp.float32)
    kernel = jax.jit(cpu_attention.ragged_paged_attention, static_argnames="window")
    out = np.asarray(kernel(q, kq, vq, jnp.asarray(tables), jnp.asarray(positions), jnp.asarray(q_starts),
                            jnp.asarray(q_lens), jnp.asarray(ctx), window))
    for row, ((first, length), start) in enumerate(zip(spans, q_starts)):
        if length:
            ref = paged_attention(q[None, start : start + length], kf, vf, jnp.asarray(tables[row : row + 1]),
                                  jnp.asarray(positions[None, start : start + length]), jnp.asarray(ctx[row : row + 1]),
                                  window)
            np.testing.assert_allclose(out[start : start + length], np.asarray(ref[0]), atol=1e-5, rtol=1e-5,
                                       err_msg=f"row {row}")
    assert not out[int(q_lens.sum()) :].any()  # padding tokens: zeros


@pytest.mark.parametrize("shape", KERNEL_SHAPES)
def test_page_writes_store_the_quantized_tokens_on_every_path(shape):
    # the jnp scatter, the page-write kernel and the decode kernel that writes before it attends
    # store the same bytes and scales: each token's quantized vector in its slot, nothing else
    # touched (a padding row and a row past its own steps have slot 0 and write nothing); the
    # fused call's outputs equal the write kernel then the decode kernel, bit for bit
    kernel_ready()
    ps, d = KERNEL_SHAPES[shape]
    rng = np.random.default_rng(17)
    s, kv, h, n, p = 6, 2, 4, 40, 6
    (kq, vq), _ = int8_pages(rng, kv, n, d, ps)
    tables = rng.permutation(np.arange(1, n))[: s * p].reshape(s, p).astype(np.int32)
    ctx = np.asarray([1, ps, ps + 1, 3 * ps - 1, 0, 2 * ps + 2], np.int32)
    positions = np.maximum(ctx - 1, 0)
    slots = tables[np.arange(s), positions // ps] * ps + positions % ps
    slots[4] = slots[5] = 0
    q = jnp.asarray(rng.normal(size=(s, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(s, kv, d)) * rng.uniform(0.1, 5, (s, kv, 1)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(s, kv, d)), jnp.float32)
    args = (jnp.asarray(tables), jnp.asarray(positions), jnp.asarray(ctx))
    sl = jnp.asarray(slots)

    ref_k, ref_v = jax.jit(pa.write_pages)(kq, vq, k, v, sl)
    k8, ks = kv_quant.quantize_tokens(k)
    v8, vs = kv_quant.quantize_tokens(v)
    want_kd, want_vd = np.asarray(kq.data).copy(), np.asarray(vq.data).copy()
    want_ks, want_vs = np.asarray(kq.scales).copy(), np.asarray(vq.scales).copy()
    for i in (0, 1, 2, 3):
        page, off = divmod(int(slots[i]), ps)
        want_kd[:, page, :, off], want_vd[:, page, off, :] = np.asarray(k8[i]), np.asarray(v8[i])
        want_ks[:, page, off], want_vs[:, page, off] = np.asarray(ks[i]), np.asarray(vs[i])
    for got, want in ((ref_k.data, want_kd), (ref_v.data, want_vd), (ref_k.scales, want_ks), (ref_v.scales, want_vs)):
        np.testing.assert_array_equal(np.asarray(got), want)

    kp, vp = jax.jit(cpu_attention.write_pages)(kq, vq, k, v, sl)
    fused = jax.jit(cpu_attention.write_decode_attention, static_argnames="window")
    out, fkp, fvp = fused(q, k, v, sl, kq, vq, *args)
    for pages in ((kp, vp), (fkp, fvp)):
        for got, want in zip(jax.tree.leaves(pages), jax.tree.leaves((ref_k, ref_v))):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    separate = jax.jit(cpu_attention.paged_decode_attention)(q, kp, vp, *args)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(separate))
    ref = paged_attention(q[:, None], ref_k, ref_v, args[0], args[1][:, None], args[2])[:, 0]
    live = [0, 1, 2, 3, 5]
    np.testing.assert_allclose(np.asarray(out)[live], np.asarray(ref)[live], atol=1e-5, rtol=1e-5)
    assert not np.asarray(out)[4].any()


class TorchaoInt8Cache(DynamicCache):
    """transformers' cache holding what int8 pages hold: every new key and value vector (per token
    and KV head, after RoPE) through torchao's per-token int8 and back (q * scale)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.quantize = torchao_per_token()

    def round_trip(self, x):  # [B, KV, T, D]
        t = self.quantize(x.reshape(-1, x.shape[-1]))
        return (t.qdata.float() * t.scale.reshape(-1, 1)).reshape(x.shape)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(self.round_trip(key_states), self.round_trip(value_states), layer_idx, *args, **kwargs)


def hf_greedy_logprobs(hf, prompt, n, cache=None):
    """transformers' greedy tokens and each step's log-softmax: ([n], [n, V])."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          cache=cache, output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt) :].tolist(), torch.log_softmax(torch.stack(out.scores)[:, 0].float(), -1).numpy()


def test_engine_serves_as_transformers_with_an_int8_cache(tmp_path, tokenizer):
    # batched, prompts in chunks beside decode rows, fused decode steps, on the kernel and the jnp
    # attention; every page back at the end. The engine's int8 pages give the tokens and logprobs of
    # transformers whose cache holds the same int8 round trip: the same tokens for most prompts,
    # and logprobs several times closer to them than float32 KV's are. Not to float32 rounding: a
    # key a rounding apart from transformers' can land on the other side of an int8 step (session
    # 67: median 6-7e-4 from the int8 cache's logprobs, against 2.7e-3 between float32's and it)
    hf = make_hf_model("llama", tmp_path, vocab_size=len(tokenizer))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, len(tokenizer), n).tolist() for n in (1, 6, 11, 24, 41)]
    want = [hf_greedy_logprobs(hf, p, 10, TorchaoInt8Cache(config=hf.config)) for p in prompts]
    full = [hf_greedy_logprobs(hf, p, 10)[1] for p in prompts]  # float32 KV
    sizes = dict(max_num_seqs=4, page_size=4, num_pages=40, max_num_batched_tokens=16, decode_steps=3)
    for attention in ("kernel", "jnp"):
        engine = LLMEngine(load_model(tmp_path), tokenizer,
                           EngineConfig(kv_cache_dtype="int8", attention=attention, **sizes))
        assert isinstance(engine.runner.kv.keys[0], QuantizedPages)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1))
        got = drain(engine)
        tokens = [got[(f"r{i}", 0)].token_ids for i in range(len(prompts))]
        assert sum(a == b for a, (b, _) in zip(tokens, want)) >= 4, (attention, tokens, [w for w, _ in want])
        ours_off, float_off = [], []  # |logprob - the int8 cache's| of the engine's int8 pages and of float32 KV
        for (ids, lps), f32, i in zip(want, full, range(len(prompts))):
            ours = got[(f"r{i}", 0)]
            for step, (token, entry) in enumerate(zip(ours.token_ids, ours.logprobs)):
                if ours.token_ids[: step + 1] != ids[: step + 1]:
                    break  # the texts parted: later steps have different contexts
                ours_off.append(abs(entry["logprob"] - lps[step, token]))
                float_off.append(abs(f32[step, token] - lps[step, token]))
        assert len(ours_off) >= 30 and max(ours_off) < 5e-3, (attention, len(ours_off), max(ours_off))
        assert np.median(ours_off) < 0.4 * np.median(float_off), (attention, np.median(ours_off), np.median(float_off))
        assert engine.allocator.num_free_pages == engine.allocator.num_usable_pages


def test_settings_and_what_int8_pages_cost(monkeypatch):
    from worker.engine import attention_choice, gpu_attention, gpu_prefill
    from worker.engine.attention_choice import choose_attention
    from worker.engine.kv_cache import element_bytes, page_bytes
    from worker.models.config import ModelConfig

    with pytest.raises(ValueError, match="kv_cache_dtype must be float32, bfloat16 or int8"):
        EngineConfig(kv_cache_dtype="fp8")
    assert choose_attention("jnp", 1, 64, 16, jnp.float32, jnp.int8) is pa.JNP
    # where the Pallas decode kernel runs (a GPU), int8 pages take it, and prefill rows the Pallas
    # prefill kernel where it compiles over int8 pages (probed with int8 pages and their scales)
    monkeypatch.setattr(attention_choice, "_choose", lambda *args: gpu_attention.PALLAS)
    probed = []
    monkeypatch.setattr(attention_choice, "prefill_compiles", lambda *args: probed.append(args) or True)
    ops = choose_attention("pallas", 1, 64, 16, jnp.float32, jnp.int8)
    assert ops.decode is gpu_attention.pallas_decode_attention and ops.prefill is gpu_prefill.pallas_prefill_attention
    assert probed == [(64, 16, "float32", "int8")]
    assert choose_attention("pallas", 1, 64, 16, jnp.float32, jnp.int8, prefill_kernel=False).prefill is gpu_prefill.prefill_attention
    monkeypatch.setattr(attention_choice, "prefill_compiles", lambda *args: False)
    assert choose_attention("pallas", 1, 64, 16, jnp.float32, jnp.int8).prefill is gpu_prefill.prefill_attention
    with pytest.raises(RuntimeError, match="the Pallas prefill kernel did not compile"):
        choose_attention("pallas", 1, 64, 16, jnp.float32, jnp.int8, prefill_kernel=True)
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    # a byte a value and a float32 scale per head_dim values: 3.2x float32's pages in the same memory at D = 16
    assert element_bytes(jnp.int8, 16) == 1.25 and element_bytes(jnp.float32, 16) == 4
    assert page_bytes(cfg, 8, element_bytes(jnp.int8, 16)) == 2 * 2 * 8 * 2 * (16 + 4)


def test_engine_pages_and_bench_report_count_the_scales(tmp_path, tokenizer):
    import json

    from tests.bench_support import run_bench
    from worker.bench import roofline
    from worker.models.config import ModelConfig

    make_hf_model("llama", tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    code, out = run_bench("offline", "--model", str(tmp_path), "--num-prompts", "4", "--input-len", "8",
                          "--output-len", "8", "--kv-cache-dtype", "int8", "--num-pages", "32", "--compare", "hf",
                          "--hf-batch-size", "4", "--json")
    report = json.loads(out)
    assert code == 0 and report["output_tokens"] == 4 * 8 and report["kv_cache_dtype"] == "int8"
    assert report["baseline"].endswith(", float32 KV)") and report["greedy_first_token_match_fraction"] >= 0.5
    batch, context = report["decode_mean_batch"], report["decode_mean_context"]
    kv_bytes = 1 + 4 / cfg.head_dim
    memory = roofline.decode_step_bytes(cfg, 4, batch, context, kv_bytes) / (report["memory_bandwidth_gbs"] * 1e9)
    assert report["decode_memory_step_ms"] == pytest.approx(memory * 1e3)
    engine = LLMEngine(load_model(tmp_path), tokenizer, EngineConfig(kv_cache_dtype="int8", num_pages=32, page_size=8))
    kv = engine.runner.kv
    assert kv.dtype == jnp.int8 and kv.num_pages == 32 and kv.bytes_per_element == kv_bytes
    assert kv.keys[0].data.shape == (cfg.num_kv_heads, 32, cfg.head_dim, 8) and kv.keys[0].scales.shape == (
        cfg.num_kv_heads, 32, 8)


def test_demo_model_keeps_its_text_with_int8_pages():
    # real weights: the shipped demo model continues chapter openings with its book's next sentence
    # and keeps its perplexity over book paragraphs (prompt logprobs, which read the prompt's own
    # int8 pages) within half a percent of float32 pages'
    figures = {value: demo_text_figures(kv_cache_dtype=value) for value in ("float32", "int8")}
    assert figures["int8"][0] >= figures["float32"][0] - 1 >= 12 - 2, figures
    assert figures["float32"][1] != figures["int8"][1] <= 1.005 * figures["float32"][1], figures
