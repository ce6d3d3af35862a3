"""Track: the host-side output state of one sequence (text, stop strings, prompt logprobs). No JAX."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from worker.engine.detokenizer import Detokenizer
from worker.engine.stop_checker import StopChecker


@dataclass
class Track:
    detok: Detokenizer
    stops: StopChecker
    prompt_logprobs: list[dict[str, Any] | None] = field(default_factory=list)  # None for the first token
    prompt_sent: bool = False

    def collect_prompt_logprobs(self, seq, chunk, first_row: int, out) -> None:
        """Gather the logprob of each next prompt token `chunk` of `seq` computed, at rows
        `first_row`... of `out` (the step's StepOutput on the host; first prompt token: None)."""
        if self.prompt_sent:
            return
        if not self.prompt_logprobs:
            self.prompt_logprobs.append(None)
        if chunk.start + 1 >= seq.num_prompt_tokens:  # nothing left to predict: the step computed none
            return
        n, rows = seq.params.prompt_logprobs, slice(first_row, first_row + chunk.num_tokens)
        # the chunk's numbers as Python ones, one conversion an array
        lps, ids, tops, ranks = (out.prompt_logprobs[rows].tolist(), out.prompt_top_ids[rows, :n].tolist(),
                                 out.prompt_top_logprobs[rows, :n].tolist(), out.prompt_ranks[rows].tolist())
        for i in range(chunk.num_tokens):
            pos = chunk.start + i
            if pos + 1 >= seq.num_prompt_tokens or len(self.prompt_logprobs) > pos + 1:
                continue
            top = [[a, b] for a, b in zip(ids[i], tops[i])]
            self.prompt_logprobs.append({"token_id": seq.prompt_token_ids[pos + 1], "logprob": lps[i], "rank": ranks[i],
                                         "top": top})

    def take_prompt_logprobs(self, seq) -> list | None:
        """Prompt logprobs go out once, with the choice's first output."""
        if seq.params.prompt_logprobs is None or self.prompt_sent:
            return None
        self.prompt_sent = True
        return self.prompt_logprobs
