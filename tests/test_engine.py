"""LLMEngine end to end on a tiny random Qwen2 checkpoint (sliding window on its upper layer,
which crosses pages) with a byte-level BPE tokenizer trained here, against references written
elsewhere: transformers' `generate` for greedy tokens, the torch forward for logprobs.
Stop conditions and streamed text: test_engine_text.py.

Engines share two KV shapes (ROOMY, TIGHT) and max_num_seqs 8 so few step variants compile.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.engine_support import ROOMY, Choice, collect, drain, hf_greedy, tokenizer  # noqa: F401 (a fixture)
from tests.hf_models import make_hf_model
from worker.engine import cpu_attention, cpu_matmul, llm_engine, paged_attention
from worker.engine.config import EngineConfig
from worker.engine.llm import LLM
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.models.loader import load_model

PROMPT_LENGTHS = (1, 3, 6, 11, 17, 24, 30, 41)
GEN = 16  # new tokens per prompt in the greedy runs
TIGHT = dict(max_num_seqs=8, page_size=4, num_pages=20, max_num_batched_tokens=16, decode_steps=4)  # 19 usable pages: 76 tokens
SIZES = {"roomy": ROOMY, "tight": TIGHT, "tight-thread": {**TIGHT, "launch_thread": True}}
SAMPLED = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, max_tokens=12, ignore_eos=True)  # one sampler variant


# ---- checkpoints ----

@pytest.fixture(scope="module")
def random_ckpt(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    hf = make_hf_model("qwen2", path, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def model(random_ckpt):
    return load_model(random_ckpt[0])


@pytest.fixture(scope="module")
def hf(random_ckpt):
    return random_ckpt[1]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, len(tokenizer), n).tolist() for n in PROMPT_LENGTHS]


def hf_logprobs(hf, tokens: list[int]) -> np.ndarray:
    """Log-softmax of the torch forward at every position: f32[L, V]."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].double(), dim=-1).numpy()


@pytest.fixture(scope="module")
def greedy_refs(hf, prompts) -> list[list[int]]:
    return [hf_greedy(hf, p, GEN) for p in prompts]


# ---- driving an engine ----

def make_engine(model, tokenizer, sizes: dict, **overrides) -> LLMEngine:
    return LLMEngine(model, tokenizer, EngineConfig(**{**sizes, **overrides}))


def record_chunks(engine: LLMEngine) -> list[dict]:
    """Spy on the scheduler: every scheduled chunk, as it was when scheduled."""
    log: list[dict] = []
    schedule = engine.scheduler.schedule

    def spy(*args, **kwargs):
        batch = schedule(*args, **kwargs)
        for c in batch.chunks if batch else []:
            log.append(dict(seq=c.seq.seq_id, start=c.start, n=c.num_tokens, samples=c.samples, steps=c.num_steps,
                            prompt=c.seq.num_prompt_tokens, known=c.seq.num_known_tokens, drafts=len(c.drafts),
                            guess=c.guess is not None))
        return batch

    engine.scheduler.schedule = spy
    return log


def record_splits(engine: LLMEngine) -> list[str]:
    """Spy on the runner: per step with prefill, "packed" (chunks back to back, one row each),
    "split" (some chunk over several rows of the row layout) or "whole"."""
    log: list[str] = []
    dispatch = engine.runner.dispatch

    def spy(batch):
        flight = dispatch(batch)
        longest = max((c.num_tokens for c in batch.chunks if c.num_tokens > 1), default=0)
        if longest:
            log.append("packed" if flight.shape.packed else "split" if flight.shape.prefill_len < longest else "whole")
        return flight

    engine.runner.dispatch = spy
    return log


def assert_pages_returned(engine: LLMEngine, free_at_start: int) -> None:
    alloc = engine.allocator
    assert alloc.num_free_pages == free_at_start
    assert all(alloc.refcount(p) == 0 for p in range(alloc.num_pages))
    assert not engine.has_unfinished() and not engine._groups and not engine._tracks


# ---- 1. greedy batches equal transformers, also chunked and preempted ----

