"""The screened head (worker/engine/screened_head.py): its greedy tokens and their logits are the
float32 panel kernel's product and argmax, bit for bit, with any approximation within the bound
(numpy's bfloat16-rounded product here, the bfloat16 kernel in the engine), through exact ties,
near ties the bound cannot split, and logits that are not finite; its sampled tokens are the
sampler's draw over the float32 logits; and an engine using it gives transformers' greedy tokens,
and the float32 head's seeded samples, while requests that need the logits go through the float32
head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.engine_support import drain, hf_greedy, tokenizer  # noqa: F401 (a fixture)
from tests.hf_models import make_hf_model
from worker.engine import cpu_matmul, cpu_sampling, head_choice, sampler, screened_head
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampler import SamplerFlags
from worker.engine.sampling_params import SamplingParams
from worker.models.loader import load_model

BF16_CPU = cpu_matmul.has_cpu_flag("avx512_bf16")
VNNI_CPU = cpu_matmul.has_cpu_flag("avx512_vnni")  # the int8 head


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_matmul.load() and screened_head.load_screen() and cpu_sampling.load(), "the CPU kernels did not build (is a C++ compiler installed?)"


def bf16(a: np.ndarray) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))


def float32_head(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The engine's float32 logits: the panel kernel's product. x f32[R, K], rows f32[V, K] -> f32[R, V]."""
    return np.asarray(cpu_matmul.matmul(jnp.asarray(x), cpu_matmul.pack(jnp.asarray(rows).T), rows.shape[0]))


def greedy(r: int) -> tuple[jax.Array, jax.Array]:
    """(temperature, keys) of r greedy rows."""
    return jnp.zeros((r,)), jnp.zeros((r, 2), jnp.uint32)


def screened(x: np.ndarray, rows: np.ndarray, approx: np.ndarray | None = None, sampling=None):
    """(tokens, logits, candidates) of the screen, on numpy's bfloat16-rounded product unless given;
    greedy rows unless `sampling` gives (temperature, keys)."""
    if approx is None:
        approx = (bf16(x).astype(np.float64) @ bf16(rows).T.astype(np.float64)).astype(np.float32)
    out = screened_head.screen(jnp.asarray(approx), jnp.asarray(x), jnp.asarray(rows),
                               screened_head.row_norms(jnp.asarray(rows)), *(sampling or greedy(len(x))))
    return tuple(np.asarray(a) for a in out)


def assert_float32_argmax(x, rows, tokens, values):
    full = float32_head(x, rows)
    want = full.argmax(axis=1)  # numpy's argmax: the first largest, as the engine's
    np.testing.assert_array_equal(tokens, want)
    np.testing.assert_array_equal(values.view(np.int32), full[np.arange(len(want)), want].view(np.int32))


# (rows, K, V): K of one 16-lane vector and not a multiple; V not a multiple of 16; llama-100m's K
@pytest.mark.parametrize("r,k,v", [(1, 16, 16), (7, 33, 1000), (64, 256, 4096), (13, 768, 3001)])
def test_tokens_and_logits_are_the_float32_heads(r, k, v):
    rng = np.random.default_rng(k + v)
    rows = rng.standard_normal((v, k)).astype(np.float32) * 0.05
    x = rng.standard_normal((r, k)).astype(np.float32)
    tokens, values, candidates = screened(x, rows)
    assert_float32_argmax(x, rows, tokens, values)
    assert candidates.min() >= 1 and candidates.max() < v  # it screened: not every token computed
    if v >= 1000:
        assert candidates.mean() < 0.01 * v


def test_exact_ties_go_to_the_first_token_and_near_ties_to_the_float32_winner():
    rng = np.random.default_rng(1)
    k, v = 64, 500
    rows = rng.standard_normal((v, k)).astype(np.float32) * 0.05
    rows[400] = rows[7]  # an exact tie: both logits are the same float32 number
    x = np.stack([rows[7] * 40.0, rows[7] * 40.0, rows[123] * 40.0])
    # near ties bfloat16 cannot tell apart: token 123's twin differs in the last bits of its weights
    rows[300] = np.nextafter(rows[123], np.float32(np.inf))
    tokens, values, candidates = screened(x, rows)
    assert tokens[0] == tokens[1] == 7
    assert tokens[2] in (123, 300) and candidates[2] >= 2
    assert_float32_argmax(x, rows, tokens, values)


