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
from worker.engine import cpu_matmul, head_choice
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
    v = 100
    st = type("St", (), {})()
    st.temperature = np.array([0.0, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.0], np.float32)
    st.top_p = np.array([0.5, 1.0, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0], np.float32)
    st.min_p = np.array([0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.0], np.float32)
    top = SCREENED_TOP_K
    st.top_k = np.array([0, 0, 0, 0, top, top + 1, v, top + 1], np.int32)
    # greedy rows never (a cut keeps the largest logit); top-p, min-p and a top-k past SCREENED_TOP_K
    # short of the vocabulary do
    np.testing.assert_array_equal(np.asarray(head_choice.needs_logits(st, v)),
                                  [False, False, True, True, False, True, False, False])


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


def test_few_cut_rows_are_drawn_apart_and_all_rows_draw_the_float32_heads_tokens(model, tokenizer, monkeypatch):
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
    # 8 rows a step (in 8 or 16 padded rows): two cut rows among six others, drawn apart (2 or 4
    # rows gathered), then five (the float32 head for all)
    batches = [plain + cut[:2], plain[:3] + cut]
    results = []
    for engine in (screened, full):
        got = {}
        for b, batch in enumerate(batches):
            for i, (prompt, kw) in enumerate(zip(prompts, batch)):
                engine.add_request(f"b{b}r{i}", prompt, SamplingParams(seed=100 * b + i, max_tokens=6, ignore_eos=True, **kw))
            drain(engine, results=got)
            if engine is screened:  # the first batch's steps drew its two cut rows apart, the second's none
                assert (len(seen) >= 5 and set(seen) <= {2, 4}) if b == 0 else not seen, (b, seen)
            seen.clear()
        results.append(got)
    assert results[0].keys() == results[1].keys() and len(results[0]) == 16
    for key, out in results[0].items():
        assert out.token_ids == results[1][key].token_ids, key


def test_an_apart_variant_serves_only_steps_with_few_rows_apart():
    """A variant compiled to draw a few rows apart cannot serve a step with more such rows (its
    gather holds a quarter of the rows); the variant that takes the float32 head for all serves both."""
    from dataclasses import replace

    from worker.engine.runner import serves
    from worker.engine.sampler import SamplerFlags

    everyone = SamplerFlags(all_greedy=False, needs_cut=True, top_p=True)
    apart = replace(everyone, apart=True)
    assert serves(everyone, apart) and serves(apart, apart) and not serves(apart, everyone)


def test_the_hosts_count_of_rows_apart_is_the_devices():
    """sampler.needs_logits (the host's, which sets SamplerFlags.apart) and head_choice.needs_logits
    (the device's, which picks the rows) agree on every kind of row."""
    from worker.engine import sampler

    v = 1000
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, min_p=m)
              for t in (0.0, 0.8) for p in (1.0, 0.9) for k in (0, 5, SCREENED_TOP_K,
                                                               SCREENED_TOP_K + 1, v - 1) for m in (0.0, 0.2)]
    st = type("St", (), {})()
    st.temperature = np.array([p.temperature for p in params], np.float32)
    st.top_p = np.array([p.top_p for p in params], np.float32)
    st.top_k = np.array([p.top_k for p in params], np.int32)
    st.min_p = np.array([p.min_p for p in params], np.float32)
    np.testing.assert_array_equal(np.asarray(head_choice.needs_logits(st, v)), [sampler.needs_logits(p) for p in params])
