"""How a step lays out its rows: prefill row counts, the split of chunks into rows, decode rows beside them."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine_support import ROOMY, drain, tokenizer  # noqa: F401 (a fixture)
from tests.test_engine import GEN, greedy_refs, hf, make_engine, model, prompts, random_ckpt  # noqa: F401 (fixtures)
from worker.engine.batch import (MIN_PREFILL_LEN, PACK_GRANULE, StepShape, envelopes, fits, plan_packed, plan_prefill,
                                 row_bucket, slot_bucket, step_cost)
from worker.engine.sampling_params import SamplingParams


def test_slot_bucket_ladder_has_four_steps_per_octave():
    assert [slot_bucket(n) for n in (1, 5, 8, 9, 11, 13, 16, 17, 33, 35, 64, 65)] == [1, 5, 8, 10, 12, 14, 16, 20, 40,
                                                                                      40, 64, 80]


def test_row_bucket_ladder_is_powers_of_two_and_one_and_a_half_times_them():
    assert [row_bucket(n) for n in range(1, 26)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16, 16, 16, 16,
                                                    24, 24, 24, 24, 24, 24, 24, 24, 32]


def test_a_long_chunk_among_short_ones_is_split_instead_of_padding_every_row():
    # a 1024-token budget packed as the rest of one prompt, 7 whole prompts and the start of another
    qp, rows = plan_prefill([8] + [128] * 7 + [104], max_rows=128, context=128)
    assert rows * qp == 1024  # no padded token (one row per chunk would pad to 12 x 128)
    assert plan_prefill([128] * 8, max_rows=128, context=128) == (128, 8)  # nothing to gain: whole rows


def test_long_contexts_keep_rows_long():
    # each row gathers its sequence's whole context: tiny rows over 1024 tokens of K/V cost more
    qp, rows = plan_prefill([17, 1000], max_rows=128, context=1024)
    assert qp >= 256 and rows * qp <= 1536


@pytest.mark.parametrize("seed", range(5))
def test_every_plan_holds_every_token_and_fits(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 300, rng.integers(1, 12)).tolist()
    qp, rows = plan_prefill(lengths, max_rows=64, context=512)
    assert qp >= MIN_PREFILL_LEN and qp & (qp - 1) == 0
    assert sum(-(-n // qp) for n in lengths) <= rows <= 64


def test_packed_chunks_pad_only_the_total_not_each_chunk():
    # a 1024-token budget as 6 prompts of 148 tokens and the start of another: in rows of 64 tokens
    # (the row layout's best plan) that takes 21 rows, padded to 24 (1536 slots)
    assert plan_packed([148] * 6 + [136], max_rows=64) == (8, 1024)
    assert plan_prefill([148] * 6 + [136], max_rows=64, context=1024) == (64, 24)
    assert plan_packed([1024], max_rows=64) == (4, 1024)  # a full budget in one chunk: no padding at all
    for seed in range(5):
        rng = np.random.default_rng(seed)
        lengths = rng.integers(2, 400, rng.integers(1, 20)).tolist()
        rows, tokens = plan_packed(lengths, max_rows=64)
        assert len(lengths) <= rows <= 64 and tokens % PACK_GRANULE == 0
        assert sum(lengths) <= tokens < 1.25 * sum(lengths) + PACK_GRANULE
    with pytest.raises(ValueError):
        plan_packed([2] * 65, max_rows=64)


def test_a_packed_shape_holds_any_split_of_its_tokens_over_its_rows():
    shape = StepShape(64, 8, 0, 16, 1, False, 64, 128, prefill_tokens=1024)
    assert shape.packed and shape.num_tokens == 64 + 1024
    assert fits(shape, 64, [148] * 6 + [136], 16)
    assert not fits(shape, 64, [148] * 7, 16)  # 1036 tokens
    assert not fits(shape, 64, [100] * 9, 16)  # 9 chunks in 8 rows
    assert not fits(shape, 65, [148], 16) and not fits(shape, 8, [148], 32)
    ladder = envelopes(64, 1024, 16, 64, 128)
    rungs = [(4, 192), (4, 256), (8, 384), (8, 512), (16, 768), (32, 1024)]
    assert [(e.num_decode, e.num_prefill, e.prefill_tokens) for e in ladder] == [(d, *r) for d in (64, 0) for r in rungs]
    assert all(e.packed and e.pages == 16 for e in ladder)
    small = envelopes(8, 32, 4, 16, 16)
    assert [(e.num_decode, e.num_prefill, e.prefill_tokens) for e in small] == [(8, 8, 32), (0, 8, 32)]  # rungs collapse


def test_a_lone_prompt_at_an_idle_worker_borrows_a_prefill_only_envelope_within_tolerance():
    from worker.engine.runner import BORROW_TOLERANCE

    ladder = envelopes(64, 1024, 16, 64, 128)
    for prompts in range(1, 7):
        lengths = [148] * prompts
        rows, tokens = plan_packed(lengths, 64)
        exact = StepShape(0, rows, 0, 16, 1, False, 64, 128, tokens)
        best = min((e for e in ladder if fits(e, 0, lengths, 16)), key=step_cost)
        assert best.num_decode == 0 and step_cost(best) <= BORROW_TOLERANCE * step_cost(exact), prompts


def test_a_few_arrivals_joining_running_decodes_borrow_an_envelope_within_tolerance():
    from worker.engine.runner import BORROW_TOLERANCE

    ladder = envelopes(64, 1024, 16, 64, 128)
    for prompts in range(1, 7):  # 1 to 6 arrivals of 148 tokens joining 60 running sequences
        lengths = [148] * prompts
        rows, tokens = plan_packed(lengths, 64)
        exact = StepShape(64, rows, 0, 16, 1, False, 64, 128, tokens)
        best = min((e for e in ladder if fits(e, 60, lengths, 16)), key=step_cost)
        assert step_cost(best) <= BORROW_TOLERANCE * step_cost(exact), prompts


def test_an_uncompiled_shape_runs_in_a_compiled_one_until_it_recurs():
    """ModelRunner._choose_shape: a shape arrival timing produced borrows the cheapest compiled
    variant it fits in; the third time it is asked for, its own compile is requested (dispatch
    runs it in the background) unless the padding is within BORROW_TOLERANCE; with nothing to
    borrow, it is compiled at once."""
    from types import SimpleNamespace

    from worker.engine.batch import StepShape
    from worker.engine.runner import COMPILE_AFTER, ModelRunner, PromptsWait
    from worker.engine.sampler import SamplerFlags

    flags = SamplerFlags(all_greedy=True, needs_cut=False, penalties=False, bias=False, num_logprobs=0, logprobs=False)
    shape = lambda sd, sp, qp, pages=4: StepShape(sd, sp, qp, pages, 1, False, 16, 128)  # noqa: E731
    big, bigger = shape(16, 16, 64), shape(64, 32, 64)
    runner = SimpleNamespace(compiled={(big, flags), (shape(8, 4, 8), flags)}, ready={(bigger, flags): None},
                             compiling=set(), wanted={}, compile_after=COMPILE_AFTER, _compile_next=None,
                             planned=None, prompts_wait=True, background_compiles=1)
    exact = shape(8, 6, 32)
    lengths = [60, 30, 100, 20]  # 1 + 1 + 2 + 1 rows of 64 fit in 16
    for _ in range(COMPILE_AFTER - 1):
        assert ModelRunner._choose_shape(runner, exact, flags, 5, lengths, 4) == (big, flags)  # cheapest that fits
        assert runner._compile_next is None
    runner.compiling = {(bigger, flags)}  # as many background compiles as allowed already run: none more
    assert ModelRunner._choose_shape(runner, exact, flags, 5, lengths, 4) == (big, flags)
    assert runner._compile_next is None
    runner.compiling = set()
    assert ModelRunner._choose_shape(runner, exact, flags, 5, lengths, 4) == (big, flags)
    assert runner._compile_next == (exact, flags)
    other = SamplerFlags(**{**vars(flags), "all_greedy": False})  # no compiled variant with these flags
    # nothing covers: with decode rows running, the prompts wait for their variant (compiled in the
    # background) instead of stopping the decode rows; with none, the batch compiles its own now
    with pytest.raises(PromptsWait) as wait:
        ModelRunner._choose_shape(runner, exact, other, 5, lengths, 4)
    assert wait.value.key == (exact, other)
    assert ModelRunner._choose_shape(runner, exact, other, 0, lengths, 4) == (exact, other)
    with pytest.raises(PromptsWait):
        ModelRunner._choose_shape(runner, shape(8, 6, 32, pages=8), flags, 5, lengths, 8)
    assert ModelRunner._choose_shape(runner, shape(0, 6, 32, pages=8), flags, 0, lengths, 8) == (shape(0, 6, 32, 8), flags)
    # a batch scoring some prompts (prompt logprobs): only those chunks wait, unless every chunk does
    scoring = StepShape(8, 6, 32, 4, 1, True, 16, 128)
    with pytest.raises(PromptsWait) as wait:
        ModelRunner._choose_shape(runner, scoring, flags, 0, lengths, 4, plain=4, scored=1)
    assert wait.value.held == "prompt logprobs" and wait.value.key == (scoring, flags)
    assert ModelRunner._choose_shape(runner, scoring, flags, 0, lengths, 4, plain=4, scored=4) == (scoring, flags)
    with pytest.raises(PromptsWait) as wait:  # penalties or logit bias are held back first
        ModelRunner._choose_shape(runner, scoring, SamplerFlags(penalties=True), 5, lengths, 4, plain=8, scored=1)
    assert wait.value.held == "sampler"
    # a compiled scoring variant serves a batch whose scored tokens fit in its slots, no other
    slots32 = (StepShape(16, 16, 64, 4, 1, True, 16, 128, scored=32), flags)
    runner.compiled.add(slots32)
    few, many = (StepShape(8, 6, 32, 4, 1, True, 16, 128, scored=n) for n in (16, 64))
    assert ModelRunner._choose_shape(runner, few, flags, 0, lengths, 4, plain=4, scored=1) == slots32
    with pytest.raises(PromptsWait):
        ModelRunner._choose_shape(runner, many, flags, 0, lengths, 4, plain=4, scored=1)
    runner.compiled.discard(slots32)
    runner.prompts_wait = False  # an offline engine: compiled at once, batches independent of compile times
    assert ModelRunner._choose_shape(runner, exact, other, 5, lengths, 4) == (exact, other)
    assert ModelRunner._choose_shape(runner, scoring, flags, 0, lengths, 4, plain=4, scored=1) == (scoring, flags)
    runner.prompts_wait = True
    near = shape(8, 16, 64)  # big only pads 8 decode rows more: borrowed, never compiled
    runner._compile_next = None
    for _ in range(2 * COMPILE_AFTER):
        assert ModelRunner._choose_shape(runner, near, flags, 5, lengths, 4) == (big, flags)
        assert runner._compile_next is None
    # a batch whose sampling needs less than a compiled variant does runs in it at once, even at its
    # exact shape, and asks for its own variant (no extra sampler work) the third time
    full = SamplerFlags(**{**vars(flags), "all_greedy": False, "needs_cut": True, "top_p": True})
    top_p = SamplerFlags(**{**vars(flags), "all_greedy": False, "needs_cut": True, "top_p": True})
    sampled = SamplerFlags(**{**vars(flags), "all_greedy": False})
    runner.compiled.add((near, full))
    assert ModelRunner._choose_shape(runner, near, top_p, 5, lengths, 4) == (near, full)  # the same flags
    for i in range(COMPILE_AFTER):
        assert ModelRunner._choose_shape(runner, near, sampled, 5, lengths, 4) == (near, full)
        assert runner._compile_next == (None if i < COMPILE_AFTER - 1 else (near, sampled))
    runner._compile_next = None
    assert ModelRunner._choose_shape(runner, near, flags, 5, lengths, 4) == (big, flags)  # its own flags first
    assert ModelRunner._choose_shape(runner, exact, top_p, 5, lengths, 4) == (near, full)


def test_row_layout_mixed_steps_take_every_decode_row_and_keep_the_tokens(model, tokenizer, prompts, greedy_refs):
    """Without ragged attention (the GPU's and the jnp path), a step with prefill and decode rows
    pads its decode rows to all of them, so mixed variants do not multiply with the decode-row
    ladder (each a 25-60 s compile for llama3-8b on an H100); the tokens stay transformers'."""
    engine = make_engine(model, tokenizer, {**ROOMY, "max_num_seqs": 32}, decode_steps=4, attention="jnp")
    params = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)

    def arrive(k):  # one prompt joins the running batch every other step
        if k % 2 == 0 and k // 2 < len(prompts):
            engine.add_request(f"p{k // 2}", prompts[k // 2], params)

    results = drain(engine, arrive)
    assert [results[(f"p{i}", 0)].token_ids for i in range(len(prompts))] == greedy_refs
    shapes = {shape for shape, _ in engine.runner.compiled}
    mixed = {s for s in shapes if s.num_prefill and s.num_decode}
    assert mixed and {s.num_decode for s in mixed} == {32}, shapes  # at most 8 were running
    assert min(s.num_decode for s in shapes if not s.num_prefill) < 32  # pure decode keeps its ladder


def serving_engine(model, tokenizer, **overrides):
    """An engine as a serving worker runs it (`runner.prompts_wait`), warmed up -> (the engine, the
    request ids of each step it dispatches from then on, in order)."""
    engine = make_engine(model, tokenizer, ROOMY, decode_steps=4, **overrides)
    engine.runner.prompts_wait = True
    engine.warmup()
    dispatched: list[set[str]] = []
    dispatch = engine.runner.dispatch

    def spy(batch):
        flight = dispatch(batch)
        if flight is not None:
            dispatched.append({c.seq.request_id for c in batch.chunks})
        return flight

    engine.runner.dispatch = spy
    return engine, dispatched


def test_prompts_wait_for_their_variant_while_decode_rows_go_on(model, tokenizer, prompts, greedy_refs):
    """On the row layout (jnp; Pallas on a GPU) a batch mixing running decodes with a prompt of a
    shape nothing compiled covers used to compile its own variant at once, every running sequence
    waiting (25-60 s for a 32-layer model on a GPU). Now the prompt chunks wait while their variant
    compiles in the background, and the decode rows run without them; then the prompt joins.
    Tokens stay transformers'."""
    engine, dispatched = serving_engine(model, tokenizer, attention="jnp")
    params = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    arrived: list[int] = []

    def arrive(k):
        if k == 0:
            for i in range(4):
                engine.add_request(f"p{i}", prompts[i], params)
        elif k == 3:
            engine.add_request("late", prompts[-1], params)  # 41 tokens: a prefill shape warm-up never met
            arrived.append(len(dispatched))

    results = drain(engine, arrive)
    assert [results[(f"p{i}", 0)].token_ids for i in range(4)] == greedy_refs[:4]
    assert results[("late", 0)].token_ids == greedy_refs[-1]
    after = dispatched[arrived[0]:]
    joined = next(i for i, ids in enumerate(after) if "late" in ids)
    assert joined > 0 and all(ids and "late" not in ids for ids in after[:joined])  # decode rows went on meanwhile
    assert not any(s.num_prefill and s.num_decode for s, _ in engine.runner.compiled)  # no mixed compile stopped them


def test_prompts_scoring_their_tokens_wait_for_their_variant_while_other_prompts_go_on(model, tokenizer, prompts,
                                                                                       greedy_refs, hf):
    """A prompt asking for its prompt logprobs (an echo request) needs a variant computing every
    token's logits, which warm-up does not compile. In a serving worker it waits while that variant
    compiles in the background; plain prompts arriving with it run at once instead of waiting with
    it (or all streams stopping for the compile). Its tokens and prompt logprobs stay
    transformers'."""
    from tests.test_engine import hf_logprobs

    engine, dispatched = serving_engine(model, tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    arrived: list[int] = []

    def arrive(k):
        if k == 0:
            for i in range(3):
                engine.add_request(f"p{i}", prompts[i], params)
        elif k == 3:
            engine.add_request("scored", prompts[3], SamplingParams(**{**vars(params), "prompt_logprobs": 1}))
            engine.add_request("plain", prompts[4], params)
            arrived.append(len(dispatched))

    results = drain(engine, arrive)
    assert [results[(f"p{i}", 0)].token_ids for i in range(3)] == greedy_refs[:3]
    assert results[("plain", 0)].token_ids == greedy_refs[4] and results[("scored", 0)].token_ids == greedy_refs[3]
    after = dispatched[arrived[0]:]
    assert "plain" in after[0] and "scored" not in after[0], after[:3]  # the plain prompt went on at once
    assert any("scored" in ids for ids in after)
    got, ref = results[("scored", 0)].prompt_logprobs, hf_logprobs(hf, prompts[3])
    assert got[0] is None and len(got) == len(prompts[3])
    for pos, entry in enumerate(got[1:], start=1):
        assert entry["logprob"] == pytest.approx(ref[pos - 1][prompts[3][pos]], abs=2e-4), pos


def test_a_step_computes_prompt_logits_for_the_scoring_chunks_tokens_alone(model, tokenizer, prompts, greedy_refs, hf):
    """A prompt scoring its tokens (an echo request) beside plain prompts in one step: the head
    computes logits for that chunk's tokens (padded to `scored_slots`), not for the step's, and
    its prompt logprobs and top alternatives stay transformers'; the plain prompts' tokens too."""
    from tests.test_engine import hf_logprobs

    engine = make_engine(model, tokenizer, {**ROOMY, "max_num_batched_tokens": 128})
    shapes: list[StepShape] = []
    real = engine._postprocess

    def postprocess(flight):
        shapes.append(flight.shape)
        return real(flight)

    engine._postprocess = postprocess
    params = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    plain = (0, 1, 2, 3, 4, 6, 7)  # 109 prompt tokens beside the scored prompt's 24: steps of 128
    for i in plain:
        engine.add_request(f"p{i}", prompts[i], params)
    engine.add_request("scored", prompts[5], SamplingParams(**{**vars(params), "prompt_logprobs": 2}))
    results = drain(engine)
    scoring = [s for s in shapes if s.prompt_logprobs]
    assert scoring and all(s.scored <= s.num_tokens for s in scoring)
    assert any(s.scored < s.num_tokens for s in scoring), scoring  # fewer logits than the step's tokens
    assert [results[(f"p{i}", 0)].token_ids for i in plain] == [greedy_refs[i] for i in plain]
    assert results[("scored", 0)].token_ids == greedy_refs[5]
    got, ref = results[("scored", 0)].prompt_logprobs, hf_logprobs(hf, prompts[5])
    assert got[0] is None and len(got) == len(prompts[5])
    for pos, entry in enumerate(got[1:], start=1):
        row = ref[pos - 1]
        assert entry["token_id"] == prompts[5][pos]
        assert entry["logprob"] == pytest.approx(row[prompts[5][pos]], abs=2e-4), pos
        assert [t for t, _ in entry["top"]] == np.argsort(-row)[:2].tolist(), pos


def test_scored_slots_are_powers_of_four_from_64_within_the_step():
    from worker.engine.batch import scored_slots

    assert [scored_slots(n, 4096) for n in (1, 64, 65, 256, 257, 1024, 1025)] == [64, 64, 256, 256, 1024, 1024, 4096]
    assert scored_slots(300, 384) == 384 and scored_slots(10, 40) == 40  # never more than the step's tokens


def test_decode_rows_pad_to_one_on_the_cpu_and_to_eight_on_accelerators(model, tokenizer, prompts, greedy_refs):  # noqa: F811
    """A decode step's rows go up a ladder of powers of two from `min_decode_rows`: 1 on the CPU,
    where padded rows cost a step that streams its weights from memory, 8 on accelerators (a GPU
    compiles each rung for 25-60 s). A lone request's decode steps then run one row, with the
    same tokens as when padded to eight."""
    from worker.engine.config import EngineConfig

    assert EngineConfig().for_backend("cpu").min_decode_rows == 1
    assert EngineConfig().for_backend("gpu").min_decode_rows == 8
    assert EngineConfig(min_decode_rows=4).for_backend("gpu").min_decode_rows == 4
    with pytest.raises(ValueError, match="min_decode_rows must be a power of two in"):
        EngineConfig(min_decode_rows=3)
    for minimum, rungs in ((None, [1, 2, 4, 8]), (8, [8])):
        engine = make_engine(model, tokenizer, ROOMY, min_decode_rows=minimum, decode_steps=1)
        assert engine._decode_rungs() == rungs
        engine.add_request("solo", prompts[0], SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True))
        out = drain(engine)
        assert out[("solo", 0)].token_ids == greedy_refs[0]
        decode = {shape.num_decode for shape, _ in engine.runner.compiled if shape.num_prefill == 0 and not shape.packed}
        assert decode == {rungs[0]}, decode