def test_logits_that_are_not_finite_search_every_token():
    rng = np.random.default_rng(2)
    k, v = 32, 300
    rows = rng.standard_normal((v, k)).astype(np.float32)
    x = rng.standard_normal((3, k)).astype(np.float32)
    approx = (bf16(x) @ bf16(rows).T).astype(np.float32)
    approx[1, 17] = np.nan
    approx[2, 5] = np.inf
    tokens, values, candidates = screened(x, rows, approx)
    assert candidates[0] < v and candidates[1] == candidates[2] == v
    assert_float32_argmax(x, rows, tokens, values)
    # a broken row (a NaN in its input): every logit NaN, and the last token, as the argmax kernel gives
    x[1, 3] = np.nan
    tokens, _, candidates = screened(x, rows)
    assert candidates[1] == v and tokens[1] == v - 1
    assert np.asarray(cpu_sampling.argmax(jnp.asarray(float32_head(x, rows))))[1] == v - 1


def test_inputs_at_the_bottom_of_float32_still_give_the_float32_argmax():
    # products below float32's normal range, which VDPBF16PS flushes to zero: the bound's absolute
    # term keeps every token whose float32 logit could still win
    rng = np.random.default_rng(4)
    k, v = 64, 400
    rows = rng.standard_normal((v, k)).astype(np.float32) * 0.05
    x = (rng.standard_normal((4, k)) * 1e-36).astype(np.float32)
    tokens, values, candidates = screened(x, rows)
    assert candidates.min() >= 1
    assert_float32_argmax(x, rows, tokens, values)


def int8_runs() -> bool:
    """Whether the int8 head runs here: where it cannot, it must not load, and the engine never picks
    it (test_an_engine_on_it...), so its own tests have nothing to run."""
    assert screened_head.load_int8() == VNNI_CPU
    return VNNI_CPU


def int8_screened(x: np.ndarray, rows: np.ndarray, sampling=None):
    """(tokens, logits, candidates) of the int8 head (its product quantizes x; candidates after refine)."""
    head = screened_head.Int8Head(jnp.asarray(rows))
    return tuple(np.asarray(a) for a in head.screen(jnp.asarray(x), *(sampling or greedy(len(x)))))