# the last: the accelerators' default, every call launched from the helper thread (`launch_thread`)
@pytest.mark.parametrize("sizes,overlap,decode_steps", [(s, o, d) for s in ("roomy", "tight") for o in (True, False)
                                                        for d in (1, 4)] + [("tight-thread", True, 4), ("tight", None, 4)])
def test_greedy_batch_equals_generate_per_prompt(model, tokenizer, prompts, greedy_refs, sizes, overlap, decode_steps):
    engine = make_engine(model, tokenizer, SIZES[sizes], async_overlap=overlap, decode_steps=decode_steps)
    chunks = record_chunks(engine)
    free = engine.allocator.num_free_pages
    params = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    results = drain(engine)
    for i in range(len(prompts)):
        got = results[(f"r{i}", 0)]
        assert got.token_ids == greedy_refs[i], f"prompt {i} ({len(prompts[i])} tokens)"
        assert got.finish_reason == "length"
    assert_pages_returned(engine, free)
    split = [c for c in chunks if c["n"] > 1 and not c["samples"] and c["start"] + c["n"] < c["prompt"]]
    resumed = [c for c in chunks if c["n"] > 1 and 0 < c["start"] < c["prompt"]]
    assert (engine.runner._launcher is not None) == (sizes == "tight-thread")
    if sizes != "roomy":
        assert engine.scheduler.num_preemptions > 0
        assert split and resumed, "no prompt was prefilled in several chunks"
    else:
        assert engine.scheduler.num_preemptions == 0 and not split
    assert any(c["steps"] > 1 for c in chunks) == (decode_steps > 1)
    assert engine.runner.attention is cpu_attention.KERNEL  # "auto" on CPU: the kernel, decode and prefill rows
    assert engine.matmul == ("kernel" if cpu_matmul.has_cpu_flag("avx512f") else "xla")  # "auto", float32 weights


@pytest.mark.parametrize("window_ms, steps", [(1e9, 16), (1e-3, 1)], ids=["wide", "narrow"])
def test_auto_decode_steps_fill_the_window_and_keep_greedy_outputs(model, tokenizer, prompts, greedy_refs, window_ms,
                                                                   steps):
    """decode_steps auto: timed single steps at a full batch, then as many fused as the window
    holds (clamped to 1..16: no figure here depends on how fast this machine is). The throwaway
    requests leave nothing behind, and generation with the chosen count still equals transformers."""
    engine = make_engine(model, tokenizer, ROOMY, decode_window_ms=window_ms)
    assert engine.config.decode_steps is None and engine.decode_steps == 8  # auto, before any timing
    free = engine.allocator.num_free_pages
    assert engine.calibrate_decode_steps() == steps
    assert engine.decode_steps == engine.runner.fused_steps == steps and engine.decode_step_s > 0
    assert (engine.num_steps, engine.num_generated_tokens, engine.num_prompt_tokens) == (0, 0, 0)
    assert not engine.has_unfinished() and engine.allocator.num_free_pages == free
    assert engine.calibrate_decode_steps() == steps  # once: the warm-up calls it again
    chunks = record_chunks(engine)
    params = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    results = drain(engine)
    assert [results[(f"r{i}", 0)].token_ids for i in range(len(prompts))] == greedy_refs
    assert max(c["steps"] for c in chunks) == min(steps, GEN - 1)  # the prefill samples the first token
    assert_pages_returned(engine, free)


def test_fixed_decode_steps_are_never_timed(model, tokenizer):
    engine = make_engine(model, tokenizer, ROOMY, decode_steps=3, decode_window_ms=1e-3)
    assert engine.calibrate_decode_steps() == 3 and engine.decode_step_s is None
    assert engine.num_steps == 0 and not engine.runner.compiled


def test_greedy_batch_equals_generate_on_the_jnp_attention_and_xla_matmul_path(model, tokenizer, prompts, greedy_refs):
    engine = make_engine(model, tokenizer, SIZES["tight"], decode_steps=4, attention="jnp", matmul="xla")
    assert engine.runner.attention is paged_attention.JNP and engine.matmul == "xla"
    params = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    results = drain(engine)
    assert [results[(f"r{i}", 0)].token_ids for i in range(len(prompts))] == greedy_refs


