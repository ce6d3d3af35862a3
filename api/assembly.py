"""OutputDeltas -> OpenAI choices: stream chunks, and the whole response built from the same pieces.

A streamed response is the pieces one by one; a plain response is the pieces of each choice
concatenated, so both carry the same text and logprobs by construction.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from api.errors import ApiError
from api.model_info import ModelInfo
from api.protocol import ParsedRequest
from worker.contract import FinishReason, OutputDelta

JSON_MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclass
class Piece:
    """A contiguous part of one choice: text, its logprobs in the response's format, maybe the end."""

    index: int
    text: str
    logprobs: dict[str, list] | None
    finish_reason: str | None
    tool_calls: list[dict[str, Any]] | None = None  # chat: the calls the choice ends with (tool_calls.py)


@dataclass
class _Choice:
    started: bool = False
    text_len: int = 0  # characters already in this choice's text (for text_offset)


@dataclass
class _Request:
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    completion_tokens: int = 0
    usage: dict[str, Any] | None = None


@dataclass
class Assembler:
    parsed: ParsedRequest
    model: ModelInfo
    # what the pieces pass through before they go out (tool_calls.ToolCallFilter.feed for chats with tools)
    post: Callable[[list[Piece]], list[Piece]] | None = None
    choices: dict[int, _Choice] = field(default_factory=dict)
    requests: list[_Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.requests = [_Request() for _ in self.parsed.requests]

    def feed(self, sub: int, delta: OutputDelta) -> list[Piece]:
        """Pieces of the response carried by one delta of sub-request `sub`; raises ApiError on failure."""
        request = self.requests[sub]
        if delta.error or delta.finish_reason in (FinishReason.ERROR.value, FinishReason.ABORT.value):
            if delta.finish_reason == FinishReason.ABORT.value:
                raise ApiError(503, "the request was aborted by the server; retry it", code="aborted")
            raise ApiError(500, f"the worker could not run the request: {delta.error or 'unknown error'}",
                           code="worker_error")  # fmt: skip
        if delta.prompt_logprobs is not None:
            request.prompt_logprobs = delta.prompt_logprobs
        request.completion_tokens += len(delta.token_ids)
        if delta.usage:
            request.usage = delta.usage
        index = sub * self.parsed.n + delta.index
        choice = self.choices.setdefault(index, _Choice())
        pieces = []
        if not choice.started:
            choice.started = True
            if self.parsed.echo:
                pieces.append(self._echo_piece(sub, index, choice))
        if delta.text or delta.logprobs or delta.finish_reason:
            entries = delta.logprobs or []
            logprobs = self._format(entries, [e["token_id"] for e in entries], choice.text_len)
            choice.text_len += len(delta.text)
            pieces.append(Piece(index, delta.text, logprobs, delta.finish_reason))
        return pieces if self.post is None else self.post(pieces)

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage over the request's prompts; `prompt_tokens_details.cached_tokens` (what the
        prefix cache served) where the workers said."""
        prompt = completion = 0
        cached: int | None = None
        for message, request in zip(self.parsed.requests, self.requests):
            usage = request.usage or {}
            prompt += usage.get("prompt_tokens", len(message.prompt_token_ids))
            completion += usage.get("completion_tokens", request.completion_tokens)
            details = usage.get("prompt_tokens_details")
            if details is not None:
                cached = (cached or 0) + details.get("cached_tokens", 0)
        out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if cached is not None:
            out["prompt_tokens_details"] = {"cached_tokens": cached}
        return out

    def prompt_logprobs(self) -> list[list[dict[str, dict[str, Any]] | None]] | None:
        """vLLM's `prompt_logprobs` of each prompt, once its run is done (None unless asked for):
        per prompt token, null for the first, then {token id: {logprob, rank, decoded_token}} for
        the token and the alternatives asked for, the token first."""
        n = self.parsed.prompt_logprobs
        if n is None:
            return None
        names = _id_names if self.parsed.ids_as_tokens else self.model.token_strings
        return [[None if e is None else _scored_entry(e, n, names) for e in request.prompt_logprobs or []]
                for request in self.requests]  # fmt: skip

    def _echo_piece(self, sub: int, index: int, choice: _Choice) -> Piece:
        text = self.parsed.prompt_texts[sub]
        ids = self.parsed.requests[sub].prompt_token_ids
        n = self.parsed.logprobs or 0  # the engine's alternatives may be more, for prompt_logprobs
        computed = self.requests[sub].prompt_logprobs or [None] * len(ids)
        entries = [None if e is None else {**e, "top": e.get("top", [])[:n]} for e in computed]
        logprobs = self._format(entries, ids, 0)
        choice.text_len = len(text)
        return Piece(index, text, logprobs, None)

    def _format(self, entries: list[dict[str, Any] | None], ids: list[int], offset: int) -> dict[str, list] | None:
        if self.parsed.logprobs is None:
            return None
        names = _id_names if self.parsed.ids_as_tokens else self.model.token_strings
        if self.parsed.kind == "chat":
            return {"content": [_chat_logprob(e, names) for e in entries if e is not None]}
        return _completion_logprobs(entries, ids, offset, self.model, names)


def _id_names(ids: list[int]) -> list[str]:
    """vLLM's return_tokens_as_token_ids: each token named by its id, whatever its text."""
    return [f"token_id:{t}" for t in ids]