@pytest.mark.parametrize("r,k,v", [(1, 16, 16), (7, 33, 1000), (64, 256, 4096), (13, 768, 3001), (5, 3, 40)])
def test_the_int8_heads_tokens_and_logits_are_the_float32_heads(r, k, v):
    if not int8_runs():
        return
    rng = np.random.default_rng(k + v)
    rows = rng.standard_normal((v, k)).astype(np.float32) * 0.05
    x = rng.standard_normal((r, k)).astype(np.float32)
    x[0, 0] = 30.0  # an outlier: a coarse scale for row 0, a wide bound, more candidates to refine
    tokens, values, candidates = int8_screened(x, rows)
    assert_float32_argmax(x, rows, tokens, values)
    assert candidates.min() >= 1 and candidates.max() <= max(2, v // 100)


def sampling_rows(rng, r: int):
    """(temperature, keys) of r rows: greedy, cold, plain and hot sampled rows mixed."""
    temperature = rng.choice([0.0, 0.05, 0.7, 1.0, 2.5], r).astype(np.float32)
    return jnp.asarray(temperature), jnp.asarray(rng.integers(0, 2**32, (r, 2), dtype=np.uint32))


def float32_draw(x: np.ndarray, rows: np.ndarray, sampling, top_k=None) -> np.ndarray:
    """The sampler's tokens over the float32 head's logits (the CPU kernels: the top-k cut on the
    scaled logits, as sampler.sample makes it, then the Gumbel-max draw)."""
    logits = jnp.asarray(float32_head(x, rows))
    if top_k is not None:
        scaled = sampler.scale(logits, sampling[0])
        cut = cpu_sampling.cutoffs(scaled, jnp.asarray(top_k), jnp.ones(len(x)))
        logits = jnp.where(scaled < cut[:, None], -jnp.inf, logits)
    return np.asarray(cpu_sampling.draw(logits, *sampling))


@pytest.mark.parametrize("r,k,v", [(7, 33, 1000), (64, 256, 4096), (13, 768, 3001)])
def test_sampled_rows_take_the_samplers_draw_over_the_float32_logits(r, k, v):
    """A sampled row (nothing cut) takes the token the sampler draws from the float32 logits with
    the same noise, bit for bit: through the bfloat16 screen, the int8 one, and each head as the
    engine runs it (jitted, with its fallback for outlier rows); with few candidates a row."""
    rng = np.random.default_rng(k + v + 1)
    rows = rng.standard_normal((v, k)).astype(np.float32) * 0.05
    x = rng.standard_normal((r, k)).astype(np.float32)
    sampling = sampling_rows(rng, r)
    want = float32_draw(x, rows, sampling)
    tokens, values, candidates = screened(x, rows, sampling=sampling)
    np.testing.assert_array_equal(tokens, want)
    full = float32_head(x, rows)
    np.testing.assert_array_equal(values.view(np.int32), full[np.arange(r), want].view(np.int32))
    assert candidates.max() <= max(4, v // 100)
    heads = [screened_head.ScreenedHead(jnp.asarray(rows))] if screened_head.load() else []
    if int8_runs():
        tokens, _, candidates = int8_screened(x, rows, sampling)
        np.testing.assert_array_equal(tokens, want)
        assert candidates.max() <= max(4, v // 100)
        heads.append(screened_head.Int8Head(jnp.asarray(rows)))
        spiky = x.copy()
        spiky[1, :4] *= 20.0  # with k >= 256, a step the int8 head leaves to its fallback
        assert bool(heads[-1].takes_int8(jnp.asarray(spiky))) == (k < 256)
        np.testing.assert_array_equal(np.asarray(jax.jit(heads[-1])(jnp.asarray(spiky), *sampling)),
                                      float32_draw(spiky, rows, sampling))
    for head in heads:
        np.testing.assert_array_equal(np.asarray(jax.jit(head)(jnp.asarray(x), *sampling)), want)


@pytest.mark.parametrize("r,k,v", [(7, 33, 1000), (64, 256, 4096), (13, 768, 3001)])
def test_top_k_rows_take_the_samplers_cut_and_draw_over_the_float32_logits(r, k, v):
    """A sampled row with a top-k cut takes the token the sampler draws from the float32 logits cut
    to their k largest (scaled, ties at the k-th kept): through both screens and each jitted head,
    with k from 1 past the vocabulary, and tokens whose weights are equal (exact ties at the cut)."""
    rng = np.random.default_rng(k + v + 2)
    rows = rng.standard_normal((v, k)).astype(np.float32) * 0.05
    rows[v // 2:v // 2 + 40] = rows[:40]  # 40 tokens with another's logit, bit for bit
    x = rng.standard_normal((r, k)).astype(np.float32)
    sampling = sampling_rows(rng, r)
    top_k = jnp.asarray(rng.choice([0, 1, 2, 5, 40, 50, 256, 300, v + 3], r).astype(np.int32))
    want = float32_draw(x, rows, sampling, top_k)
    assert (want != float32_draw(x, rows, sampling)).sum() > r // 4  # the cut changes many rows' draws
    tokens, values, candidates = screened(x, rows, sampling=(*sampling, top_k))
    np.testing.assert_array_equal(tokens, want)
    full = float32_head(x, rows)
    np.testing.assert_array_equal(values.view(np.int32), full[np.arange(r), want].view(np.int32))
    cut = (np.asarray(sampling[0]) > 0) & (np.asarray(top_k) > 0) & (np.asarray(top_k) < v)
    assert (candidates[cut] <= 2 * np.asarray(top_k)[cut] + 64).all()  # about k, not the vocabulary
    heads = [screened_head.ScreenedHead(jnp.asarray(rows))] if screened_head.load() else []
    if int8_runs():
        tokens, _, candidates = int8_screened(x, rows, (*sampling, top_k))
        np.testing.assert_array_equal(tokens, want)
        heads.append(screened_head.Int8Head(jnp.asarray(rows)))
        spiky = x.copy()
        spiky[1, :4] *= 20.0  # with k >= 256, a step the int8 head leaves to its fallback
        np.testing.assert_array_equal(np.asarray(jax.jit(heads[-1])(jnp.asarray(spiky), *sampling, top_k)),
                                      float32_draw(spiky, rows, sampling, top_k))
    packed = cpu_matmul.pack(jnp.asarray(rows).T)  # the float32 head as the model's, with the sampler's cut
    heads.append(screened_head.FullHead(lambda h: cpu_matmul.matmul(h, packed, v)))
    for head in heads:
        np.testing.assert_array_equal(np.asarray(jax.jit(head)(jnp.asarray(x), *sampling, top_k)), want)
    # the 64 largest logits all equal: a cut inside them keeps all 64, and the draw picks among them
    rows[1:64] = rows[0]
    x += 8.0 * rows[0] / np.linalg.norm(rows[0]) ** 2
    want = float32_draw(x, rows, sampling, top_k)
    hot = np.asarray(sampling[0]) > 0.5
    assert len(set(want[hot & (np.asarray(top_k) < 64)].tolist())) > 1  # drawn from the tie, not its first k
    np.testing.assert_array_equal(screened(x, rows, sampling=(*sampling, top_k))[0], want)
    if int8_runs():
        np.testing.assert_array_equal(int8_screened(x, rows, (*sampling, top_k))[0], want)


def test_the_weights_quantization_and_its_error_norms():
    # 4096-row blocks and a block's tail; a zero row; the error norms the bound takes are upper bounds
    rng = np.random.default_rng(7)
    rows = (rng.standard_normal((4100, 24)) * 0.05).astype(np.float32)
    rows[5] = 0.0
    q, scales, totals, lost = screened_head.quantize(rows)
    np.testing.assert_array_equal(scales, (np.abs(rows).max(axis=1) / np.float32(127)).astype(np.float32))
    assert np.abs(q).max() == 127 and not q[5].any() and scales[5] == 0
    np.testing.assert_array_equal(totals, q.astype(np.int64).sum(axis=1))
    error = np.sqrt(np.square(rows - scales[:, None].astype(np.float64) * q).sum(axis=1))
    assert (lost >= error).all() and (lost <= error * (1 + 1e-6) + 1e-30).all()
    # to nearest, up to float32's rounding of w / scale (at most 127 2^-24 of a step)
    assert (np.abs(rows - scales[:, None].astype(np.float64) * q) <= scales[:, None] * (0.5 + 1e-5)).all()


def test_the_int8_head_through_ties_non_finite_rows_and_tiny_inputs():
    if not int8_runs():
        return
    rng = np.random.default_rng(5)
    k, v = 64, 500
    rows = rng.standard_normal((v, k)).astype(np.float32) * 0.05
    rows[400] = rows[7]
    rows[300] = np.nextafter(rows[123], np.float32(np.inf))
    x = np.stack([rows[7] * 40.0, rows[123] * 40.0, rng.standard_normal(k) * 1e-36, rng.standard_normal(k)])
    x = x.astype(np.float32)
    tokens, values, candidates = int8_screened(x, rows)
    assert tokens[0] == 7 and tokens[1] in (123, 300) and candidates[1] >= 2
    assert_float32_argmax(x, rows, tokens, values)
    x[3, 5] = np.nan  # a broken row: every logit NaN, the last token, as the argmax kernel gives
    tokens, _, candidates = int8_screened(x, rows)
    assert candidates[3] == v and tokens[3] == v - 1
    assert_float32_argmax(x[:3], rows, tokens[:3], int8_screened(x[:3], rows)[1])


def test_steps_with_outlier_rows_take_the_bfloat16_head():
    # a row with a few values far above the rest quantizes coarsely: its int8 bound would leave many
    # candidates, so such a step takes the bfloat16 head, or without AVX512-BF16 the float32 head
    # (the model's own panels) and its argmax; each gives the float32 head's tokens
    if not int8_runs():
        return
    rng = np.random.default_rng(6)
    k, v = 256, 2000
    rows = jnp.asarray(rng.standard_normal((v, k)).astype(np.float32) * 0.05)
    full = screened_head.Int8Head(rows, screened_head.FullHead(cpu_matmul.PanelLinear(rows.T, None)))
    heads = [full] + ([screened_head.Int8Head(rows)] if screened_head.load() else [])  # the bfloat16 head behind it
    plain = rng.standard_normal((8, k)).astype(np.float32)
    spiky = plain.copy()
    spiky[3, :4] *= 20.0
    assert bool(full.takes_int8(jnp.asarray(plain))) and not bool(full.takes_int8(jnp.asarray(spiky)))
    for x in (plain, spiky):
        want = float32_head(x, np.asarray(rows)).argmax(axis=1)
        for head in heads:
            np.testing.assert_array_equal(np.asarray(jax.jit(head)(jnp.asarray(x), *greedy(len(x)))), want)


def test_only_steps_without_logprobs_penalties_or_bias_take_it():
    assert screened_head.serves(SamplerFlags()) and screened_head.serves(SamplerFlags(all_greedy=False))
    for flags in (SamplerFlags(all_greedy=False, needs_cut=True), SamplerFlags(all_greedy=False, needs_cut=True, top_p=True),
                  SamplerFlags(all_greedy=False, min_p=True)):  # cut rows: the screened head, or the float32 one apart
        assert screened_head.serves(flags)
    for flags in (SamplerFlags(logprobs=True), SamplerFlags(penalties=True), SamplerFlags(bias=True)):
        assert not screened_head.serves(flags)


@pytest.fixture(scope="module")
def llama(tokenizer, tmp_path_factory):
    """A tiny random Llama with an untied head (its rows are the head transposed)."""
    path = tmp_path_factory.mktemp("llama")
    hf = make_hf_model("llama", path, vocab_size=len(tokenizer))
    return load_model(path), hf


def test_an_engine_on_it_gives_transformers_greedy_tokens(llama, tokenizer):
    model, hf = llama
    sizes = dict(max_num_seqs=8, page_size=4, num_pages=64, max_num_batched_tokens=32, decode_steps=4)
    engine = LLMEngine(model, tokenizer, EngineConfig(**sizes))
    full = LLMEngine(model, tokenizer, EngineConfig(**sizes, greedy_head="full"))
    best = "screened-int8" if VNNI_CPU else "screened-bf16" if BF16_CPU else "full"
    assert engine.greedy_head == best and full.greedy_head == "full"
    engines = [engine, full]
    if VNNI_CPU and BF16_CPU:  # and the other approximation
        engines.append(LLMEngine(model, tokenizer, EngineConfig(**sizes, greedy_head="screened-bf16")))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, len(tokenizer), n).tolist() for n in (1, 5, 12, 30)]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # the same prompts again with logprobs: their steps need the logits, so they take the float32 head
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    results = []
    for e in engines:
        for i, p in enumerate(prompts):
            e.add_request(f"g{i}", p, plain)
        results.append(drain(e))
        for i, p in enumerate(prompts):
            e.add_request(f"l{i}", p, with_logprobs)
        results[-1].update(drain(e))
    for i, p in enumerate(prompts):
        want = hf_greedy(hf, p, 12)
        for got in results:
            assert got[(f"g{i}", 0)].token_ids == want and got[(f"l{i}", 0)].token_ids == want, i


def test_an_engines_seeded_samples_are_the_float32_heads(llama, tokenizer, monkeypatch):
    """Sampled requests with nothing cut but by top-k take their tokens from the screened head (the
    step traces its noise keys), and they are the float32 head's seeded draws: the same tokens as
    an engine without the screened head; with top-p or a top-k past SCREENED_TOP_K (the sampler over
    the float32 head in both) as well."""
    model, _ = llama
    traced = []
    real = head_choice.noise_keys
    monkeypatch.setattr(head_choice, "noise_keys", lambda *a: traced.append(1) or real(*a))
    sizes = dict(max_num_seqs=8, page_size=4, num_pages=64, max_num_batched_tokens=32, decode_steps=4)
    engines = [LLMEngine(model, tokenizer, EngineConfig(**sizes)),
               LLMEngine(model, tokenizer, EngineConfig(**sizes, greedy_head="full"))]
    if engines[0].greedy_head == "full":  # nothing to compare on a CPU without AVX512-BF16 or VNNI
        assert not (BF16_CPU or VNNI_CPU)
        return
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, len(tokenizer), n).tolist() for n in (1, 5, 12, 30, 9)]
    wide = dict(top_k=sampler.SCREENED_TOP_K + 1)
    params = [SamplingParams(temperature=t, seed=i, max_tokens=12, ignore_eos=True, n=2, **cut)
              for i, (t, cut) in enumerate([(0.8, {}), (1.5, dict(top_k=5)), (0.5, {}), (1.0, dict(top_p=0.9)),
                                            (1.2, wide)])]
    results = []
    for e in engines:
        for i, (p, sp) in enumerate(zip(prompts[:3], params)):
            e.add_request(f"s{i}", p, sp)
        results.append(drain(e))
        if e is engines[0]:
            assert traced, "no step took sampled tokens from the screened head"
        for i in (3, 4):  # alone: a batch with these cuts takes the sampler
            e.add_request(f"s{i}", prompts[i], params[i])
            drain(e, results=results[-1])
    assert results[0].keys() == results[1].keys() and len(results[0]) == 10
    for key, got in results[0].items():
        assert got.token_ids == results[1][key].token_ids, key
    assert results[0][("s0", 0)].token_ids != results[0][("s0", 1)].token_ids  # two choices, two streams


