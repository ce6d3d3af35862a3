"""Request bodies of /v1/completions and /v1/chat/completions -> validated RequestMessages.

Every value check on sampling lives in SamplingParams; this module checks JSON types, the fields
this API knows (unknown ones are refused by name), the model name and the context limit, and
tokenizes. Parsing is synchronous (tokenizers are CPU work): call it from a thread.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from api.errors import ApiError
from api.model_info import ModelInfo
from api.structured import request_grammar
from api.tool_grammar import call_grammar
from api.tools import CallFormat, call_format, forced_tools, message_tool_calls, offered_tools
from worker.contract import RequestMessage
from worker.engine.sampling_params import SamplingParams

SAMPLING_FIELDS = {
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "n", "ignore_eos",
    "include_stop_str_in_output", "skip_special_tokens",
}  # fmt: skip
COMMON_FIELDS = SAMPLING_FIELDS | {"model", "stream", "stream_options", "user", "response_format", "structured_outputs",
                                   "truncate_prompt_tokens"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "prompt_logprobs", "return_tokens_as_token_ids"}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt", "continue_final_message",
    "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls", "prompt_logprobs", "return_tokens_as_token_ids",
}  # fmt: skip
# chat_template_kwargs may not name these: transformers' own apply_chat_template arguments (the
# request's fields above set the two that matter) and the tokens it gives the template
RESERVED_TEMPLATE_KWARGS = {
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "eos_token",
    "unk_token", "pad_token", "sep_token", "cls_token", "mask_token", "additional_special_tokens",
}  # fmt: skip
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_TOOL_FIELDS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}  # beside role, content and name
SEED_RANGE = (-(2**63), 2**63 - 1)
TOKENIZE_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
TOKENIZE_CHAT_FIELDS = {
    "model", "messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "return_token_strs",
    "tools",
}  # fmt: skip


@dataclass(frozen=True)
class ParsedRequest:
    kind: Literal["completion", "chat"]
    response_id: str  # "cmpl-..." or "chatcmpl-..."
    created: int  # unix seconds
    model: str
    requests: list[RequestMessage]  # one per prompt; a completions prompt list fans out
    prompt_texts: list[str]  # the prompt of each request as text (echo)
    n: int  # choices per prompt; choice index in the response = prompt index * n + choice
    stream: bool
    include_usage: bool  # stream_options.include_usage
    continuous_usage: bool  # stream_options.continuous_usage_stats: the usage so far on every chunk too
    echo: bool  # completions: the prompt is prepended to each choice's text
    logprobs: int | None  # alternatives per token when logprobs were asked for, else None
    # chat with tools: the format the model writes its calls in, so its output is parsed for them (tool_calls.py)
    tool_calls: CallFormat | None = None
    parallel_tool_calls: bool = True  # false: a choice keeps its first call only
    prompt_logprobs: int | None = None  # vLLM's extension: each prompt token's logprob and this many alternatives
    ids_as_tokens: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return data


def parse_completion(body: dict[str, Any], model: ModelInfo, max_prompts: int) -> ParsedRequest:
    _check_fields(body, COMPLETION_FIELDS)
    _check_model(body, model)
    logprobs = _get(body, "logprobs", int)
    echo = bool(_get(body, "echo", bool))
    scored = _prompt_logprobs(body)
    wanted = [n for n in (logprobs if echo else None, scored) if n is not None]  # the engine computes the wider
    params = _sampling_params(body, model, logprobs=logprobs, prompt_logprobs=max(wanted) if wanted else None,
                              grammar=request_grammar(body))  # fmt: skip
    raw_prompts = _prompts(_require(body, "prompt"))
    if len(raw_prompts) > max_prompts:
        raise ApiError(400, f"at most {max_prompts} prompts per request (got {len(raw_prompts)})", param="prompt")
    keep = _truncation(body, model)
    encoded = [_encode_prompt(p, model) for p in raw_prompts]
    prompt_ids = [ids[-keep:] if keep else ids for ids in encoded]
    texts = [p if isinstance(p, str) and len(ids) == len(whole) else model.decode(ids, skip_special_tokens=False)
             for p, ids, whole in zip(raw_prompts, prompt_ids, encoded)]  # fmt: skip
    return _build("completion", body, model, params, prompt_ids, texts, echo=echo, logprobs=logprobs,
                  prompt_logprobs=scored)


def parse_chat(body: dict[str, Any], model: ModelInfo) -> ParsedRequest:
    _check_fields(body, CHAT_FIELDS)
    _check_model(body, model)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise ApiError(400, "give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
    want_logprobs = bool(_get(body, "logprobs", bool))
    top = _get(body, "top_logprobs", int)
    if top is not None and not want_logprobs:
        raise ApiError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    grammar = request_grammar(body)
    tools = offered_tools(body, model.chat_template)
    if tools and logprobs is not None:
        raise ApiError(400, "logprobs cannot be combined with tools", param="logprobs")
    ids = _render_chat(body, model, tools)
    if keep := _truncation(body, model):
        ids = ids[-keep:]
    extra: dict[str, Any] = {"grammar": grammar}  # an explicit max_tokens is read by _sampling_params
    if body.get("max_tokens") is None:
        max_tokens = _get(body, "max_completion_tokens", int)
        if max_tokens is None:  # chat default: up to the context limit, which must leave room for a token
            _check_context(len(ids), None, model.max_model_len)
            max_tokens = model.max_model_len - len(ids)
        extra["max_tokens"] = max_tokens
    form = call_format(model.chat_template) if tools else None
    if form and body.get("skip_special_tokens") is None and model.is_special_token(form.tag):
        extra["skip_special_tokens"] = False  # the calls' tags must reach the text the parser reads
    if form and (forced := forced_tools(body, tools)):  # tool_choice required or a function: the reply calls
        several = body.get("tool_choice") == "required" and body.get("parallel_tool_calls") is not False
        extra["grammar"] = call_grammar(forced, form, several, model.special_token_id)
    scored = _prompt_logprobs(body)
    params = _sampling_params(body, model, logprobs=logprobs, prompt_logprobs=scored, **extra)
    parsed = _build("chat", body, model, params, [ids], [""], echo=False, logprobs=logprobs, prompt_logprobs=scored)
    if not form:
        return parsed
    return dataclasses.replace(parsed, tool_calls=form, parallel_tool_calls=body.get("parallel_tool_calls") is not False)


def _truncation(body: dict[str, Any], model: ModelInfo) -> int | None:
    """vLLM's `truncate_prompt_tokens`: a longer prompt keeps its last this many tokens (-1: as
    many as the model's context allows); None where the body leaves it out."""
    keep = _get(body, "truncate_prompt_tokens", int)
    if keep is None:
        return None
    if keep == -1:
        return model.max_model_len
    if not 1 <= keep <= model.max_model_len:
        raise ApiError(400, f"truncate_prompt_tokens must be -1 or in [1, {model.max_model_len}] (the model's context)",
                       param="truncate_prompt_tokens")  # fmt: skip
    return keep


