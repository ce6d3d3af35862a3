"""The tool calls a model writes -> OpenAI's `tool_calls`, in the formats of tools.py:

- Hermes (Qwen2.5, Qwen3, Hermes and others): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one per call, after any text of the model's own;
- Llama 3.1-3.3 JSON: the reply is the calls, `{"name": ..., "parameters": {...}}`, several
  separated by ";", maybe after `<|python_tag|>`.

`ToolCallFilter` turns a chat's pieces into OpenAI's: text before the calls goes out as content as
it comes (a possible beginning of an opening is held back, as the stop checker holds a possible
stop string); from the opening on, text is held to the end of the choice, then parsed into
`tool_calls`. Text that does not parse goes out as content after all, so nothing is lost.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field, replace
from typing import Any

from api.assembly import Piece
from api.tools import END, HERMES, PYTHON_TAG, START, CallFormat

_HERMES_CALL = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)
_SEPARATOR = re.compile(r"\s*;?\s*")  # between Llama 3's calls


def parse_calls(text: str, form: CallFormat = HERMES) -> list[dict[str, Any]] | None:
    """Text from the calls' opening on -> OpenAI tool calls, or None when any call is not a JSON
    object with a string `name` (and `arguments` or `parameters`, an object or its JSON text)."""
    bodies = _hermes_bodies(text) if form == HERMES else _llama3_bodies(text)
    calls = [_call(body) for body in bodies or ()]
    return calls if calls and None not in calls else None


def _hermes_bodies(text: str) -> list[Any] | None:
    """A call left open at the end (the model stopped before `</tool_call>`) still counts if its
    JSON is whole."""
    try:
        return [json.loads(body) for body in _HERMES_CALL.findall(text)]
    except ValueError:
        return None


def _llama3_bodies(text: str) -> list[Any] | None:
    body = text.strip().removeprefix(PYTHON_TAG)
    decoder, pos, out = json.JSONDecoder(), _SEPARATOR.match(body).end(), []
    while pos < len(body):
        try:
            value, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        out.append(value)
        pos = _SEPARATOR.match(body, pos).end()
    return out


def _call(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": value["name"], "arguments": arguments}}  # fmt: skip


@dataclass
class ToolCallFilter:
    """Per-choice state over a chat's stream of pieces; `parallel`: false keeps the first call only."""

    form: CallFormat = HERMES
    parallel: bool = True
    _held: dict[int, str] = field(default_factory=dict)  # per choice: text not sent yet
    _calling: set[int] = field(default_factory=set)  # choices past the opening of their calls
    _plain: set[int] = field(default_factory=set)  # choices whose reply began without calls (Llama 3)

    def feed(self, pieces: list[Piece]) -> list[Piece]:
        out = []
        for piece in pieces:
            i = piece.index
            text = self._held.pop(i, "") + piece.text
            if i not in self._calling and i not in self._plain:
                before, text = self._opening(i, text)
                if before:
                    out.append(Piece(i, before, None, None))
            keep = len(text) if i in self._calling else 0 if i in self._plain else self._undecided(text)
            held, send = text[len(text) - keep :], text[: len(text) - keep]
            if piece.finish_reason is None:
                self._held[i] = held
                if send:
                    out.append(replace(piece, text=send))
                continue
            out.extend(self._finish(piece, send, held))
        return out

    def _opening(self, i: int, text: str) -> tuple[str, str]:
        """(text before the calls, the rest); marks choice i calling once its calls open, or plain
        once its reply began otherwise (a format whose calls only open a reply)."""
        if self.form.anywhere:
            at = text.find(START)
            if at < 0:
                return "", text
            self._calling.add(i)
            return text[:at], text[at:]
        start = text.lstrip()
        if start.startswith(self.form.opens):
            self._calling.add(i)
        elif start and not any(o.startswith(start) for o in self.form.opens):
            self._plain.add(i)
        return "", text

    def _undecided(self, text: str) -> int:
        """How much of an undecided choice's text to hold: what may still become the opening."""
        if not self.form.anywhere:
            return len(text)  # blanks, or the start of <|python_tag|>
        for k in range(min(len(START) - 1, len(text)), 0, -1):  # the longest suffix that begins START
            if text.endswith(START[:k]):
                return k
        return 0

    def _finish(self, piece: Piece, send: str, held: str) -> list[Piece]:
        calls = parse_calls(held, self.form) if piece.index in self._calling else None
        if calls is None:  # no call, or one that does not parse: its text is the content
            return [replace(piece, text=send + held)]
        return [Piece(piece.index, "", None, "tool_calls", tool_calls=calls if self.parallel else calls[:1])]