def test_with_amx_the_bfloat16_head_comes_first(llama, monkeypatch):
    # on AMX tiles the bfloat16 product outruns the AVX-512 int8 one (cpu_matmul.amx)
    packed = lambda: cpu_matmul.pack_model(llama[0])  # noqa: E731 (a head attaches once per model)
    best = "screened-int8" if VNNI_CPU else "screened-bf16" if BF16_CPU else "full"
    assert screened_head.choose("auto", "kernel", packed()) == best
    monkeypatch.setattr(cpu_matmul, "amx", lambda: True)
    assert screened_head.choose("auto", "kernel", packed()) == ("screened-bf16" if BF16_CPU else "full")
    if VNNI_CPU:  # asked for by name, the int8 head still
        assert screened_head.choose("screened-int8", "kernel", packed()) == "screened-int8"


def test_without_avx512_bf16_the_int8_heads_fallback_is_the_models_float32_head(llama, monkeypatch):
    if not int8_runs():
        return
    monkeypatch.setattr(screened_head, "load", lambda: False)  # as on a CPU without AVX512-BF16
    model = cpu_matmul.pack_model(llama[0])
    assert screened_head.choose("auto", "kernel", model) == "screened-int8"
    head = model.greedy_head
    assert isinstance(head.fallback, screened_head.FullHead) and head.fallback.head is model.lm_head
    # (its hidden size is too small for rows to leave the int8 head: test_steps_with_outlier_rows...)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((4, model.cfg.hidden_size)).astype(np.float32))
    want = np.asarray(model.lm_head(x)).argmax(axis=1)
    for run in (head, head.fallback):
        np.testing.assert_array_equal(np.asarray(jax.jit(run)(x, *greedy(4))), want)


