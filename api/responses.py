"""OpenAI response bodies: stream chunks and whole responses for completions and chat."""

from __future__ import annotations

from typing import Any

from api.assembly import Piece, merge_logprobs
from api.protocol import ParsedRequest


def _envelope(parsed: ParsedRequest, stream: bool) -> dict[str, Any]:
    if parsed.kind == "completion":
        kind = "text_completion"
    else:
        kind = "chat.completion.chunk" if stream else "chat.completion"
    return {"id": parsed.response_id, "object": kind, "created": parsed.created, "model": parsed.model}


def _usage_field(parsed: ParsedRequest, usage: dict[str, Any] | None) -> dict[str, Any]:
    """A stream chunk's usage: absent unless include_usage; then null, or the usage so far where
    continuous_usage_stats asked for it."""
    if not parsed.include_usage:
        return {}
    return {"usage": usage if parsed.continuous_usage else None}


def role_chunk(parsed: ParsedRequest, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """First chat chunk: every choice's assistant role."""
    choices = [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        for i in range(parsed.n * len(parsed.requests))
    ]
    return {**_envelope(parsed, True), "choices": choices, **_usage_field(parsed, usage)}


def piece_chunk(parsed: ParsedRequest, piece: Piece, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    if parsed.kind == "chat":
        delta = {"content": piece.text} if piece.text or not piece.finish_reason else {}
        if piece.tool_calls:  # each call whole, in one chunk
            delta = {"tool_calls": [{"index": k, **call} for k, call in enumerate(piece.tool_calls)]}
        choice = {"index": piece.index, "delta": delta}
    else:
        choice = {"index": piece.index, "text": piece.text}
    choice |= {"logprobs": piece.logprobs, "finish_reason": piece.finish_reason}
    return {**_envelope(parsed, True), "choices": [choice], **_usage_field(parsed, usage)}


def usage_chunk(parsed: ParsedRequest, usage: dict[str, int]) -> dict[str, Any]:
    """Last chunk when stream_options.include_usage: no choices, the request's usage."""
    return {**_envelope(parsed, True), "choices": [], "usage": usage}


def full_response(parsed: ParsedRequest, pieces: list[Piece], usage: dict[str, int],
                  prompt_logprobs: list[list | None] | None = None) -> dict[str, Any]:
    """The non-streamed body: each choice's pieces joined; `prompt_logprobs` (Assembler's, one
    list per prompt) on each completion choice, or beside a chat's choices, as vLLM puts them."""
    choices = []
    for index in range(parsed.n * len(parsed.requests)):
        own = [p for p in pieces if p.index == index]
        text = "".join(p.text for p in own)
        finish = next((p.finish_reason for p in reversed(own) if p.finish_reason), "stop")
        logprobs = merge_logprobs([p.logprobs for p in own]) if parsed.logprobs is not None else None
        if parsed.kind == "chat":
            calls = [call for p in own for call in p.tool_calls or ()]
            message = {"role": "assistant", "content": text}
            if calls:  # OpenAI's content is null beside calls unless the model wrote text first
                message = {"role": "assistant", "content": text or None, "tool_calls": calls}
            choice = {"index": index, "message": message}
        else:
            choice = {"index": index, "text": text}
        choice |= {"logprobs": logprobs, "finish_reason": finish}
        if prompt_logprobs is not None and parsed.kind == "completion":
            choice["prompt_logprobs"] = prompt_logprobs[index // parsed.n]
        choices.append(choice)
    body = {**_envelope(parsed, False), "choices": choices, "usage": usage}
    if prompt_logprobs is not None and parsed.kind == "chat":
        body["prompt_logprobs"] = prompt_logprobs[0]
    return body
