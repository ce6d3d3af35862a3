"""Offline generation: `LLM(model=DIR).generate(prompts, SamplingParams(...))`, no Redis."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams


@dataclass
class Completion:
    """One choice of one prompt."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[str, Any]] | None = None


@dataclass
class GenerationResult:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[Completion]
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class LLM:
    def __init__(self, model: str, config: EngineConfig | None = None, **engine_args: Any):
        self.engine = LLMEngine.from_path(model, config or EngineConfig(**engine_args))
        self.tokenizer = self.engine.tokenizer
        self._request_ids = itertools.count()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        params: SamplingParams | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[GenerationResult]:
        """Run every prompt to completion, all batched together; results in prompt order.

        `progress(done, total)` is called each time a prompt finishes.
        """
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        results: dict[str, GenerationResult] = {}
        order = []
        for prompt in prompts:
            ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
            rid = f"offline-{next(self._request_ids)}"  # same ids, so same default seeds, in every run
            outs = [Completion(index=k, logprobs=[] if params.logprobs is not None else None) for k in range(params.n)]
            results[rid] = GenerationResult(prompt if isinstance(prompt, str) else None, ids, outs)
            order.append(rid)
            self.engine.add_request(rid, ids, params)
        done = 0
        while self.engine.has_unfinished():
            for out in self.engine.step():
                result = results[out.request_id]
                completion = result.outputs[out.index]
                completion.text += out.text
                completion.token_ids += out.token_ids
                if out.logprobs:
                    completion.logprobs += out.logprobs
                if out.prompt_logprobs is not None and result.prompt_logprobs is None:
                    result.prompt_logprobs = out.prompt_logprobs
                if out.finish_reason is not None:
                    completion.finish_reason, completion.stop_reason = out.finish_reason, out.stop_reason
                if out.request_finished:
                    done += 1
                    if progress:
                        progress(done, len(order))
        return [results[rid] for rid in order]