def test_context_limit_ends_with_length(model, tokenizer, prompts, greedy_refs):
    engine = make_engine(model, tokenizer, ROOMY, max_model_len=24)
    free = engine.allocator.num_free_pages
    unlimited = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    engine.add_request("short", prompts[4], unlimited)  # 17 tokens: 7 more fit
    engine.add_request("full", prompts[5], unlimited)  # 24 tokens: nothing fits
    engine.add_request("capped", prompts[2], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    with pytest.raises(ValueError, match="allows 24"):
        engine.add_request("long", prompts[6], unlimited)
    results = drain(engine)
    assert results[("short", 0)].token_ids == greedy_refs[4][:7]
    assert results[("full", 0)].token_ids == []
    assert results[("capped", 0)].token_ids == greedy_refs[2][:5]
    assert {r.finish_reason for r in results.values()} == {"length"}
    assert_pages_returned(engine, free)


@pytest.mark.parametrize("short_call_s", [0.0, 60.0], ids=["long-calls", "short-calls"])
def test_auto_overlap_dispatches_ahead_only_while_a_new_request_could_not_start(model, tokenizer, prompts, greedy_refs,
                                                                                short_call_s, monkeypatch):
    """The CPU's default (async_overlap None): a step stays in flight while the next is launched only
    while every sequence slot is taken or requests wait; with a slot free a new arrival starts at the
    next call, not behind one more dispatched ahead. Overlap ends with a step that only reads back the
    call in flight, so its tokens do not wait for another call. Calls shorter than SHORT_CALL_S (this
    test model's are all shorter than a minute, none shorter than 0 s) are dispatched ahead anyway.
    The tokens are those of every other mode."""
    monkeypatch.setattr(llm_engine, "SHORT_CALL_S", short_call_s)
    engine = make_engine(model, tokenizer, ROOMY, max_num_seqs=3, decode_steps=4)
    assert engine.config.async_overlap is None
    for i in range(5):  # ends apart: slots free up one by one
        engine.add_request(f"r{i}", prompts[i], SamplingParams(temperature=0.0, max_tokens=GEN - 3 * i, ignore_eos=True))
    results: dict = {}
    kinds = set()

    def full() -> bool:  # a request arriving now could not start at the next step
        return engine.num_waiting > 0 or engine.num_running >= 3

    while engine.has_unfinished():
        before, full_before, launched = engine._inflight, full(), engine.num_steps
        collect(results, engine.step())
        launched, after = engine.num_steps > launched, engine._inflight
        if before is not None and not full_before and not short_call_s:
            assert not launched and after is None  # overlap ends: read back, nothing launched
            kinds.add("ends")
        elif launched and (before is None or short_call_s):
            assert (after is not None) == (full() or short_call_s > 0)
            kinds.add("ahead" if after is not None else "read back at once")
        elif launched:
            assert after is not None and after is not before  # overlap goes on
    assert kinds == ({"ends", "ahead", "read back at once"} if not short_call_s else {"ahead"})
    for i in range(5):
        assert results[(f"r{i}", 0)].token_ids == greedy_refs[i][:GEN - 3 * i]


def test_at_light_load_long_prompts_go_in_pieces_of_the_prompt_cap(model, tokenizer, prompts, greedy_refs):
    """At light load (a few streams decoding, at most one request waiting), a step takes at most
    `Scheduler.prompt_cap` prompt tokens, so the streams' next tokens do not wait for a newcomer's
    whole prompt; decode steps fuse again once it is in; the tokens are transformers' greedy ones."""
    engine = make_engine(model, tokenizer, ROOMY, decode_steps=4)
    free = engine.allocator.num_free_pages
    engine.scheduler.prompt_cap = 8
    steps: list[tuple[int, bool, int]] = []  # (prompt tokens, a stream decoded in it, fused steps)
    schedule = engine.scheduler.schedule

    def spy(*args, **kwargs):
        streaming = any(seq.num_output_tokens for seq in engine.scheduler.running)
        batch = schedule(*args, **kwargs)
        if batch is not None and batch.chunks:
            steps.append((sum(c.num_tokens for c in batch.chunks if c.num_tokens > 1), streaming, batch.num_steps))
        return batch

    engine.scheduler.schedule = spy
    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731

    pending = [7, 6, 5]

    def arrive(k: int) -> None:  # one newcomer at a time (light load), each once the last one's prompt is in
        if k == 0:
            engine.add_request("stream", prompts[1], greedy(GEN))
        elif k >= 3 and pending and not engine.num_waiting and all(
                seq.num_computed_tokens >= seq.num_prompt_tokens for seq in engine.scheduler.running):
            i = pending.pop(0)
            engine.add_request(f"long{i}", prompts[i], greedy(GEN))

    results = drain(engine, arrive)
    assert not pending
    beside = [tokens for tokens, streaming, _ in steps if streaming and tokens]
    assert max(beside) <= 8 and sum(beside) >= sum(PROMPT_LENGTHS[5:]) - 8
    assert any(k > 1 for _, _, k in steps[steps.index(next(s for s in steps if s[0] == beside[-1])):])
    for rid, i in (("stream", 1), ("long7", 7), ("long6", 6), ("long5", 5)):
        assert results[(rid, 0)].token_ids == greedy_refs[i][:GEN]
    assert_pages_returned(engine, free)


def test_the_prompt_cap_follows_the_timed_calls(model, tokenizer, prompts, monkeypatch):
    """The engine times calls with prompt tokens (here any call carrying one) into a running mean of
    a prompt token's time, and caps a step's prompt tokens beside decoding streams at what runs in
    decode_window_ms: the largest warm-up envelope's prompt slots that fit (for a 256-token budget 64,
    96, 128, 192, 256), at least the smallest's; a whole budget where everything fits."""
    monkeypatch.setattr(llm_engine, "TIMED_PROMPT_SLOTS", 1)
    engine = make_engine(model, tokenizer, ROOMY, decode_window_ms=100.0)
    assert engine.scheduler.prompt_cap == 256 and engine.prompt_token_s is None
    engine.add_request("r", prompts[7], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    drain(engine)
    assert engine.prompt_token_s is not None and 0 < engine.prompt_token_s < 60
    engine.prompt_token_s, caps = None, []
    for token_s in (1e-3, 1e-3, 1.0):
        engine._time_prompts(token_s)
        caps.append(engine.scheduler.prompt_cap)
    # 100 ms at 1 ms a token: 100 fit, the 96 rung; then a 1 s call moves the mean to 0.3007 s: the smallest
    assert caps == [96, 96, 64]
    assert engine.prompt_token_s == pytest.approx(1e-3 + 0.3 * (1.0 - 1e-3))
    engine.prompt_token_s = None
    engine._time_prompts(1e-6)  # 100000 tokens fit: no cap
    assert engine.scheduler.prompt_cap == 256
    engine.prompt_token_s = None
    engine._time_prompts(0.1 / 130)  # 130 fit: the 128 rung
    assert engine.scheduler.prompt_cap == 128


# ---- 2. logits and logprobs of the paged step equal the plain forward ----

@pytest.mark.parametrize("overlap,attention", [(True, "kernel"), (False, "kernel"), (True, "jnp")],
                         ids=["overlap", "sync", "jnp-rows"])
def test_prompt_logprobs_equal_the_plain_forward(model, tokenizer, hf, prompts, overlap, attention):
    # prompts prefilled in chunks: packed by the kernel path, split over rows on the jnp path
    engine = make_engine(model, tokenizer, TIGHT, async_overlap=overlap, attention=attention)
    splits = record_splits(engine)
    free = engine.allocator.num_free_pages
    engine.add_request("one", prompts[7], SamplingParams(prompt_logprobs=1, max_tokens=0))
    engine.add_request("top", prompts[6], SamplingParams(prompt_logprobs=20, max_tokens=0))
    engine.add_request("gen", prompts[3], SamplingParams(prompt_logprobs=0, max_tokens=3, temperature=0.0))
    results = drain(engine)
    for rid, prompt, n in (("one", prompts[7], 1), ("top", prompts[6], 20), ("gen", prompts[3], 0)):
        got = results[(rid, 0)]
        ref = hf_logprobs(hf, prompt)
        assert got.prompt_logprobs is not None and len(got.prompt_logprobs) == len(prompt), rid
        assert got.prompt_logprobs[0] is None
        for pos, entry in enumerate(got.prompt_logprobs[1:], start=1):
            row = ref[pos - 1]
            assert entry["token_id"] == prompt[pos]
            assert entry["logprob"] == pytest.approx(row[prompt[pos]], abs=2e-4), (rid, pos)
            # rank: 1 + the tokens likelier than it, within the logprobs' tolerance of a tie
            lp = row[prompt[pos]]
            assert 1 + (row > lp + 2e-4).sum() <= entry["rank"] <= 1 + (row > lp - 2e-4).sum(), (rid, pos)
            top = np.argsort(-row)[:n]
            assert [t for t, _ in entry["top"]] == top.tolist(), (rid, pos)
            np.testing.assert_allclose([lp for _, lp in entry["top"]], row[top], atol=2e-4)
    assert results[("one", 0)].token_ids == [] and results[("one", 0)].finish_reason == "length"
    assert len(results[("gen", 0)].token_ids) == 3
    if attention == "jnp":
        assert "split" in splits, "no step split a prefill chunk over several rows"
    else:
        assert set(splits) == {"packed"}
    assert_pages_returned(engine, free)


def test_sampled_token_logprobs_equal_the_plain_forward(model, tokenizer, hf, prompts):
    engine = make_engine(model, tokenizer, ROOMY)  # overlap on, 4 fused decode steps
    chunks = record_chunks(engine)
    cases = {"a": (prompts[1], 5), "b": (prompts[5], 3), "c": (prompts[0], 0)}
    for rid, (prompt, n) in cases.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=1.0, seed=len(rid) + ord(rid), max_tokens=10,
                                                       logprobs=n, ignore_eos=True))
    # a row that asks for no logprobs shares the batches: it gets none, the others still get theirs
    engine.add_request("plain", prompts[2], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    results = drain(engine)
    assert any(c["steps"] > 1 for c in chunks)
    assert not results[("plain", 0)].logprobs and len(results[("plain", 0)].token_ids) == 10
    for rid, (prompt, n) in cases.items():
        got = results[(rid, 0)]
        assert len(got.logprobs) == len(got.token_ids) == 10
        ref = hf_logprobs(hf, prompt + got.token_ids)
        for k, (token, entry) in enumerate(zip(got.token_ids, got.logprobs)):
            row = ref[len(prompt) - 1 + k]
            assert entry["token_id"] == token
            assert entry["logprob"] == pytest.approx(row[token], abs=2e-4), (rid, k)
            assert [t for t, _ in entry["top"]] == np.argsort(-row)[:n].tolist(), (rid, k)
            np.testing.assert_allclose([lp for _, lp in entry["top"]], np.sort(row)[::-1][:n], atol=2e-4)


# ---- 3. penalties and n choices (seeded draws: test_engine_seeds.py) ----

def record_penalised_fused_calls(engine: LLMEngine) -> list[bool]:
    """Per dispatched call: whether it was fused and held a request with penalties."""
    seen, dispatch = [], engine.runner.dispatch

    def recording(batch):
        flight = dispatch(batch)
        seen.append(flight is not None and flight.penalised)
        return flight

    engine.runner.dispatch = recording
    return seen


def test_repetition_penalty_matches_generate_when_decodes_fuse(model, tokenizer, hf, prompts):
    """A penalised request's fused decode steps count the tokens of the call's own earlier steps
    (and of the call before, read back first): its tokens are generate's. One admitted as a
    single decode token while another request's steps fuse joins them."""
    engine = make_engine(model, tokenizer, ROOMY, decode_steps=4)
    penalised = SamplingParams(temperature=0.0, repetition_penalty=2.0, max_tokens=12, ignore_eos=True)
    fused = record_penalised_fused_calls(engine)

    def before_step(k):
        if k == 0:
            engine.add_request("plain", prompts[3], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        if k == 3:
            engine.add_request("penalised", prompts[0], penalised)  # 1-token prompt: scheduled as a decode

    got = drain(engine, before_step)[("penalised", 0)].token_ids
    assert got == hf_greedy(hf, prompts[0], 12, repetition_penalty=2.0)
    assert sum(fused) >= 2, fused


def test_presence_and_frequency_penalties_give_the_same_tokens_fused_or_not(model, tokenizer, prompts):
    """Seeded requests with OpenAI's presence and frequency penalties, sampled and greedy, beside
    plain ones: the same tokens whether 4 decode steps fuse in a call or each runs alone."""
    kinds = [dict(temperature=0.0, presence_penalty=1.5), dict(temperature=0.9, frequency_penalty=1.0),
             dict(temperature=0.0), dict(temperature=0.8, presence_penalty=-0.5, frequency_penalty=0.7),
             dict(temperature=0.7)]
    results = []
    for steps in (4, 1):
        engine = make_engine(model, tokenizer, ROOMY, decode_steps=steps)
        fused = record_penalised_fused_calls(engine)
        for i, kw in enumerate(kinds):
            engine.add_request(f"r{i}", prompts[i], SamplingParams(seed=i, max_tokens=14, ignore_eos=True, **kw))
        results.append({key: c.token_ids for key, c in drain(engine).items()})
        assert (sum(fused) >= 2) == (steps == 4), fused
    assert results[0] == results[1]


def test_n_choices_share_prompt_pages_and_differ(model, tokenizer, prompts):
    engine = make_engine(model, tokenizer, ROOMY)
    free = engine.allocator.num_free_pages
    prompt = prompts[6]  # 30 tokens: 3 full pages of 8, then 6 tokens
    engine.add_request("n4", prompt, dataclasses.replace(SAMPLED, n=4, seed=9, max_tokens=8))
    shared = []

    def before_step(k):
        seqs = [s for s in engine.scheduler.running if s.request_id == "n4"]
        if len(seqs) == 4:
            tables = [tuple(s.page_table[:3]) for s in seqs]
            shared.append(len(set(tables)) == 1 and all(engine.allocator.refcount(p) == 4 for p in tables[0]))

    results = drain(engine, before_step)
    assert shared and all(shared), "the 4 choices did not hold the same 3 prompt pages"
    assert engine.scheduler.num_hit_tokens == 3 * 24  # choices 1..3 each reused 3 full pages
    outs = [tuple(results[("n4", i)].token_ids) for i in range(4)]
    assert all(len(o) == 8 for o in outs) and len(set(outs)) == 4
    assert_pages_returned(engine, free)


# ---- 5. pages come back after finishing and aborting ----

def test_a_finished_request_is_freed_without_the_cycle_collector(model, tokenizer, prompts):
    """Once a request's last output is out, nothing of it waits for Python's cycle collector: its
    group, its sequences and their chunks go with their last reference. (A worker's collector held
    every finished request until its next full pass, which then walked them all; the worker's
    memory grew batch by batch until then.) Choices end by length, in pairs, and by abort while
    fused calls run ahead of their read-back."""
    engine = make_engine(model, tokenizer, ROOMY, async_overlap=True, decode_steps=4)
    refs: list[weakref.ref] = []
    aborted = []

    def before_step(k):
        if k == 0:
            engine.add_request("len", prompts[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
            engine.add_request("pair", prompts[1], SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=9,
                                                                  ignore_eos=True))
            engine.add_request("cut", prompts[2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
            for rid in ("len", "pair", "cut"):
                group = engine._groups[rid]
                refs.extend(weakref.ref(o) for o in (group, *group.sequences))
        elif k == 4:
            aborted.extend(engine.abort("cut"))

    gc.collect()
    gc.disable()
    try:
        results = drain(engine, before_step)
        assert [o.finish_reason for o in aborted] == ["abort"] and results[("pair", 1)].finish_reason == "length"
        assert len(refs) == 7 and [r() for r in refs] == [None] * 7
    finally:
        gc.enable()


@pytest.mark.parametrize("launch_thread", [False, True], ids=["inline", "launch-thread"])
def test_pages_return_after_aborts_mid_flight(model, tokenizer, prompts, launch_thread):
    engine = make_engine(model, tokenizer, TIGHT, async_overlap=True, launch_thread=launch_thread)
    free = engine.allocator.num_free_pages
    sampled = dataclasses.replace(SAMPLED, seed=3)
    for i, p in enumerate(prompts[2:]):
        engine.add_request(f"r{i}", p, sampled)
    engine.add_request("pair", prompts[3], dataclasses.replace(SAMPLED, n=2, seed=4))
    aborted: dict[str, str] = {}  # request -> what it was doing
    results: dict[tuple[str, int], Choice] = {}

    def abort(rid, doing):
        seqs = engine._groups[rid].sequences
        outputs = engine.abort(rid)
        assert [o.finish_reason for o in outputs] == ["abort"] * len(seqs)
        assert sum(o.request_finished for o in outputs) == 1  # the request ends once, with its last choice
        collect(results, outputs)
        aborted[rid] = doing

    def before_step(k):
        sched = engine.scheduler
        if k == 1:
            prefilling = [s for s in sched.running if s.num_computed_tokens < s.num_prompt_tokens]
            abort(prefilling[-1].request_id, "prefill")
        in_flight = [s for s in sched.running if s.num_in_flight and s.request_id not in aborted]
        if k >= 3 and "decode" not in aborted.values() and in_flight:
            abort(in_flight[0].request_id, "decode")
        pair = engine._groups.get("pair")
        if pair and "pair" not in aborted and all(s.num_output_tokens for s in pair.sequences):
            abort("pair", "pair")
        waiting = [s for s in sched.waiting if s.request_id not in aborted and s.request_id != "pair"]
        if k >= 3 and "waiting" not in aborted.values() and waiting:
            abort(waiting[-1].request_id, "waiting")

    drain(engine, before_step, results)
    assert sorted(aborted.values()) == ["decode", "pair", "prefill", "waiting"]
    assert engine.scheduler.num_preemptions > 0
    for rid in aborted:
        assert results[(rid, 0)].finish_reason == "abort"
    assert {r.finish_reason for (rid, _), r in results.items() if rid not in aborted} == {"length"}
    assert_pages_returned(engine, free)


# ---- 6. the offline API ----

def test_llm_generate_returns_everything_in_prompt_order(random_ckpt, tokenizer, hf):
    path, _ = random_ckpt
    llm = LLM(model=str(path), **ROOMY)
    texts = [
        "The café serves crème brûlée to a naïve guest, again and again and again.",
        "hello",
        "the lazy dog",
        "numbers 0123",
    ]
    # the engine's own tokenizer encodes: for a qwen2 checkpoint transformers loads Qwen2Tokenizer,
    # whose pre-tokenizer (digits one by one) replaces the one saved in tokenizer.json
    ids = [llm.tokenizer(t).input_ids for t in texts]
    refs = [hf_greedy(hf, p, 8) for p in ids]
    stop_id = refs[-1][2]  # the last prompt stops after 3 tokens: prompts finish out of order
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True, stop_token_ids=(stop_id,))
    finished: list[str] = []
    step = llm.engine.step

    def spy():
        outputs = step()
        finished.extend(o.request_id for o in outputs if o.request_finished)
        return outputs

    llm.engine.step = spy
    results = llm.generate(texts, params)
    assert finished != sorted(finished, key=lambda rid: int(rid.rsplit("-", 1)[1]))  # not in prompt order
    assert [r.prompt for r in results] == texts
    for text, result, prompt, ref in zip(texts, results, ids, refs):
        assert result.prompt_token_ids == prompt
        (out,) = result.outputs
        expected = ref[: ref.index(stop_id) + 1] if stop_id in ref else ref
        assert out.token_ids == expected, text
        assert out.finish_reason == ("stop" if stop_id in ref else "length")
        text_ids = expected[:-1] if out.finish_reason == "stop" else expected  # a stop token adds no text
        assert out.text == tokenizer.decode(text_ids, skip_special_tokens=True)
        assert [lp["token_id"] for lp in out.logprobs] == out.token_ids
        assert all(len(lp["top"]) == 2 and lp["top"][0][0] == lp["token_id"] for lp in out.logprobs)  # greedy: top
    again = llm.generate([r.prompt_token_ids for r in results], params)
    assert [r.outputs[0].token_ids for r in again] == [r.outputs[0].token_ids for r in results]


SEED_PROBE = """
import sys
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
engine = LLMEngine.from_path(sys.argv[1], EngineConfig(max_num_seqs=8, num_pages=8, seed=7))
engine.add_request("offline-0", [1, 2, 3], SamplingParams())
print(engine._groups["offline-0"].params.seed)
"""


def test_unseeded_offline_sampling_is_reproducible(random_ckpt):
    """Requests without a seed get one from (EngineConfig.seed, request id): the same in every run
    and every process; another engine seed gives other samples."""
    path, _ = random_ckpt
    texts = ["hello", "the lazy dog"]
    params = dataclasses.replace(SAMPLED, max_tokens=6)  # no seed
    runs = [LLM(model=str(path), **ROOMY, seed=s).generate(texts, params) for s in (0, 0, 1)]
    tokens = [[r.outputs[0].token_ids for r in run] for run in runs]
    assert tokens[0] == tokens[1] and tokens[0] != tokens[2]
    probes = [subprocess.Popen([sys.executable, "-c", SEED_PROBE, str(path)], stdout=subprocess.PIPE, text=True,
                               cwd=Path(__file__).parents[1],
                               env={**os.environ, "PYTHONHASHSEED": str(h), "JAX_PLATFORMS": "cpu"}) for h in (1, 2)]
    seeds = [p.communicate(timeout=120)[0].strip() for p in probes]
    assert all(p.returncode == 0 for p in probes) and seeds[0] == seeds[1] != ""


@pytest.mark.parametrize("attention", ["kernel", "jnp"])
def test_bfloat16_kv_cache_halves_page_memory_and_stays_close_to_the_float32_forward(model, tokenizer, hf, prompts,
                                                                                       attention):
    """kv_cache_dtype="bfloat16" with float32 compute: pages take half the bytes, and logprobs of
    prompt and generated tokens stay within bfloat16 rounding of transformers' float32 forward
    (both attention paths, decode rows fused)."""
    f32 = make_engine(model, tokenizer, ROOMY, attention=attention)
    engine = make_engine(model, tokenizer, ROOMY, attention=attention, kv_cache_dtype="bfloat16")
    assert engine.runner.kv.dtype == jnp.bfloat16 and f32.runner.kv.dtype == jnp.float32
    assert engine.runner.kv.keys[0].nbytes * 2 == f32.runner.kv.keys[0].nbytes
    prompt = prompts[6]
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0,
                                                   prompt_logprobs=0))
    got = drain(engine)[("r", 0)]
    ref = hf_logprobs(hf, prompt + got.token_ids)
    for pos, entry in enumerate(got.prompt_logprobs[1:], start=1):
        assert entry["logprob"] == pytest.approx(ref[pos - 1][prompt[pos]], abs=3e-2), pos
    for k, (token, entry) in enumerate(zip(got.token_ids, got.logprobs)):
        assert entry["logprob"] == pytest.approx(ref[len(prompt) - 1 + k][token], abs=3e-2), k
        assert ref[len(prompt) - 1 + k][token] >= ref[len(prompt) - 1 + k].max() - 3e-2  # greedy up to rounding
