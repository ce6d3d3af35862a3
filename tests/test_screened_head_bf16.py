"""The int8 screen of a bfloat16 model's LM head (screened_head.Int8Head with `exact`): its greedy
tokens and their logits are the bfloat16 panel kernel's product (the model's own head) and argmax
bit for bit, its sampled tokens the sampler's draw over those logits, through ties, rows the int8
screen leaves to the head itself and logits that are not finite; an engine serving a bfloat16
model takes it and gives the tokens and seeded samples of the same engine without it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.engine_support import drain, tokenizer  # noqa: F401 (a fixture)
from tests.hf_models import make_hf_model
from worker.engine import cpu_matmul, cpu_sampling, screened_head
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.models.loader import load_model

RUNS = cpu_matmul.has_cpu_flag("avx512_vnni") and cpu_matmul.has_cpu_flag("avx512_bf16")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """Where the CPU has both, the screen must build (else it must not load, and the engine keeps
    the full head: test_an_engine_serving_a_bfloat16_model...)."""
    assert cpu_sampling.load()
    assert screened_head.load_int8_bf16() == RUNS


def bf16_head(v: int, k: int, rng, scale: float = 0.05):
    """A bfloat16 head as the engine holds it: (rows bf16[V, K], panels, the model's head)."""
    rows = jnp.asarray(rng.standard_normal((v, k)).astype(np.float32) * scale, jnp.bfloat16)
    head = cpu_matmul.PanelLinear(rows.T, None)
    return rows, head


def screen_head(rows, head) -> screened_head.Int8Head:
    return screened_head.Int8Head(rows, screened_head.FullHead(head), exact=head.panels[...])


def greedy(r: int):
    return jnp.zeros((r,)), jnp.zeros((r, 2), jnp.uint32)


def sampling_rows(rng, r: int):
    """(temperature, keys) of r rows: greedy, cold, plain and hot sampled rows mixed."""
    temperature = rng.choice([0.0, 0.05, 0.7, 1.0, 2.5], r).astype(np.float32)
    return jnp.asarray(temperature), jnp.asarray(rng.integers(0, 2**32, (r, 2), dtype=np.uint32))


# (rows, K, V): K of one pair-vector and odd; V not a multiple of 16 or of a panel; llama-100m's K
@pytest.mark.parametrize("r,k,v", [(1, 32, 16), (7, 33, 1000), (64, 256, 4096), (13, 768, 3001), (5, 3, 40)])
def test_tokens_and_logits_are_the_bfloat16_heads(r, k, v):
    if not RUNS:
        return
    rng = np.random.default_rng(k + v)
    rows, head = bf16_head(v, k, rng)
    x = rng.standard_normal((r, k)).astype(np.float32)
    x[0, 0] = 30.0  # an outlier: a coarse scale for row 0, a wide bound, many candidates (each a chain:
    # no float32 rows narrow them; the engine gives a step with such a row to the head, `takes_int8`)
    full = np.asarray(head(jnp.asarray(x)))  # the model's own logits f32[R, V]
    tokens, values, candidates = (np.asarray(a) for a in screen_head(rows, head).screen(jnp.asarray(x), *greedy(r)))
    want = full.argmax(axis=1)  # the first largest, as the engine's argmax
    np.testing.assert_array_equal(tokens, want)
    np.testing.assert_array_equal(values.view(np.int32), full[np.arange(r), want].view(np.int32))
    assert candidates.min() >= 1 and candidates[1:].max(initial=1) <= max(3, v // 20)


def test_sampled_rows_take_the_samplers_draw_over_the_bfloat16_logits():
    """Plain sampled rows (nothing cut) take the token the sampler draws from the head's logits with
    the same noise; a step with an outlier row goes to the head itself, with the same tokens."""
    if not RUNS:
        return
    rng = np.random.default_rng(3)
    r, k, v = 64, 256, 4096
    rows, head = bf16_head(v, k, rng)
    x = rng.standard_normal((r, k)).astype(np.float32)
    sampling = sampling_rows(rng, r)
    screened = screen_head(rows, head)
    for xs in (x, np.where(np.arange(k) < 4, x * 20.0, x).astype(np.float32)):  # the second: outliers
        want = np.asarray(cpu_sampling.draw(head(jnp.asarray(xs)), *sampling))
        assert bool(screened.takes_int8(jnp.asarray(xs))) == (xs is x)
        np.testing.assert_array_equal(np.asarray(jax.jit(screened)(jnp.asarray(xs), *sampling)), want)
    tokens, _, candidates = (np.asarray(a) for a in screened.screen(jnp.asarray(x), *sampling))
    np.testing.assert_array_equal(tokens, np.asarray(cpu_sampling.draw(head(jnp.asarray(x)), *sampling)))
    assert candidates.max() <= v // 20


def test_ties_and_rows_that_are_not_finite():
    """Tokens with the same weights tie exactly: the first wins, as the argmax picks. A row with an
    infinite or NaN input is searched over every token and gives the head's own answer (V - 1 where
    a logit is NaN)."""
    if not RUNS:
        return
    rng = np.random.default_rng(5)
    v, k = 300, 64
    w = rng.standard_normal((v, k)).astype(np.float32) * 0.05
    w[200] = w[10] = w[250] = w[100] * 1.5  # a token far ahead of the rest, tied three times over
    rows = jnp.asarray(w, jnp.bfloat16)
    head = cpu_matmul.PanelLinear(rows.T, None)
    x = np.tile(np.asarray(rows[100], np.float32) * 40.0, (3, 1))
    x[1, 3] = np.inf
    x[2, 5] = np.nan
    tokens, values, candidates = (np.asarray(a) for a in screen_head(rows, head).screen(jnp.asarray(x), *greedy(3)))
    assert tokens[0] == 10
    full = np.asarray(head(jnp.asarray(x)))
    np.testing.assert_array_equal(values[0].view(np.int32), full[0, 10].view(np.int32))
    assert candidates[1] == v and candidates[2] == v  # the screen is void: every token computed
    assert tokens[2] == v - 1 and np.isnan(values[2])
    np.testing.assert_array_equal(tokens[1], np.asarray(cpu_sampling.argmax(jnp.asarray(full[1:2])))[0])


def test_it_stays_off_where_the_heads_product_is_not_the_panel_kernels(tokenizer, tmp_path, monkeypatch):  # noqa: F811
    """On AMX tiles (the bfloat16 product's sums in another order) a bfloat16 model keeps its head;
    asking for the bfloat16 screen over a bfloat16 head is an error (that product is the head)."""
    make_hf_model("llama", tmp_path, vocab_size=len(tokenizer))
    sizes = dict(max_num_seqs=4, page_size=16, num_pages=24, max_num_batched_tokens=64, dtype="bfloat16")
    with pytest.raises(ValueError, match="greedy_head='screened-bf16' needs"):
        LLMEngine(load_model(tmp_path, dtype="bfloat16"), tokenizer, EngineConfig(greedy_head="screened-bf16", **sizes))
    if not RUNS:
        return
    monkeypatch.setattr(cpu_matmul, "amx", lambda: True)
    engine = LLMEngine(load_model(tmp_path, dtype="bfloat16"), tokenizer, EngineConfig(**sizes))
    assert engine.greedy_head == "full"


def test_an_engine_serving_a_bfloat16_model_gives_the_full_heads_tokens(tokenizer, tmp_path):  # noqa: F811
    """A bfloat16 model with the screen (`auto`) and without it (`full`): the same greedy tokens,
    the same seeded samples, and the same tokens for top-k and logprob requests (which the screen
    leaves to the head); no page leaked."""
    make_hf_model("llama", tmp_path, vocab_size=len(tokenizer))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, len(tokenizer), n).tolist() for n in (3, 17, 30, 45)]
    kinds = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.8, top_k=5, seed=3, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.0, logprobs=2, max_tokens=12, ignore_eos=True)]
    out = {}
    for mode in ("auto", "full"):
        engine = LLMEngine(load_model(tmp_path, dtype="bfloat16"), tokenizer, EngineConfig(
            max_num_seqs=8, page_size=16, num_pages=48, max_num_batched_tokens=64, dtype="bfloat16",
            decode_steps=4, greedy_head=mode))
        assert engine.greedy_head == ("screened-int8" if mode == "auto" and RUNS else "full")
        for i, prompt in enumerate(prompts):
            for j, params in enumerate(kinds):
                engine.add_request(f"r{i}-{j}", prompt, params)
        results = drain(engine)
        out[mode] = {key: result.token_ids for key, result in results.items()}
        assert engine.allocator.num_free_pages == engine.allocator.num_usable_pages
    assert out["auto"] == out["full"]