def test_asking_for_it_where_it_cannot_run_fails(llama, tokenizer):
    model, _ = llama
    for mode in ("screened", "screened-int8", "screened-bf16"):
        with pytest.raises(ValueError, match=f"greedy_head='{mode}'"):
            LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=2, num_pages=16, matmul="xla", greedy_head=mode))
    with pytest.raises(ValueError, match="greedy_head must be"):
        EngineConfig(greedy_head="fast")


@pytest.mark.parametrize("v,k", [(4100, 24), (96, 130), (33, 4)])
def test_the_heads_panels_packed_on_the_host_block_by_block_equal_the_device_packing(v, k):
    """pack_int8_host (the int8 screen's panels, a block of rows at a time) gives pack_int8's
    panels, zeros past V and K; and a bfloat16 head's rows read from its panels a block at a time
    (PanelRows) are its rows."""
    rng = np.random.default_rng(v + k)
    q = rng.integers(-127, 128, (v, k), dtype=np.int8)
    np.testing.assert_array_equal(screened_head.pack_int8_host(q, block=64), np.asarray(screened_head.pack_int8(q)))
    rows = jnp.asarray(rng.standard_normal((v, k)), jnp.bfloat16)
    view = screened_head.PanelRows(cpu_matmul.pack(rows.T), v, k)
    assert view.shape == (v, k)
    for start, stop in ((0, 64), (64, v + 10), (0, v)):
        np.testing.assert_array_equal(np.asarray(view[start:stop]), np.asarray(rows[start:stop]))
    with pytest.raises(IndexError, match="panel"):
        view[5:10]
