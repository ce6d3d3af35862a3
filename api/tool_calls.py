"""Tool calls in the Hermes format (Qwen2.5, Qwen3, Hermes and others write it): the model writes
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one per call, after any text of its own.

`ToolCallFilter` turns a chat's pieces into OpenAI's: text up to the first `<tool_call>` goes out
as content as it comes (a possible beginning of the tag is held back, as the stop checker holds a
possible stop string); from the tag on, text is held to the end of the choice, then parsed into
`tool_calls`. Text that does not parse goes out as content after all, so nothing is lost.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field, replace
from typing import Any

from api.assembly import Piece
from api.tools import END, START

_CALL = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)


def parse_calls(text: str) -> list[dict[str, Any]] | None:
    """Text from the first `<tool_call>` on -> OpenAI tool calls, or None when any call is not a
    JSON object with a string `name` (and `arguments`, an object or its JSON text). A call left
    open at the end (the model stopped before `</tool_call>`) still counts if its JSON is whole."""
    calls = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append({"id": f"call_{secrets.token_hex(12)}", "type": "function",
                      "function": {"name": call["name"], "arguments": arguments}})  # fmt: skip
    return calls or None


@dataclass
class ToolCallFilter:
    """Per-choice state over a chat's stream of pieces; `parallel`: false keeps the first call only."""

    parallel: bool = True
    _held: dict[int, str] = field(default_factory=dict)  # per choice: text not sent yet
    _calling: set[int] = field(default_factory=set)  # choices past their first START

    def feed(self, pieces: list[Piece]) -> list[Piece]:
        out = []
        for piece in pieces:
            i = piece.index
            text = self._held.pop(i, "") + piece.text
            if i not in self._calling and START in text:
                self._calling.add(i)
                before, text = text.split(START, 1)
                text = START + text
                if before:
                    out.append(Piece(i, before, None, None))
            if i in self._calling:
                held, send = text, ""
            else:
                keep = _partial_start(text)
                held, send = text[len(text) - keep :], text[: len(text) - keep]
            if piece.finish_reason is None:
                self._held[i] = held
                if send:
                    out.append(replace(piece, text=send))
                continue
            out.extend(self._finish(piece, send, held))
        return out

    def _finish(self, piece: Piece, send: str, held: str) -> list[Piece]:
        calls = parse_calls(held) if piece.index in self._calling else None
        if calls is None:  # no call, or one that does not parse: its text is the content
            return [replace(piece, text=send + held)]
        return [Piece(piece.index, "", None, "tool_calls", tool_calls=calls if self.parallel else calls[:1])]


def _partial_start(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of START."""
    for k in range(min(len(START) - 1, len(text)), 0, -1):
        if text.endswith(START[:k]):
            return k
    return 0
