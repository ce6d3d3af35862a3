"""Prompt-lookup speculation (`EngineConfig.speculative_tokens`): drafts from a sequence's own
tokens, checked in the step that computes them. Greedy tokens equal transformers' `generate`;
seeded sampled tokens, logprobs, stop tokens and length limits equal an engine without drafts;
pages all come back. On the tiny random Qwen2 checkpoint of test_engine.py (its upper layer's
sliding window crosses the drafts' rows); `bench offline` with drafts on a tiny Llama."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from tests.bench_support import run_bench
from tests.engine_support import ROOMY, collect, drain, hf_greedy, tokenizer  # noqa: F401 (a fixture)
from tests.test_engine import (SIZES, assert_pages_returned, hf, make_engine, model, random_ckpt,  # noqa: F401 (fixtures)
                               record_chunks)
from tests.test_bench import tiny_model  # noqa: F401 (a fixture)
from tests.test_engine_seeds import random_requests
from worker.engine import cpu_attention, paged_attention, speculation
from worker.engine.config import EngineConfig
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import ScheduledChunk
from worker.engine.sequence import Sequence
from worker.engine.speculation import DraftIndex, accepted

GEN = 24


class Drafts:
    """A draft gate that always lets drafts in, whatever the calls took (draft_gate.py): these tests
    of speculation's mechanics then schedule the same steps on any host."""

    def drafts(self, num_seqs: int) -> bool:
        return True

    def record(self, *call) -> None:
        pass


def spec_engine(model, tokenizer, sizes: dict, gate=None, **overrides):  # noqa: F811
    engine = make_engine(model, tokenizer, sizes, **overrides)
    engine.scheduler.gate = gate or Drafts()
    return engine


def propose(tokens: list[int], k: int, **sizes) -> list[int]:
    seq = Sequence(0, "r", list(tokens), SamplingParams())
    return DraftIndex(**sizes).propose(seq, k)


