"""The variants a worker compiles while idle (idle_compiles.py): after them, the first requests
with penalties or logit bias at a fresh worker run at once, in a variant that has their arrays,
instead of every stream on the worker waiting for a compile; tokens are generate's (or an
engine's with the request alone)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import redis

from tests.engine_support import ROOMY, drain, hf_greedy, tokenizer  # noqa: F401 (a fixture)
from tests.stack_support import run_worker_while, wait_until
from tests.test_engine import hf, hf_logprobs, make_engine, model, prompts, random_ckpt  # noqa: F401 (fixtures)
from tests.test_serving import model_dir  # noqa: F401 (fixture)
from tests.test_worker_backlog import _worker
from worker import contract
from worker.contract import OutputDelta, RequestMessage, WorkerStats
from worker.engine.idle_compiles import idle_variants
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.heap import freeze_startup_heap
from worker.service import worker as worker_module


def _compile_queue(engine: LLMEngine) -> int:
    """Queue the idle variants, as a worker does after its warm-up, and compile them all."""
    runner = engine.runner
    runner.idle_queue = idle_variants((*runner.compiled, *runner.ready), engine.config.max_logprobs,
                                      engine.max_model_len)
    queued = len(runner.idle_queue)
    deadline = time.monotonic() + 300
    while runner.compile_idle() and time.monotonic() < deadline:
        time.sleep(0.02)
    return queued


def test_after_the_idle_compiles_penalties_logit_bias_and_prompt_logprobs_join_a_running_batch_without_a_stall(
        model, tokenizer, hf, prompts):
    """Greedy requests run; one with a repetition penalty, one with logit bias and one scoring
    its prompt arrive among them. With the idle queue compiled, they borrow its variants (greedy
    rows in a sampling variant with every switch) and nothing compiles on the engine thread;
    without it each compiled its own there. Tokens: generate's with the penalty, the bias
    request's as an engine gives them alone; prompt logprobs: the torch forward's."""
    engine = make_engine(model, tokenizer, ROOMY, decode_steps=4)
    engine.warmup()
    runner = engine.runner
    queued = _compile_queue(engine)
    assert queued > 0 and runner.compiles.idle == queued
    assert all(f.penalties and f.bias and not s.drafts for s, f in runner.ready if f.penalties)
    assert {s.num_decode for s, _ in runner.ready if s.prompt_logprobs} == {0, max(s.num_decode for s, _ in runner.ready)}
    compiled, stall = runner.compiles.reading()
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=24, ignore_eos=True)
    biased = SamplingParams(temperature=0.0, logit_bias=((5, 3.0), (9, -2.0)), max_tokens=12, ignore_eos=True)
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def arrive(k):
        if k == 0:
            for i in range(3):
                engine.add_request(f"plain{i}", prompts[i], plain)
        elif k == 3:
            engine.add_request("pen", prompts[4], penalised)
            engine.add_request("bias", prompts[5], biased)
            engine.add_request("echo", prompts[6], SamplingParams(prompt_logprobs=2, max_tokens=0))

    results = drain(engine, arrive)
    assert runner.compiles.reading()[1] == stall  # the engine thread never waited for a compile
    assert runner.compiles.reading()[0] - compiled <= 3  # exact variants asked for, in the background
    assert results[("pen", 0)].token_ids == hf_greedy(hf, prompts[4], 24, repetition_penalty=1.3)
    assert results[("plain0", 0)].token_ids == hf_greedy(hf, prompts[0], 40)
    ref = hf_logprobs(hf, prompts[6])
    for pos, entry in enumerate(results[("echo", 0)].prompt_logprobs[1:], start=1):
        assert entry["logprob"] == pytest.approx(ref[pos - 1][prompts[6][pos]], abs=2e-4), pos
        assert [t for t, _ in entry["top"]] == np.argsort(-ref[pos - 1])[:2].tolist(), pos
    alone = make_engine(model, tokenizer, ROOMY, decode_steps=4)
    alone.add_request("bias", prompts[5], biased)
    assert results[("bias", 0)].token_ids == drain(alone)[("bias", 0)].token_ids


def test_a_serving_worker_compiles_its_idle_queue_and_reports_it_pending_until_done(model_dir, redis_url,  # noqa: F811
                                                                                   monkeypatch):
    """The heartbeat says how many variants are still to compile (`compiles_pending`, the
    dashboard's tooltip, `redjax:step_compiles_pending`, what `bench stack` waits for); they are
    not counted as compiles requests caused; a penalised request after them stalls nothing. By the
    time none is pending, what compiling them left alive is frozen out of the cycle collector's
    walks, as the warm-up's was (a full collection over it held the GIL for ~90 ms while serving)."""
    frozen: list[int] = []  # objects frozen at each freeze_startup_heap() of the worker's

    def freeze() -> int:
        frozen.append(freeze_startup_heap())
        return frozen[-1]

    monkeypatch.setattr(worker_module, "freeze_startup_heap", freeze)
    worker = _worker(model_dir, redis_url, name="w-idle", warmup=True)
    client = redis.Redis.from_url(redis_url)
    key = contract.worker_key(worker.config.name)
    stats = lambda: WorkerStats.decode(client.hgetall(key))  # noqa: E731
    seen: dict[str, object] = {}

    def watch() -> None:
        wait_until(lambda: client.exists(key) and stats().state == "serving", 120)
        seen["pending at first"] = stats().compiles_pending
        wait_until(lambda: stats().compiles_pending == 0, 300)
        seen["frozen by then"] = list(frozen)
        seen["after"] = stats()
        params = SamplingParams(temperature=0.0, frequency_penalty=0.5, max_tokens=8, ignore_eos=True).to_dict()
        contract.ensure_group(client)
        client.xadd(contract.REQUESTS, RequestMessage("pen", "tinyllama", [3, 5, 7, 11, 13], params).encode())
        wait_until(lambda: any(OutputDelta.decode(f).done for _, f in client.xrange(contract.out_stream("pen"))), 60)
        time.sleep(2 * contract.HEARTBEAT_INTERVAL_S)
        seen["served"] = stats()

    run_worker_while(worker, watch)
    engine = worker.engine
    queued = idle_variants((*engine.runner.compiled, *engine.runner.ready), engine.config.max_logprobs,
                           engine.max_model_len)  # (warm-up's variants pick them; the idle ones are not among those)
    assert 0 < seen["pending at first"] <= len(queued) == engine.runner.compiles.idle
    assert all(key in engine.runner.ready for key in queued)
    assert (seen["after"].step_compiles, seen["after"].compile_stall_s) == (0, 0.0)
    assert seen["served"].compile_stall_s == 0.0 and seen["served"].requests_finished == 1
    # frozen after the warm-up, then again after the idle compiles, before none was reported pending
    assert seen["frozen by then"] == frozen and len(frozen) == 2 and frozen[1] > frozen[0] > 0


def test_the_idle_queue_holds_the_widest_samplers_shapes_with_penalties_and_packed_scoring_and_light_envelopes():
    """Which variants a worker queues: each of warm-up's widest-sampler shapes (drafts aside) with
    penalty and bias arrays for any request up to the context; for packed prompt chunks, the
    envelope with the most prompt tokens per decode-row count, scoring them, with and without
    penalties; row-layout prefill shapes (the GPU's) get no scoring variant; every mixed envelope,
    whatever its sampler, again with LIGHT_DECODE_ROWS decode rows (prompt pieces beside a few
    streams)."""
    from dataclasses import replace

    from worker.engine.batch import LOGIT_BIAS_LADDER, OUTPUT_IDS_AHEAD, StepShape, sampler_flags
    from worker.engine.idle_compiles import LIGHT_DECODE_ROWS, widest_sampling

    widest = sampler_flags([widest_sampling(20)], 20)
    greedy = sampler_flags([SamplingParams(temperature=0.0)], 20)
    shape = lambda d, p=0, tp=0, qp=0, **kw: StepShape(d, p, qp, 16, kw.pop("k", 1), False, 16, 96, tp, **kw)  # noqa: E731
    decode, fused, drafts = shape(8), shape(8, k=4), shape(8, drafts=True)
    small, wide, mixed = shape(0, 4, 128), shape(0, 8, 512), shape(64, 8, 256)
    rows = shape(0, 2, qp=32)  # row layout
    compiled = [(s, widest) for s in (decode, fused, drafts, small, wide, mixed, rows)]
    compiled += [(decode, replace(widest, apart=True)), (shape(16), greedy), (mixed, greedy)]
    got = idle_variants(compiled, 20, 1000)
    penalised = replace(widest, penalties=True, bias=True, widths=(OUTPUT_IDS_AHEAD, 1024, LOGIT_BIAS_LADDER[1]))
    scoring = {replace(wide, prompt_logprobs=True, scored=512), replace(mixed, prompt_logprobs=True, scored=256)}
    assert set(got) == ({(s, penalised) for s in (decode, fused, small, wide, mixed, rows)}
                        | {(decode, replace(penalised, apart=True))} | {(s, f) for s in scoring for f in (widest, penalised)}
                        | {(shape(LIGHT_DECODE_ROWS, 8, 256), f) for f in (widest, greedy)})
    assert len(got) == len(set(got)) and got[0][0] == decode  # cheapest first