def _prompt_logprobs(body: dict[str, Any]) -> int | None:
    """vLLM's `prompt_logprobs`: the logprob of every prompt token after the first, with this many
    alternatives (SamplingParams checks the range). Like vLLM, only in a whole response: a stream
    would carry the prompt's entries before its first token."""
    scored = _get(body, "prompt_logprobs", int)
    if scored is not None and _get(body, "stream", bool):
        raise ApiError(400, "prompt_logprobs is not available when stream is true", param="prompt_logprobs")
    return scored


def _render_chat(body: dict[str, Any], model: ModelInfo, tools: list[dict[str, Any]] | None) -> list[int]:
    """The body's messages (and the tools offered) through the model's chat template, with its
    template switches -> prompt ids."""
    if not model.has_chat_template:
        raise ApiError(400, f"model {model.name} has no chat template; use /v1/completions", param="messages")
    messages = _messages(_require(body, "messages"))
    template = _template_options(body)
    try:
        return model.render_chat(messages, tools=tools, **template)
    except Exception as exc:  # jinja2 errors raised by the template itself (e.g. role order) belong to the client
        raise ApiError(400, f"chat template rejected the messages: {exc}", param="messages") from None


def _template_options(body: dict[str, Any]) -> dict[str, Any]:
    """The chat template's switches (vLLM's extensions of the name): `add_generation_prompt`
    (default: true unless `continue_final_message`), `continue_final_message` (default false) and
    `chat_template_kwargs`, the template's own variables."""
    go_on = bool(_get(body, "continue_final_message", bool))
    prompt = _get(body, "add_generation_prompt", bool)
    if go_on and prompt:
        raise ApiError(400, "add_generation_prompt and continue_final_message cannot both be true: the first opens "
                       "a new assistant turn, the second continues the last message", param="continue_final_message")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
    for key in kwargs or {}:
        if not key.isidentifier() or key in RESERVED_TEMPLATE_KWARGS:
            hint = " (a request field of its own)" if key in CHAT_FIELDS else ""
            raise ApiError(400, f"chat_template_kwargs may not set {key!r}{hint}", param=f"chat_template_kwargs.{key}")
    return {"add_generation_prompt": not go_on if prompt is None else prompt, "continue_final_message": go_on,
            "template_kwargs": kwargs}  # fmt: skip