def test_drafts_are_what_followed_the_latest_longest_earlier_run():
    assert propose([5, 6, 7, 8, 5, 6, 7], 3) == [8, 5, 6]  # the run 5 6 7 occurred before: 8 5 6 followed it
    assert propose([1, 2, 3, 9, 1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]  # the latest earlier "1 2 3", not the first
    assert propose([1, 2, 3, 9, 2, 3, 4, 7, 2, 3], 5, n_max=3, n_min=2) == [4, 7, 2, 3, 4]  # 2 3: the longest match
    assert propose([4, 4, 4, 4, 4], 3) == [4, 4, 4]  # the run overlapping its own end: a loop, going on
    assert propose([1, 2, 3, 1, 2, 3, 1], 5, n_min=1) == [2, 3, 1, 2, 3]  # what followed it (2 3 1), repeated
    assert propose([1, 2, 3, 4, 5], 3) == []  # nothing repeats
    assert propose([7, 3, 9, 7, 3], 3) == []  # two tokens match too often to guess well (NGRAM_MIN 3)
    assert propose([5, 6, 7, 5, 6, 7], 0) == []


def test_the_index_follows_a_growing_sequence():
    """Proposals from the index kept across steps equal a search of the whole sequence each time."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 4, 300).tolist()  # four ids: runs repeat often
    seq, index = Sequence(0, "r", tokens[:5], SamplingParams()), DraftIndex()
    for size in range(5, 300):
        assert index.propose(seq, 4) == search(tokens[:size], 4), size
        seq.output_token_ids.append(tokens[size])


def search(tokens: list[int], k: int) -> list[int]:
    """The reference: the last n tokens looked for in the whole sequence, latest match first."""
    for n in (4, 3):
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == tokens[-n:]:
                return [tokens[end + 1 + i % (len(tokens) - 1 - end)] for i in range(k)]
    return []


def test_accepted_counts_the_drafts_up_to_the_first_miss():
    assert accepted((3, 4, 5), [3, 4, 5, 6]) == 3
    assert accepted((3, 4, 5), [3, 9, 5, 6]) == 1
    assert accepted((3,), [8, 1]) == 0


def repeating_prompts(vocab: int, count: int) -> list[list[int]]:
    """Prompts holding runs they repeat (drafts to find), random otherwise."""
    rng = np.random.default_rng(3)
    out = []
    for i in range(count):
        run = rng.integers(1, vocab, 5 + i).tolist()
        out.append(rng.integers(1, vocab, i).tolist() + run + rng.integers(1, vocab, 3).tolist() + run[:3])
    return out


def record_cuts(monkeypatch) -> list[int]:
    """Spy on `speculation.settle`: for each newer chunk whose rows a check took back, how many of
    them still count (0: none, a draft before them fell; 1: its own, the token it guessed was wrong)."""
    cuts, settle = [], speculation.settle

    def spy(seq, chunk, drawn):
        out = settle(seq, chunk, drawn)
        if seq.cut is not None and seq.cut[0] is not chunk:
            cuts.append(seq.cut[1])
        return out

    monkeypatch.setattr(speculation, "settle", spy)
    return cuts


@pytest.mark.parametrize("path", ["kernel", "jnp", "read back each step"])
def test_greedy_tokens_equal_generate_with_drafts_kept_and_rejected(model, tokenizer, hf, path, monkeypatch):  # noqa: F811
    """Steps overlap: drafts are looked up while the step before is in flight, past its drafts and
    past a guess of its last token; rows resting on a draft or a guess that fell are taken back."""
    extra = {"kernel": {}, "jnp": dict(attention="jnp", matmul="xla"), "read back each step": dict(async_overlap=False)}
    engine = spec_engine(model, tokenizer, ROOMY, speculative_tokens=4, **extra[path])
    if path == "jnp":
        assert engine.runner.attention.name == paged_attention.JNP.name
    else:
        assert engine.runner.attention.name == cpu_attention.KERNEL.name
    chunks, overlapped, cuts = record_chunks(engine), [], record_cuts(monkeypatch)
    free = engine.allocator.num_free_pages
    prompts = repeating_prompts(len(tokenizer), 6)
    params = dict(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(**params))
    results = drain(engine, lambda k: overlapped.append(engine._inflight is not None))
    for i, p in enumerate(prompts):
        assert results[(f"r{i}", 0)].token_ids == hf_greedy(hf, p, GEN), f"prompt {i}"
        assert results[(f"r{i}", 0)].finish_reason == "length"
    # drafts both stood and fell; decode steps where no sequence had any were fused as without speculation
    assert 0 < engine.num_accepted_tokens < engine.num_draft_tokens
    assert any(c["drafts"] for c in chunks) and any(c["steps"] > 1 for c in chunks)
    assert not any(c["drafts"] and c["steps"] > 1 for c in chunks)
    if path == "read back each step":
        assert not any(overlapped) and not cuts and not any(c["guess"] for c in chunks)
    else:  # drafts on a guess, some of them taken back whole, some down to their chunk's own row
        assert all(overlapped[1:-1]) and any(c["guess"] and c["drafts"] for c in chunks)
        assert 0 in cuts and 1 in cuts, cuts
    assert_pages_returned(engine, free)


def run(model, tokenizer, requests, sizes, **overrides):  # noqa: F811
    engine = spec_engine(model, tokenizer, sizes, **overrides)
    free = engine.allocator.num_free_pages
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"q{i}", prompt, params)
    results = drain(engine)
    assert_pages_returned(engine, free)
    return results, engine


@pytest.mark.parametrize("sizes", ["roomy", "tight"])
def test_sampled_tokens_logprobs_and_stops_equal_an_engine_without_drafts(model, tokenizer, sizes):  # noqa: F811
    """Seeded draws at each draft's own output index: the same tokens as one step at a time, with
    top-k, top-p, min-p, n = 2, logprobs, a penalty (no drafts), stop tokens and max_tokens inside
    a run of kept drafts; in the tight pages too (drafts short of pages, preemption)."""
    vocab = len(tokenizer)
    prompts = repeating_prompts(vocab, 5)
    others = random_requests(np.random.default_rng(7), 5, vocab)
    # the oldest (first to take spare rows for drafts): a draw between two tokens the bias lifts far above
    # the rest, one about 9 times in 10, so drafts of its runs often stand, and the tokens are the same
    # only if each draft's row drew with its own output index's key (rows sharing one key draw alike)
    coin = SamplingParams(temperature=5.0, logit_bias=((11, 100.0), (12, 90.0)), max_tokens=120, seed=5,
                          ignore_eos=True, logprobs=1)
    requests = [([11, 12, 12, 11, 12], coin)]
    for i, (prompt, (_, params)) in enumerate(zip(prompts, others)):
        params = dataclasses.replace(params, max_tokens=8 + 3 * i, logprobs=2 if i % 3 == 0 else None)
        if i == 4:
            params = dataclasses.replace(params, presence_penalty=0.5)
        requests.append((prompt, params))
    base, _ = run(model, tokenizer, requests, SIZES[sizes], decode_steps=1)
    # stop tokens where the runs above went: each ends a request partway
    stops = {i: base[(f"q{i}", 0)].token_ids[4] for i in (1, 2, 5)}
    requests = [(p, dataclasses.replace(sp, stop_token_ids=(stops[i],)) if i in stops else sp)
                for i, (p, sp) in enumerate(requests)]
    base, _ = run(model, tokenizer, requests, SIZES[sizes], decode_steps=1)
    got, engine = run(model, tokenizer, requests, SIZES[sizes], speculative_tokens=3)
    assert engine.num_accepted_tokens >= 8, engine.num_accepted_tokens
    assert got.keys() == base.keys()
    for key, want in base.items():
        have = got[key]
        assert (have.token_ids, have.finish_reason, have.stop_reason) == \
            (want.token_ids, want.finish_reason, want.stop_reason), key
        assert [e["token_id"] for e in have.logprobs] == [e["token_id"] for e in want.logprobs]
        for a, b in zip(have.logprobs, want.logprobs):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
            assert [t for t, _ in a["top"]] == [t for t, _ in b["top"]]
    assert any(base[(f"q{i}", 0)].finish_reason == "stop" for i in stops)
    if sizes == "tight":
        assert engine.scheduler.num_preemptions > 0


def drafts_of_next_step(model, tokenizer, max_num_seqs: int, requests: dict) -> dict:  # noqa: F811
    """Each request's drafts in the step after its prompt's, its first token set to repeat the prompt."""
    engine = spec_engine(model, tokenizer, ROOMY, speculative_tokens=4, max_num_seqs=max_num_seqs)
    for request_id, params in requests.items():
        engine.add_request(request_id, [9, 8, 7, 6, 9, 8, 7, 6, 9, 8], params)
    engine.step()  # the prompts, each sampling its first token (read back: no async overlap)
    for seq in engine.scheduler.running:  # the last four tokens 6 9 8 7 occurred before: 6 9 8 7 followed
        seq.output_token_ids[-1] = 7
    return {c.seq.request_id: c.drafts for c in engine.scheduler.schedule().chunks}


def test_drafts_take_spare_rows_oldest_first_within_room_and_never_with_penalties(model, tokenizer):  # noqa: F811
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    short = dataclasses.replace(plain, max_tokens=3)  # after its first token, room for 2: 1 draft and its check
    penalised = dataclasses.replace(plain, repetition_penalty=1.2)
    assert drafts_of_next_step(model, tokenizer, 8, {"a": plain, "b": short, "c": penalised}) == {
        "a": (6, 9, 8, 7), "b": (6,), "c": ()}
    # 4 rows at most: the three chunks leave one, the oldest takes it
    assert drafts_of_next_step(model, tokenizer, 4, {"a": plain, "b": plain, "c": plain}) == {
        "a": (6,), "b": (), "c": ()}
    assert drafts_of_next_step(model, tokenizer, 3, {"a": plain, "b": plain, "c": plain}) == {
        "a": (), "b": (), "c": ()}  # a full batch: none


def test_a_full_batch_runs_as_without_drafts(model, tokenizer):  # noqa: F811
    """No spare rows: no drafts, fused steps launched before the step before is read back."""
    engine = spec_engine(model, tokenizer, ROOMY, speculative_tokens=4, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", [9, 8, 7, 6, 9, 8, 7, 6, 9, 8], params)
    chunks, overlapped = record_chunks(engine), []
    drain(engine, lambda k: overlapped.append(engine._inflight is not None))
    assert engine.num_draft_tokens == 0 and not any(c["drafts"] for c in chunks)
    assert sum(overlapped) >= 2 and any(c["steps"] > 1 for c in chunks)


def test_a_lookup_that_finds_nothing_waits_longer_each_time(model, tokenizer, monkeypatch):  # noqa: F811
    """A sequence whose lookups never find anything looks again 8, 16, 32 ... tokens on, its steps
    overlapped and fused meanwhile."""
    looked = []
    monkeypatch.setattr(DraftIndex, "propose", lambda self, seq, k, tail=(): looked.append(seq.num_tokens) or [])
    engine = spec_engine(model, tokenizer, ROOMY, speculative_tokens=4)
    engine.add_request("r", list(range(40, 60)), SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True))
    chunks, overlapped = record_chunks(engine), []
    drain(engine, lambda k: overlapped.append(engine._inflight is not None))
    assert not engine.has_unfinished() and engine.num_draft_tokens == 0
    gaps = np.diff(looked).tolist()
    assert len(looked) == 4 and all(w <= g <= w + 7 for g, w in zip(gaps, (8, 16, 32))), looked  # (+ fused steps)
    assert all(overlapped[1:-1]) and any(c["steps"] > 1 for c in chunks)


def test_config_checks_speculative_tokens():
    for bad in (-1, 17):
        with pytest.raises(ValueError, match="speculative_tokens"):
            EngineConfig(speculative_tokens=bad)
    assert EngineConfig(speculative_tokens=16).for_backend("cpu").async_overlap
    assert ScheduledChunk(None, 0, 1, True, 1, (5, 6)).is_decode


def test_aborts_with_drafts_in_flight_leave_the_others_as_they_were(model, tokenizer):  # noqa: F811
    """The first two requests seen with drafts in flight (and maybe a guess past them) are aborted
    there: the others' tokens are those of an engine without drafts, no output follows an end, and
    every page comes back."""
    prompts = repeating_prompts(len(tokenizer), 6)
    params = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    base, _ = run(model, tokenizer, [(p, params) for p in prompts], ROOMY, decode_steps=1)
    engine = spec_engine(model, tokenizer, ROOMY, speculative_tokens=4)
    free = engine.allocator.num_free_pages
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params)
    got, aborted = {}, []

    def abort(k):
        for seq in list(engine.scheduler.running):
            if len(aborted) < 2 and seq.num_in_flight and seq.last_chunk.drafts:
                aborted.append(seq.request_id)
                collect(got, engine.abort(seq.request_id))

    drain(engine, abort, got)  # (collect: no output for a request after its end)
    assert len(aborted) == 2
    for (request_id, _), choice in got.items():
        want = "abort" if request_id in aborted else "length"
        assert choice.finish_reason == want, request_id
        if request_id not in aborted:
            assert choice.token_ids == base[(request_id, 0)].token_ids, request_id
    assert_pages_returned(engine, free)


def test_offline_with_drafts_gives_transformers_tokens_and_compiles_nothing_during_the_run(tiny_model):  # noqa: F811
    """How many rows a step with drafts has follows which drafts stood, which the plan's zeros do
    not foretell: every rung is compiled ahead, as a worker's warm-up does (llama-100m at 8 x
    128/128 compiled 3 variants during its timed round before)."""
    code, out = run_bench("offline", "--model", str(tiny_model), "--num-prompts", "6", "--input-len", "8",
                          "--output-len", "40", "--decode-steps", "1", "--speculative-tokens", "4",
                          "--compare", "hf", "--hf-batch-size", "6", "--json")
    report = json.loads(out)
    assert code == 0 and report["compiles_during_run"] == 0
    assert report["draft_tokens"] > report["accepted_tokens"] > 0, report["draft_tokens"]
    assert report["greedy_match_fraction"] == 1.0
