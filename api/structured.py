"""Structured output: a request's `response_format` (OpenAI's JSON modes) or `structured_outputs`
(vLLM's: a JSON schema, a regular expression, a choice of strings or a Lark grammar) -> the
grammar the worker constrains its tokens to (worker/engine/grammar.py), in llguidance's JSON form.
Checked here, so a schema or pattern that does not compile is a 400 and nothing is queued."""

from __future__ import annotations

import json
from typing import Any

import llguidance

from api.errors import ApiError

ANY_OBJECT = {"type": "object"}  # response_format json_object: some JSON object
# JSON with fixed separators (", ", ": ", as json.dumps and chat templates' tojson write it) and no
# other blanks, unless a schema's own "x-guidance" says otherwise: free whitespace let a weak model
# write blank lines until max_tokens
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
REGEX_META = set("\\.+*?()|[]{}^$#&-~")  # what a literal escapes in llguidance's (Rust's) regular expressions
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's structured_outputs fields


def request_grammar(body: dict[str, Any]) -> str | None:
    """The grammar a completions or chat body asks its output to follow, or None."""
    fmt, structured = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and structured is not None:
        raise ApiError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
    grammar = _response_format(fmt) if fmt is not None else _structured(structured) if structured is not None else None
    if grammar is None:
        return None
    for name in ("min_tokens", "ignore_eos"):
        if body.get(name):
            raise ApiError(400, f"{name} cannot be combined with structured output: a finished grammar allows only "
                           "an end-of-sequence token", param=name)  # fmt: skip
    if body.get("tools") and body.get("tool_choice") != "none":
        raise ApiError(400, "tools cannot be combined with structured output", param="tools")
    return grammar


def _response_format(value: Any) -> str | None:
    """OpenAI's response_format: text (no grammar), json_object or json_schema."""
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str):
        raise ApiError(400, "response_format must be an object with a type", param="response_format")
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return _schema(ANY_OBJECT, "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if set(value) != {"type", "json_schema"} or not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ApiError(400, "response_format json_schema needs json_schema: {name, schema, strict?, description?}",
                           param="response_format.json_schema")  # fmt: skip
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise ApiError(400, "json_schema.schema must be an object", param="response_format.json_schema.schema")
        return _schema(schema, "response_format.json_schema.schema")
    raise ApiError(400, f"response_format {kind!r} is not supported: text, json_object or json_schema",
                   param="response_format.type")  # fmt: skip


def _structured(value: Any) -> str:
    """vLLM's structured_outputs: exactly one of json (a schema, or its text), regex, choice (a
    list of strings), grammar (Lark) or json_object (true)."""
    given = [k for k in STRUCTURED_KINDS if isinstance(value, dict) and value.get(k) not in (None, False)]
    if not isinstance(value, dict) or len(given) != 1 or set(value) - set(STRUCTURED_KINDS):
        raise ApiError(400, f"structured_outputs must give exactly one of {', '.join(STRUCTURED_KINDS)}",
                       param="structured_outputs")  # fmt: skip
    kind, spec = given[0], value[given[0]]
    where = f"structured_outputs.{kind}"
    make = llguidance.LLMatcher
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError:
                raise ApiError(400, "structured_outputs.json must be a JSON schema", param=where) from None
        if not isinstance(spec, dict):
            raise ApiError(400, "structured_outputs.json must be a JSON schema (an object)", param=where)
        return _schema(spec, where)
    if kind == "json_object":
        if spec is not True:
            raise ApiError(400, "structured_outputs.json_object must be true", param=where)
        return _schema(ANY_OBJECT, where)
    if kind == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(s, str) and s for s in spec):
            raise ApiError(400, "structured_outputs.choice must be a list of non-empty strings", param=where)
        return compiled(make.grammar_from_regex("|".join(f"(?:{_literal(s)})" for s in spec)), where)
    if not isinstance(spec, str) or not spec:
        raise ApiError(400, f"{where} must be a non-empty string", param=where)
    grammar = make.grammar_from_regex(spec) if kind == "regex" else make.grammar_from_lark(spec)
    return compiled(grammar, where)


def _literal(text: str) -> str:
    return "".join("\\" + c if c in REGEX_META else c for c in text)


def _schema(schema: dict[str, Any], where: str) -> str:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    except (ValueError, TypeError) as exc:
        raise ApiError(400, f"the JSON schema is not supported: {exc}", param=where) from None
    return compiled(grammar, where)


def compiled(grammar: str, where: str) -> str:
    """The grammar (llguidance's JSON form, or Lark text), once llguidance has compiled it (a 400
    naming what it could not)."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ApiError(400, f"{where} does not compile: {error.strip()}", param=where)
    return grammar
