"""RequestOutput: what one engine step produced for one choice of one request. No JAX."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class RequestOutput:
    """What one step produced for one choice of one request (deltas, not totals)."""

    request_id: str
    index: int  # choice
    token_ids: list[int]
    text: str
    logprobs: list[dict[str, Any]] | None = None  # per new token: token_id, logprob, top [[id, lp], ...]
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # once, first entry None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far for this choice
    num_cached_tokens: int = 0  # the request's prompt tokens the prefix cache served (first admission)
    request_finished: bool = False  # every choice of the request is done
