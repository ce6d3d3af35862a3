"""Seeded sampling in the engine: a request's tokens depend on its seed alone, not on what shares
its batch, the step it joined, preemption, or whether the CPU kernels or the jnp sampler (the
accelerators', and tensor-parallel workers') drew them. On the tiny random Qwen2 checkpoint of
test_engine.py."""

from __future__ import annotations

import dataclasses

import numpy as np

from tests.engine_support import ROOMY, drain, tokenizer  # noqa: F401 (a fixture)
from tests.test_engine import SAMPLED, TIGHT, make_engine, model, prompts, random_ckpt  # noqa: F401 (fixtures)
from worker.engine.sampling_params import SamplingParams


def random_requests(rng: np.random.Generator, count: int, vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """Unrelated traffic: greedy and sampled rows, other seeds, lengths, cuts, n = 2. (Penalties and
    logit bias change the compiled variant, not the row's draw: tests/test_sampler.py checks that.)"""
    out = []
    for i in range(count):
        params = dataclasses.replace(
            SAMPLED, max_tokens=int(rng.integers(3, 14)), seed=int(rng.integers(0, 2**31)),
            temperature=[0.0, 0.7, 1.3, 1.0, 0.9][i % 5], top_k=int(rng.integers(0, 60)),
            top_p=float(rng.uniform(0.5, 1.0)), min_p=[0.0, 0.05][i % 2], n=1 + (i % 4 == 3),
        )
        out.append((rng.integers(1, vocab, int(rng.integers(1, 9))).tolist(), params))  # short: few shapes
    return out


def test_seed_fixes_tokens_whatever_the_batch_and_join_step(model, tokenizer, prompts):  # noqa: F811
    target = dataclasses.replace(SAMPLED, seed=1234)
    prompt = prompts[4]
    others = random_requests(np.random.default_rng(5), 5, len(tokenizer))

    def run(sizes, join_at: int, others_at: int | None, params=target):
        engine = make_engine(model, tokenizer, sizes)
        added = []

        def before_step(k):
            if k == join_at:
                engine.add_request("target", prompt, params)
                added.append("target")
            if k == others_at:
                assert others_at < join_at or engine.has_unfinished()  # the target is still running
                for i, (p, sp) in enumerate(others):
                    engine.add_request(f"other{i}", p, sp)
                added.append("others")

        results = drain(engine, before_step)
        assert len(added) == (1 if others_at is None else 2)
        assert all(r.finish_reason == "length" for r in results.values())
        return results[("target", 0)].token_ids, engine

    alone, _ = run(ROOMY, 0, None)
    assert len(alone) == 12
    assert run(ROOMY, 2, 0)[0] == alone  # joins a running batch
    assert run(ROOMY, 0, 1)[0] == alone  # the batch grows around it
    tight, engine = run(TIGHT, 1, 0)  # chunked prefill, preemption and recompute around it
    assert engine.scheduler.num_preemptions > 0
    assert tight == alone
    other_seed = run(ROOMY, 0, None, dataclasses.replace(target, seed=4321))[0]
    assert other_seed != alone


def test_jnp_and_kernel_samplers_draw_the_same_tokens(model, tokenizer, prompts):  # noqa: F811
    """Mixed traffic (temperatures, top-k, top-p, min-p, n = 2, greedy rows) through an engine on
    the CPU kernels and one on the jnp sampler: the same tokens for every request. Until session 51
    the jnp path drew by Gumbel noise, so a seed gave other tokens there (session 51: 79 of 80 sampled
    choices of a mixed workload differed between a tensor-parallel server and a one-device one)."""
    traffic = random_requests(np.random.default_rng(11), 12, len(tokenizer))
    traffic += [(p, dataclasses.replace(SAMPLED, seed=100 + i)) for i, p in enumerate(prompts)]

    def run(sampler: str) -> dict:
        engine = make_engine(model, tokenizer, ROOMY, sampler=sampler)
        for i, (prompt, params) in enumerate(traffic):
            engine.add_request(f"r{i}", prompt, params)
        return {key: out.token_ids for key, out in drain(engine).items()}

    kernel, jnp_drawn = run("kernel"), run("jnp")
    assert len(kernel) == len(traffic) + sum(p.n > 1 for _, p in traffic)
    assert jnp_drawn == kernel