def _completion_logprobs(entries: list[dict[str, Any] | None], ids: list[int], offset: int, model: ModelInfo,
                         names: Callable[[list[int]], list[str]]) -> dict:
    """OpenAI legacy format: tokens, token_logprobs, top_logprobs, text_offset (None where unknown);
    `names` gives the tokens' names (their text, or their ids), the offsets count their text."""
    shown = names(ids)
    out: dict[str, list] = {"tokens": shown, "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry, string, name in zip(entries, model.token_strings(ids), shown):
        out["text_offset"].append(offset)
        offset += len(string)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(entry["logprob"]))
        top_ids = [int(t) for t, _ in entry.get("top", [])]
        top = dict(zip(names(top_ids), (_finite(lp) for _, lp in entry.get("top", []))))
        top.setdefault(name, _finite(entry["logprob"]))
        out["top_logprobs"].append(top)
    return out


def _chat_logprob(entry: dict[str, Any], names: Callable[[list[int]], list[str]]) -> dict[str, Any]:
    token = names([entry["token_id"]])[0]
    top_ids = [int(t) for t, _ in entry.get("top", [])]
    top = [
        {"token": s, "logprob": _finite(lp), "bytes": list(s.encode())}
        for s, (_, lp) in zip(names(top_ids), entry.get("top", []))
    ]
    return {"token": token, "logprob": _finite(entry["logprob"]), "bytes": list(token.encode()), "top_logprobs": top}


def _scored_entry(entry: dict[str, Any], n: int, names: Callable[[list[int]], list[str]]) -> dict[str, dict[str, Any]]:
    """One prompt token's vLLM entry: the token, then its first n alternatives (ranked 1...), by id."""
    top = entry.get("top", [])[:n]
    ids = [int(entry["token_id"])] + [int(t) for t, _ in top]
    values = [(entry["logprob"], entry["rank"])] + [(lp, k) for k, (_, lp) in enumerate(top, start=1)]
    out: dict[str, dict[str, Any]] = {}
    for token_id, text, (logprob, rank) in zip(ids, names(ids), values):
        out.setdefault(str(token_id), {"logprob": _finite(logprob), "rank": int(rank), "decoded_token": text})
    return out


def _finite(value: float) -> float:
    return max(float(value), JSON_MIN_LOGPROB) if not math.isnan(value) else JSON_MIN_LOGPROB


def merge_logprobs(parts: list[dict[str, list] | None]) -> dict[str, list] | None:
    """Concatenate the logprobs of a choice's pieces (both formats are dicts of lists)."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    return {key: [item for p in present for item in p[key]] for key in present[0]}