def parse_tokenize(body: dict[str, Any], model: ModelInfo) -> tuple[list[int], bool]:
    """vLLM's /tokenize body -> (the token ids a completions prompt or chat messages become, as
    the generation endpoints make them; whether the token strings were asked for). `model` may
    be left out."""
    chat = "messages" in body
    _check_fields(body, TOKENIZE_CHAT_FIELDS if chat else TOKENIZE_FIELDS)
    if body.get("model") is not None:
        _check_model(body, model)
    strings = bool(_get(body, "return_token_strs", bool))
    if chat:
        return _render_chat(body, model, offered_tools(body, model.chat_template)), strings
    prompt = _require(body, "prompt")
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt must be a string", param="prompt")
    special = _get(body, "add_special_tokens", bool)
    return model.encode(prompt, add_special_tokens=True if special is None else special), strings


def parse_detokenize(body: dict[str, Any], model: ModelInfo) -> list[int]:
    """vLLM's /detokenize body -> its token ids, checked against the vocabulary."""
    _check_fields(body, {"model", "tokens"})
    if body.get("model") is not None:
        _check_model(body, model)
    ids = _list_of(_require(body, "tokens"), int, "tokens", "integers")
    bad = [t for t in ids if not 0 <= t < model.vocab_size]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary ({model.vocab_size})", param="tokens")
    return list(ids)


