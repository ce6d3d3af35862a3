"""tool_choice "required" or a named function: the grammar that makes the reply calls, in the
format the model's template writes (tools.py), each call's arguments held to its function's
parameter schema. A Lark grammar with llguidance's inline JSON schemas (%json)."""

from __future__ import annotations

import json
from typing import Any

from api.structured import JSON_DEFAULTS, compiled
from api.tools import END, HERMES, START, CallFormat


def call_grammar(tools: list[dict[str, Any]], form: CallFormat, several: bool, token_id) -> str:
    """A Lark grammar whose sentences are calls of `tools` in format `form`, one or (`several`)
    more. `token_id(text)`: the id of a special token spelled `text`, or None where it is text."""
    key = "arguments" if form == HERMES else "parameters"
    bodies = [f"f{i}: %json {json.dumps(_call_schema(t['function'], key))}" for i, t in enumerate(tools)]
    choice = " | ".join(f"f{i}" for i in range(len(tools)))
    if form == HERMES:  # as Qwen's and Hermes' templates write them: the tags on lines of their own
        call = f'call: {_term(START, token_id)} "\\n" ({choice}) "\\n" {_term(END, token_id)}'
        start = 'start: call ("\\n" call)*' if several else "start: call"
    else:  # Llama 3: the reply is the calls, separated by "; "
        call = f"call: {choice}"
        start = 'start: call ("; " call)*' if several else "start: call"
    return compiled("\n".join([start, call, *bodies]), "tool_choice")


def _call_schema(function: dict[str, Any], key: str) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, key: parameters},
            "required": ["name", key], "additionalProperties": False, "x-guidance": JSON_DEFAULTS}  # fmt: skip


def _term(text: str, token_id) -> str:
    """A tag as Lark writes it: the special token by id where it is one, else the quoted text."""
    special = token_id(text)
    return f"<[{special}]>" if special is not None else json.dumps(text)
