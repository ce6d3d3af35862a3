"""Which head draws each row (worker/engine/head_choice.py): in a step where a few rows need their
logits (top-p, min-p, a large top-k) the screened head draws the rest and the float32 head those
few; with more of them the float32 head draws all. Each request's seeded tokens are the ones an
engine without the screened head gives, whichever way its steps went."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests.engine_support import drain, tokenizer  # noqa: F401 (a fixture)
from tests.hf_models import make_hf_model
from worker.engine import cpu_matmul, head_choice, sampler
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampler import SCREENED_TOP_K
from worker.engine.sampling_params import SamplingParams
from worker.models.loader import load_model

SIZES = dict(max_num_seqs=8, page_size=4, num_pages=96, max_num_batched_tokens=64, decode_steps=3)


@pytest.fixture(scope="module")
def model(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_hf_model("llama", path, vocab_size=len(tokenizer))
    return load_model(path)


def test_rows_that_need_their_logits():
    """sampler.needs_logits: the rows the float32 head draws (apart where they are few). Greedy
    rows never for a cut (a cut keeps the largest logit); top-p, min-p and a top-k past
    SCREENED_TOP_K do when sampled; logprobs of the sampled token, penalties and a logit bias always.
    Prompt logprobs come from the prompt's own logits."""
    top = SCREENED_TOP_K
    need = [dict(temperature=0.7, top_p=0.9), dict(temperature=0.7, min_p=0.1), dict(temperature=0.7, top_k=top + 1),
            dict(logprobs=0), dict(temperature=0.7, logprobs=3), dict(presence_penalty=0.5),
            dict(temperature=0.7, frequency_penalty=-0.1), dict(repetition_penalty=1.2), dict(logit_bias=((5, 2.0),))]
    plain = [dict(), dict(temperature=0.0, top_p=0.5), dict(temperature=0.0, min_p=0.1),
             dict(temperature=0.0, top_k=top + 1), dict(temperature=0.7),
             dict(temperature=0.7, top_k=top), dict(prompt_logprobs=2), dict(temperature=0.7, repetition_penalty=1.0)]
    assert [sampler.needs_logits(SamplingParams(**kw)) for kw in need] == [True] * len(need)
    assert [sampler.needs_logits(SamplingParams(**kw)) for kw in plain] == [False] * len(plain)


def drawn_apart(monkeypatch) -> list[int]:
    """Records, as steps run, how many rows each draw apart from the screened head took (a
    callback runs only where its branch of the step does)."""
    seen: list[int] = []
    real = head_choice.draw_apart

    def draw_apart(model, rows, at, st, flags, kernels):
        jax.debug.callback(lambda n: seen.append(int(n)), at.shape[0])
        return real(model, rows, at, st, flags, kernels)

    monkeypatch.setattr(head_choice, "draw_apart", draw_apart)
    return seen


def test_few_rows_needing_logits_are_drawn_apart_and_every_row_gets_the_float32_heads_tokens(
        model, tokenizer, monkeypatch):
    screened = LLMEngine(model, tokenizer, EngineConfig(**SIZES))
    if screened.greedy_head == "full":  # nothing to split on a CPU without AVX512-BF16 or VNNI
        assert not (cpu_matmul.has_cpu_flag("avx512_bf16") or cpu_matmul.has_cpu_flag("avx512_vnni"))
        return
    full = LLMEngine(model, tokenizer, EngineConfig(**SIZES, greedy_head="full"))
    seen = drawn_apart(monkeypatch)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(1, len(tokenizer), n).tolist() for n in (3, 7, 12, 5, 9, 4, 8, 6)]
    plain = [dict(temperature=0.0), dict(temperature=0.9), dict(temperature=1.2, top_k=5), dict(temperature=0.0),
             dict(temperature=0.8), dict(temperature=1.0, top_k=3)]
    cut = [dict(temperature=1.0, top_p=0.8), dict(temperature=0.7, min_p=0.05),
           dict(temperature=1.1, top_k=SCREENED_TOP_K + 1), dict(temperature=0.9, top_p=0.5, top_k=8),
           dict(temperature=0.6, top_p=0.95)]
    moved = [dict(temperature=0.0, logprobs=2), dict(temperature=0.0, presence_penalty=2.0, frequency_penalty=0.5),
             dict(temperature=0.0, logit_bias=((7, 3.0), (9, -2.0))),
             dict(temperature=0.9, top_k=4, repetition_penalty=1.3, logprobs=0)]
    # 8 rows a step (in 8 or 16 padded rows): two cut rows among six others, drawn apart (2 or 4
    # rows gathered), then five (the float32 head for all); then two rows with logprobs, penalties
    # or a logit bias among six plain ones, drawn apart
    batches = [plain + cut[:2], plain[:3] + cut, plain + moved[:2], plain + moved[2:]]
    results = []
    for engine in (screened, full):
        got = {}
        for b, batch in enumerate(batches):
            for i, (prompt, kw) in enumerate(zip(prompts, batch)):
                engine.add_request(f"b{b}r{i}", prompt, SamplingParams(seed=100 * b + i, max_tokens=6, ignore_eos=True, **kw))
            drain(engine, results=got)
            if engine is screened:  # the second batch's steps drew none apart, the others' their two rows
                assert (len(seen) >= 5 and set(seen) <= {2, 4}) if b != 1 else not seen, (b, seen)
            seen.clear()
        results.append(got)
    assert results[0].keys() == results[1].keys() and len(results[0]) == 32
    for key, out in results[0].items():
        assert out.token_ids == results[1][key].token_ids, key
        theirs = results[1][key].logprobs
        assert len(out.logprobs) == len(theirs) == (6 if key[0] in ("b2r6", "b3r7") else 0), key
        for ours, ref in zip(out.logprobs, theirs):  # the same row's logits from a gathered product
            assert ours["token_id"] == ref["token_id"] and [t[0] for t in ours["top"]] == [t[0] for t in ref["top"]]
            np.testing.assert_allclose([ours["logprob"]] + [t[1] for t in ours["top"]],
                                       [ref["logprob"]] + [t[1] for t in ref["top"]], rtol=1e-5, atol=1e-5)


