"""Greedy outputs when KV pages run short, against transformers' `generate` on the tiny random
Qwen2 checkpoint of test_engine.py."""

from __future__ import annotations

from tests.engine_support import drain, hf_greedy, tokenizer  # noqa: F401 (a fixture)
from tests.test_engine import TIGHT, hf, make_engine, model, prompts, random_ckpt  # noqa: F401 (fixtures)
from worker.engine.sampling_params import SamplingParams


def test_a_fused_row_given_fewer_steps_feeds_its_own_newest_token_on(model, tokenizer, hf, prompts):  # noqa: F811
    """Pages short, a fused decode call gives a row fewer steps than the call's; the row's later
    steps sample nonsense (their writes go to the reserved page). The next step, launched before
    the call is read back, must take the row's token from its own last step. It took the call's
    last step's, so the model saw a wrong token while the client got the right one, and greedy
    outputs left transformers' (session 50: 6 of 128 demo requests of 1000 tokens, 48 KV pages;
    here 2 of 3). Nothing waits, so decodes fuse while three sequences share 19 pages."""
    gen = 30
    engine = make_engine(model, tokenizer, TIGHT, decode_steps=8)
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    for i, p in enumerate(prompts[:3]):
        engine.add_request(f"r{i}", p, params)
    results = drain(engine)
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts[:3]):
        assert results[(f"r{i}", 0)].token_ids == hf_greedy(hf, p, gen), f"prompt {i}"