def _build(
    kind: Literal["completion", "chat"],
    body: dict[str, Any],
    model: ModelInfo,
    params: SamplingParams,
    prompt_ids: list[list[int]],
    texts: list[str],
    *,
    echo: bool,
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> ParsedRequest:
    for ids in prompt_ids:
        _check_context(len(ids), params.max_tokens, model.max_model_len)
    _get(body, "user", str)  # accepted for OpenAI compatibility; advisory, so not used further
    stream = bool(_get(body, "stream", bool))
    include_usage, continuous_usage = _stream_options(body, stream)
    if params.seed is None:  # always seeded, so another worker can resume the same random stream
        params = dataclasses.replace(params, seed=secrets.randbelow(2**31))
    now = time.time()
    requests = [
        RequestMessage(uuid.uuid4().hex, model.name, prompt_token_ids=ids, params=params.to_dict(), enqueued_at=now)
        for ids in prompt_ids
    ]
    prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
    return ParsedRequest(
        kind=kind, response_id=prefix + requests[0].id, created=int(now), model=model.name, requests=requests,
        prompt_texts=texts, n=params.n, stream=stream, include_usage=include_usage, continuous_usage=continuous_usage,
        echo=echo, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        ids_as_tokens=bool(_get(body, "return_tokens_as_token_ids", bool)),
    )  # fmt: skip


def _sampling_params(body: dict[str, Any], model: ModelInfo, **extra: Any) -> SamplingParams:
    """Typed fields of the body -> SamplingParams, whose own checks give the range errors. A
    sampling field the body leaves out takes the checkpoint's default (ModelInfo.sampling_defaults)."""
    kwargs: dict[str, Any] = dict(model.sampling_defaults)
    for name in ("max_tokens", "min_tokens", "top_k", "n"):
        if (value := _get(body, name, int)) is not None:
            kwargs[name] = value
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if (value := _get(body, name, float)) is not None:
            kwargs[name] = value
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        if (value := _get(body, name, bool)) is not None:
            kwargs[name] = value
    if (seed := _get(body, "seed", int)) is not None:
        if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
            raise ApiError(400, "seed must fit in a signed 64-bit integer", param="seed")
        kwargs["seed"] = seed
    if (stop := body.get("stop")) is not None:
        kwargs["stop"] = (stop,) if isinstance(stop, str) else _list_of(stop, str, "stop", "strings")
    if (ids := body.get("stop_token_ids")) is not None:
        kwargs["stop_token_ids"] = _list_of(ids, int, "stop_token_ids", "integers")
    if (bias := body.get("logit_bias")) is not None:
        kwargs["logit_bias"] = _logit_bias(bias)
    kwargs.update(extra)
    try:
        params = SamplingParams(**kwargs)
        params.check_vocab(model.vocab_size)
    except ValueError as exc:
        message = str(exc)
        raise ApiError(400, message, param=message.split()[0]) from None
    return params


def _check_context(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    wanted = prompt_len + (max_tokens if max_tokens is not None else 1)
    if prompt_len == 0:
        raise ApiError(400, "prompt is empty", param="prompt")
    if wanted > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested {wanted} tokens "
            f"({prompt_len} in the prompt, {wanted - prompt_len} for the completion). "
            "Please reduce the prompt or max_tokens.",
            param="max_tokens" if prompt_len < max_model_len else "prompt",
            code="context_length_exceeded",
        )


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        message = f"unknown or unsupported parameter: {unknown[0]}"
        raise ApiError(400, message, param=unknown[0], code="unknown_parameter")


def _check_model(body: dict[str, Any], model: ModelInfo) -> None:
    name = _require(body, "model")
    if not isinstance(name, str):
        raise ApiError(400, "model must be a string", param="model")
    if name != model.name:
        raise ApiError(404, f"The model `{name}` does not exist; this server serves `{model.name}`", param="model",
                       code="model_not_found")  # fmt: skip


def _require(body: dict[str, Any], name: str) -> Any:
    if body.get(name) is None:
        raise ApiError(400, f"missing required parameter: {name}", param=name)
    return body[name]


def _get(body: dict[str, Any], name: str, kind: type) -> Any:
    """body[name] checked against a JSON type (int excludes bool; float accepts int); None if absent/null."""
    value = body.get(name)
    if value is None:
        return None
    ok = {
        str: isinstance(value, str),
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
    }[kind]
    if not ok:
        names = {str: "a string", bool: "a boolean", int: "an integer", float: "a number"}
        raise ApiError(400, f"{name} must be {names[kind]}, got {type(value).__name__}", param=name)
    return float(value) if kind is float else value


def _list_of(value: Any, kind: type, name: str, what: str) -> tuple:
    if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        raise ApiError(400, f"{name} must be a list of {what}", param=name)
    return tuple(value)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"<token id>": bias} -> ((token_id, bias), ...)."""
    if not isinstance(value, dict):
        raise ApiError(400, "logit_bias must be an object mapping token ids (as strings) to biases", param="logit_bias")
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise ApiError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias")
        if not isinstance(bias, (int, float)) or isinstance(bias, bool):
            raise ApiError(400, f"logit_bias value for {key} must be a number", param="logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def _stream_options(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats): OpenAI's field, and vLLM's extension that puts the
    usage so far on every chunk as well (only beside include_usage, as there)."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    known = {"stream_options.include_usage", "stream_options.continuous_usage_stats"}
    _check_fields({f"stream_options.{k}": v for k, v in options.items()}, known)
    include = bool(_get(options, "include_usage", bool))
    continuous = bool(_get(options, "continuous_usage_stats", bool))
    if continuous and not include:
        raise ApiError(400, "stream_options.continuous_usage_stats requires stream_options.include_usage",
                       param="stream_options.continuous_usage_stats")  # fmt: skip
    return include, continuous


def _prompts(value: Any) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(value, str):
        return [value]
    if is_ids(value):
        return [value]
    if isinstance(value, list) and value and (all(isinstance(p, str) for p in value) or all(is_ids(p) for p in value)):
        return list(value)
    raise ApiError(
        400, "prompt must be a string, a list of strings, a list of token ids, or a list of token id lists",
        param="prompt",
    )  # fmt: skip


def _encode_prompt(prompt: str | list[int], model: ModelInfo) -> list[int]:
    if isinstance(prompt, str):
        ids = model.encode(prompt)
        bos = getattr(model.tokenizer, "bos_token_id", None)
        return ids if ids or bos is None else [bos]
    bad = [t for t in prompt if not 0 <= t < model.vocab_size]
    if bad:
        raise ApiError(400, f"prompt token id {bad[0]} is outside the vocabulary ({model.vocab_size})", param="prompt")
    return list(prompt)


def _messages(value: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages -> [{"role", "content"(, "name", "tool_calls", "tool_call_id")}] with
    text-only content; an assistant message with tool calls may have none."""
    if not isinstance(value, list) or not value:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object", param=where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(CHAT_ROLES)}", param=f"{where}.role")
        known = {"role", "content", "name"} | MESSAGE_TOOL_FIELDS.get(role, set())
        extra = sorted(set(message) - known)
        if extra:
            raise ApiError(400, f"unsupported field {where}.{extra[0]}", param=f"{where}.{extra[0]}")
        calls = message_tool_calls(message["tool_calls"], where) if message.get("tool_calls") else None
        content = message.get("content")
        entry: dict[str, Any] = {"role": role, "content": "" if content is None and calls else _content(content, where)}
        if calls:
            entry["tool_calls"] = calls
        if role == "tool" and message.get("tool_call_id") is not None:
            if not isinstance(message["tool_call_id"], str):
                raise ApiError(400, f"{where}.tool_call_id must be a string", param=f"{where}.tool_call_id")
            entry["tool_call_id"] = message["tool_call_id"]
        if message.get("name") is not None:
            if not isinstance(message["name"], str):
                raise ApiError(400, f"{where}.name must be a string", param=f"{where}.name")
            entry["name"] = message["name"]
        out.append(entry)
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
        raise ApiError(400, f"{where}.content: only text parts are supported", param=f"{where}.content")
    raise ApiError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
