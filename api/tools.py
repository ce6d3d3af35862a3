"""The tools a chat request offers, and the tool calls and results in its messages: OpenAI's
request fields checked and put in the form Hugging Face chat templates render, and the format the
model's template has it write its calls in. What the model writes back is parsed in tool_calls.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from api.errors import ApiError

START, END = "<tool_call>", "</tool_call>"  # around each call the model writes (Hermes' format)
PYTHON_TAG = "<|python_tag|>"  # may open a Llama 3 model's calls
# Llama 3.1-3.3's templates ask for calls with this sentence: the sign of their JSON format
LLAMA3_ASK = '"parameters": dictionary of argument name and its value'
TOOL_FIELDS = {"type", "function"}
FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class CallFormat:
    """How a model family writes its tool calls (tool_calls.py reads them back)."""

    name: str
    opens: tuple[str, ...]  # text that opens a reply's calls
    anywhere: bool  # calls may follow text of the model's own; else only the reply's start opens them
    tag: str  # the opening tag: where it is a special token, requests with tools keep special tokens
    shown: str  # how errors name it


# Qwen2.5, Qwen3, Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, each call
HERMES = CallFormat("hermes", (START,), anywhere=True, tag=START, shown="Hermes' <tool_call> JSON </tool_call>")
# Llama 3.1-3.3: the reply is the calls, {"name": ..., "parameters": {...}}, separated by ";"
LLAMA3_JSON = CallFormat("llama3_json", (PYTHON_TAG, "{"), anywhere=False, tag=PYTHON_TAG,
                         shown='Llama 3\'s {"name": ..., "parameters": ...}')
FORMATS = (HERMES, LLAMA3_JSON)


def call_format(chat_template: str | None) -> CallFormat | None:
    """The format a chat template has its model write tool calls in, if one tool_calls.py reads."""
    if not chat_template:
        return None
    if START in chat_template:
        return HERMES
    if LLAMA3_ASK in chat_template:
        return LLAMA3_JSON
    return None


def offered_tools(body: dict[str, Any], chat_template: str | None) -> list[dict[str, Any]] | None:
    """The body's `tools` as the template gets them, or None when the model is not to see any
    (none given, or tool_choice "none"); the model's template must write calls in a format
    tool_calls.py parses (`call_format`). tool_choice "required" or a named function is checked
    here and forced by a grammar (tool_grammar.py)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice is not None and choice not in ("none", "auto", "required") and _named(choice) is None:
        raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}", param="tool_choice")  # fmt: skip
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if tools is None:
        if choice is not None:
            raise ApiError(400, "tool_choice requires tools", param="tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise ApiError(400, "tools must be a non-empty list (leave it out for none)", param="tools")
    for i, tool in enumerate(tools):
        _check_tool(tool, f"tools[{i}]")
    if _named(choice) is not None and _named(choice) not in {t["function"]["name"] for t in tools}:
        raise ApiError(400, f"tool_choice names {_named(choice)!r}, which is not among the tools",
                       param="tool_choice.function.name")  # fmt: skip
    if choice == "none":
        return None
    if call_format(chat_template) is None:
        known = "; ".join(f.shown for f in FORMATS)
        raise ApiError(400, f"this model's chat template writes no tool calls in a format this server parses "
                       f"({known})", param="tools")  # fmt: skip
    return tools


def forced_tools(body: dict[str, Any], tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The tools a reply must call one or more of: all with tool_choice "required", the one named
    by a function tool_choice; None where the model decides."""
    choice = body.get("tool_choice")
    if choice == "required":
        return tools
    name = _named(choice)
    return None if name is None else [t for t in tools if t["function"]["name"] == name]


def _named(choice: Any) -> str | None:
    """The function name of a tool_choice {"type": "function", "function": {"name": ...}}, else None."""
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)):
        return None
    name = choice["function"].get("name")
    return name if isinstance(name, str) else None


def _check_tool(tool: Any, where: str) -> None:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ApiError(400, f"{where} must be an object with type 'function' and a function", param=where)
    _only(tool, TOOL_FIELDS, where)
    function = tool["function"]
    _only(function, FUNCTION_FIELDS, f"{where}.function")
    if not isinstance(function.get("name"), str) or not NAME.fullmatch(function["name"]):
        raise ApiError(400, f"{where}.function.name must be 1-64 letters, digits, '_' or '-'",
                       param=f"{where}.function.name")  # fmt: skip
    for key, kind, what in (("description", str, "a string"), ("parameters", dict, "an object"),
                            ("strict", bool, "a boolean")):  # fmt: skip
        if function.get(key) is not None and not isinstance(function[key], kind):
            raise ApiError(400, f"{where}.function.{key} must be {what}", param=f"{where}.function.{key}")


def message_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` (arguments as JSON text, as OpenAI sends them) -> the
    form chat templates render (arguments as an object)."""
    if not isinstance(value, list):
        raise ApiError(400, f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for k, call in enumerate(value):
        at = f"{where}.tool_calls[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, f"{at} must be an object with a function and its name", param=at)
        _only(call, {"id", "type", "function"}, at)
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, ValueError):
            raise ApiError(400, f"{at}.function.arguments must be JSON text", param=f"{at}.function.arguments") from None
        entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        out.append(entry | ({"id": call["id"]} if isinstance(call.get("id"), str) else {}))
    return out


def _only(value: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(value) - allowed)
    if extra:
        raise ApiError(400, f"unsupported field {where}.{extra[0]}", param=f"{where}.{extra[0]}")