def test_an_apart_variant_serves_only_steps_with_few_rows_apart():
    """A variant compiled to draw a few rows apart cannot serve a step with more such rows (its
    gather holds a quarter of the rows); the variant that takes the float32 head for all serves both."""
    from dataclasses import replace

    from worker.engine.variant_serves import serves
    from worker.engine.sampler import SamplerFlags

    everyone = SamplerFlags(all_greedy=False, needs_cut=True, top_p=True)
    apart = replace(everyone, apart=True)
    assert serves(everyone, apart) and serves(apart, apart) and not serves(apart, everyone)


def test_rows_asking_only_for_prompt_logprobs_stay_on_the_screened_head(model, tokenizer, monkeypatch):
    """Prompt logprobs come from every prompt token's logits, not from the sampled rows', so a
    request asking only for those leaves its steps wholly on the screened head, and its decode
    steps compute no prompt logits at all. Its tokens and prompt logprobs are the float32 head's."""
    screened = LLMEngine(model, tokenizer, EngineConfig(**SIZES))
    if screened.greedy_head == "full":  # nothing to screen on a CPU without AVX512-BF16 or VNNI
        return
    full = LLMEngine(model, tokenizer, EngineConfig(**SIZES, greedy_head="full"))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, len(tokenizer), n).tolist() for n in (6, 9, 1, 7, 11, 5)]
    kinds = [dict(temperature=0.0, prompt_logprobs=2), dict(temperature=0.9, prompt_logprobs=0),
             dict(temperature=0.0, prompt_logprobs=3), dict(temperature=0.0), dict(temperature=0.8), dict()]
    results, steps, real_sample = [], [], head_choice.sample
    for engine in (screened, full):
        float32_head: list[int] = []

        def sample(logits, st, flags, kernels, seen=float32_head):
            jax.debug.callback(lambda n: seen.append(int(n)), logits.shape[0])
            return real_sample(logits, st, flags, kernels)

        monkeypatch.setattr(head_choice, "sample", sample)
        real_post = engine._postprocess

        def postprocess(flight, real_post=real_post):  # which steps computed every token's logits, for whom
            past = all(c is None or c.start >= c.seq.num_prompt_tokens for c in flight.rows)
            steps.append((flight.shape.prompt_logprobs, past))
            return real_post(flight)

        monkeypatch.setattr(engine, "_postprocess", postprocess)
        for i, (prompt, kw) in enumerate(zip(prompts, kinds)):
            engine.add_request(f"r{i}", prompt, SamplingParams(seed=i, max_tokens=6, ignore_eos=True, **kw))
        results.append(drain(engine))
        if engine is screened:
            assert not float32_head, float32_head
        else:
            assert float32_head
    assert any(prompt for prompt, _ in steps) and any(past for _, past in steps)
    assert not any(prompt and past for prompt, past in steps), "a decode step computed prompt logits"
    for key, out in results[0].items():
        ref = results[1][key]
        assert out.token_ids == ref.token_ids, key
        if kinds[int(key[0][1:])].get("prompt_logprobs") is None:
            assert out.prompt_logprobs is None, key
            continue
        assert len(out.prompt_logprobs) == len(ref.prompt_logprobs) == len(prompts[int(key[0][1:])]), key
        assert out.prompt_logprobs[0] is None and ref.prompt_logprobs[0] is None
        for ours, theirs in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert ours["token_id"] == theirs["token_id"] and [t[0] for t in ours["top"]] == [t[0] for t in theirs["top"]]
            np.testing.assert_allclose([ours["logprob"]] + [t[1] for t in ours["top"]],
                                       [theirs["logprob"]] + [t[1] for t in theirs["top"]], rtol=1e-5, atol=1e-5)
    # a one-token prompt alone: nothing to predict, so no step computes prompt logits; the answer
    # still holds the first token's None
    screened.add_request("one", prompts[2], SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert drain(screened)[("one", 0)].prompt_logprobs == [None]
