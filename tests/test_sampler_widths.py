"""Penalty and logit-bias arrays: their widths are part of a step variant's key, so they decide how
often a request with penalties or logit bias makes the worker compile (sampler_widths, runner.serves)."""

from __future__ import annotations

import dataclasses

from tests.engine_support import ROOMY, drain, hf_greedy, tokenizer  # noqa: F401 (a fixture)
from tests.test_engine import hf, make_engine, model, prompts, random_ckpt  # noqa: F401 (fixtures)
from worker.engine.batch import bucket
from worker.engine.sampling_params import SamplingParams


def test_a_penalised_request_runs_in_one_variant_as_its_output_grows(model, tokenizer, hf, prompts):
    """Its output-id columns are sized for its max_tokens from the first step, so 150 tokens meet
    one decode variant, where a width sized to the tokens so far compiled one at 64, 128 and 256
    (on a GPU 25-60 s each). A request with fewer tokens and a shorter prompt then runs in the
    wider variants, compiling nothing. Tokens: generate's."""
    engine = make_engine(model, tokenizer, ROOMY, decode_steps=4)
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=150, ignore_eos=True)
    engine.add_request("long", prompts[5], penalised)
    got = drain(engine)[("long", 0)].token_ids
    assert got == hf_greedy(hf, prompts[5], 150, repetition_penalty=1.3)
    widths = {f.widths for _, f in engine.runner.compiled if f.penalties}
    assert widths == {(256, bucket(len(prompts[5])), 1)}, widths
    compiled = engine.runner.compiles.reading()[0]
    short = dataclasses.replace(penalised, max_tokens=20)
    engine.add_request("short", prompts[1], short)
    assert drain(engine)[("short", 0)].token_ids == hf_greedy(hf, prompts[1], 20, repetition_penalty=1.3)
    assert len(prompts[1]) < len(prompts[5]) and engine.runner.compiles.reading()[0] == compiled


def test_logit_bias_requests_of_up_to_64_entries_share_their_variants(model, tokenizer, prompts):
    """A variant's bias arrays are at least 64 entries wide, so a request with 20 entries after one
    with 2 compiles nothing; each request's tokens are those of an engine that ran it alone."""
    engine = make_engine(model, tokenizer, ROOMY, decode_steps=4)
    few = SamplingParams(temperature=0.0, logit_bias=((5, 3.0), (9, -2.0)), max_tokens=10, ignore_eos=True)
    many = dataclasses.replace(few, logit_bias=tuple((t, 0.5 * (t % 3)) for t in range(3, 23)))
    engine.add_request("few", prompts[4], few)
    got = drain(engine)[("few", 0)].token_ids
    compiled = engine.runner.compiles.reading()[0]
    engine.add_request("many", prompts[4], many)
    assert drain(engine)[("many", 0)].token_ids == _alone(model, tokenizer, prompts[4], many)
    assert engine.runner.compiles.reading()[0] == compiled
    assert got == _alone(model, tokenizer, prompts[4], few)


def _alone(model, tokenizer, prompt: list[int], params: SamplingParams) -> list[int]:
    engine = make_engine(model, tokenizer, ROOMY, decode_steps=4)
    engine.add_request("alone", prompt, params)
    return drain(engine)[("alone", 0)].token_ids
