"""What structured output costs the requests beside it: the demo engine on 256 prompts (64 at a
time), all plain, against the same with every 8th following a JSON schema, alternating in one process.

    python scripts/structured_cost.py [--rounds 3] [--every 8] [--num-prompts 256]

A sequence with a grammar takes one token a call, so while one runs its batch's decode steps are
not fused; this prints both halves' output tokens/s and their ratio. Plain requests run 128 tokens
(ignore_eos); constrained ones until their grammar ends or 128 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from api.structured import request_grammar
from worker.cli import DEMO_MODEL
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                    "maxItems": 8}},
          "required": ["name", "tags"], "additionalProperties": False}  # fmt: skip


def run(engine: LLMEngine, prompts: list[list[int]], every: int | None, tag: str) -> tuple[float, int]:
    """(seconds, output tokens) of the prompts run together; with `every`, each every-th follows SCHEMA."""
    grammar = request_grammar({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}})
    for i, prompt in enumerate(prompts):
        structured = every is not None and i % every == 0
        params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=not structured,
                                grammar=grammar if structured else None)  # fmt: skip
        engine.add_request(f"{tag}{i}", prompt, params)
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += sum(len(out.token_ids) for out in engine.step())
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=256)
    args = parser.parse_args()
    engine = LLMEngine.from_path(str(DEMO_MODEL), EngineConfig(max_num_seqs=64))
    engine.warmup()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 4096, 128).tolist() for _ in range(args.num_prompts)]
    run(engine, prompts, None, "a"), run(engine, prompts, args.every, "b")  # warm-up: the masked variants compile
    ratios = []
    for r in range(args.rounds):
        (ps, pt), (ss, st) = run(engine, prompts, None, f"p{r}-"), run(engine, prompts, args.every, f"s{r}-")
        ratios.append((st / ss) / (pt / ps))
        print(f"round {r + 1}: plain {pt / ps:.0f} output tok/s ({pt} tokens), with every {args.every}th structured "
              f"{st / ss:.0f} ({st} tokens): {ratios[-1]:.2f}x")
    print(f"median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
