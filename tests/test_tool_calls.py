"""Tool calls: the tools a chat offers rendered by the model's template as transformers renders
them, the calls the model writes (Hermes' and Llama 3's formats) parsed into OpenAI's
`tool_calls`, streamed and not, through the official `openai` client against a live API, real
Redis and a fake worker."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from api.assembly import Piece
from api.model_info import ModelInfo
from api.protocol import parse_chat
from api.tool_calls import ToolCallFilter, parse_calls
from api.tools import LLAMA3_JSON, call_format
from tests.api_support import (  # noqa: F401 (fixtures)
    MODEL_NAME, api_server, fake_worker, tiny_model, tiny_model_dir,
)
from worker import contract

TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>{% for t in tools %}{{ t | tojson }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# shaped as Meta's Llama 3.1-3.3 templates: the tools in the first user message, asked for with
# their sentence, a call as {"name", "parameters"}, a tool's result as the ipython role's output
LLAMA3_TEMPLATE = (
    "{% set first = messages[0] %}{% set rest = messages[1:] if tools else messages %}"
    "{% if tools %}<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, respond with "
    "a JSON for a function call. Respond in the format {\"name\": function name, \"parameters\": dictionary of "
    "argument name and its value}.\n\n{% for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}"
    "{{ first['content'] }}<|eot_id|>{% endif %}"
    "{% for m in rest %}{% if m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for c in m.tool_calls %}{{ '{\"name\": \"' + c.function.name + '\", \"parameters\": ' }}"
    "{{ c.function.arguments | tojson }}}{% endfor %}<|eot_id|>"
    "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ {'output': m.content} | tojson }}"
    "<|eot_id|>{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
LLAMA3_CALLS = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_weather", "parameters": {"city": "Rome"}}'
ASK = [{"role": "user", "content": "weather in Paris?"}]


def _split(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_filter_sends_text_before_the_call_and_parses_the_call_at_the_end(size):
    tools = ToolCallFilter()
    text = "Let me look it up. " + CALL + CALL.replace("Paris", "Rome")
    pieces = [Piece(0, part, None, None) for part in _split(text, size)] + [Piece(0, "", None, "stop")]
    out = [p for piece in pieces for p in tools.feed([piece])]
    assert "".join(p.text for p in out) == "Let me look it up. "
    assert "<" not in "".join(p.text for p in out)  # no part of the tag ever went out as content
    last = out[-1]
    assert last.finish_reason == "tool_calls" and [c["function"]["name"] for c in last.tool_calls] == ["get_weather"] * 2
    assert [json.loads(c["function"]["arguments"]) for c in last.tool_calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert len({c["id"] for c in last.tool_calls}) == 2 and all(c["type"] == "function" for c in last.tool_calls)


def test_filter_keeps_unparsable_calls_and_lookalikes_as_text_and_honours_parallel():
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    for text in (broken, "a <tool_ca and more", "x < y"):
        tools = ToolCallFilter()
        out = tools.feed([Piece(0, text[:5], None, None)]) + tools.feed([Piece(0, text[5:], None, "length")])
        assert "".join(p.text for p in out) == text and out[-1].finish_reason == "length" and not out[-1].tool_calls
    single = ToolCallFilter(parallel=False).feed([Piece(0, CALL + CALL, None, "stop")])
    assert len(single[-1].tool_calls) == 1
    open_call = parse_calls('<tool_call>{"name": "f", "arguments": "{}"}')  # stopped before its end tag
    assert open_call and open_call[0]["function"] == {"name": "f", "arguments": "{}"}
    assert parse_calls('<tool_call>["f"]</tool_call>') is None


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
@pytest.mark.parametrize("opening", ["", "<|python_tag|>", "\n "])
def test_llama3_calls_are_the_whole_reply_and_parse_at_the_end(size, opening):
    tools = ToolCallFilter(LLAMA3_JSON)
    text = opening + LLAMA3_CALLS
    pieces = [Piece(0, part, None, None) for part in _split(text, size)] + [Piece(0, "", None, "stop")]
    out = [p for piece in pieces for p in tools.feed([piece])]
    assert "".join(p.text for p in out) == ""  # nothing went out as content
    last = out[-1]
    assert last.finish_reason == "tool_calls" and [c["function"]["name"] for c in last.tool_calls] == ["get_weather"] * 2
    assert [json.loads(c["function"]["arguments"]) for c in last.tool_calls] == [{"city": "Paris"}, {"city": "Rome"}]


def test_llama3_text_streams_at_once_and_what_does_not_parse_stays_text():
    tools = ToolCallFilter(LLAMA3_JSON)
    first = tools.feed([Piece(0, "Sure", None, None)])
    assert [p.text for p in first] == ["Sure"]  # a reply that opens with words is no call: sent as it comes
    rest = tools.feed([Piece(0, ' {"name": "get_weather", "parameters": {}}', None, "stop")])
    assert rest[0].text.startswith(" {") and rest[0].finish_reason == "stop" and not rest[0].tool_calls
    for text in ('{"a": 1}', '{"name": "f", "parameters": {', '<|python_tag|>brave_search.call(query="x")',
                 '{"name": "f", "parameters": {}} and then words', "<|pyth"):
        tools = ToolCallFilter(LLAMA3_JSON)
        out = tools.feed([Piece(0, text[:3], None, None)]) + tools.feed([Piece(0, text[3:], None, "length")])
        assert "".join(p.text for p in out) == text and out[-1].finish_reason == "length" and not out[-1].tool_calls
    single = ToolCallFilter(LLAMA3_JSON, parallel=False).feed([Piece(0, LLAMA3_CALLS, None, "stop")])
    assert len(single[-1].tool_calls) == 1
    arguments = parse_calls('{"name": "f", "arguments": "{\\"x\\": 1}"}', LLAMA3_JSON)[0]["function"]["arguments"]
    assert json.loads(arguments) == {"x": 1}  # arguments given as JSON text pass through


def test_the_call_format_is_read_from_the_template():
    assert call_format(TOOLS_TEMPLATE).name == "hermes" and call_format(LLAMA3_TEMPLATE).name == "llama3_json"
    assert call_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None and call_format(None) is None


def _tools_model(tiny_model_dir: Path, tmp_path: Path, template: str = TOOLS_TEMPLATE) -> tuple[Path, ModelInfo]:
    """The tiny model's tokenizer with a chat template that renders tools and calls, and room for
    a tool's schema in the prompt (byte-level tokens: about one per character)."""
    folder = shutil.copytree(tiny_model_dir, tmp_path / "tools-model")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 2048}))
    model = ModelInfo.load(str(folder), MODEL_NAME)
    model.tokenizer.chat_template = template
    return folder, model


@pytest.fixture
def tools_api(redis_url, redis_client, tiny_model_dir, tmp_path):
    """A live API over `_tools_model`."""
    folder, model = _tools_model(tiny_model_dir, tmp_path)
    with api_server(redis_url, folder, model) as server:
        yield server.url, model


@pytest.fixture
def llama3_api(redis_url, redis_client, tiny_model_dir, tmp_path):
    """A live API over `_tools_model` with a Llama 3 template."""
    folder, model = _tools_model(tiny_model_dir, tmp_path, LLAMA3_TEMPLATE)
    with api_server(redis_url, folder, model) as server:
        yield server.url, model


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20)


def test_calls_come_back_as_tool_calls_streamed_and_not(tools_api, fake_worker):
    url, model = tools_api
    worker = fake_worker(reply="Looking. " + CALL)
    client = _client(url)
    result = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER], max_tokens=100)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Looking. "
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    reference = model.tokenizer.apply_chat_template(ASK, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert worker.seen[0].prompt_token_ids == model.tokenizer.encode(reference, add_special_tokens=False)

    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER], max_tokens=100,
                                                 stream=True))  # fmt: skip
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert content == "Looking. " and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        (0, "get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("form", ["hermes", "llama3"])
def test_a_conversation_with_a_call_and_its_result_renders_as_transformers_does(redis_url, tiny_model_dir, tmp_path,
                                                                                fake_worker, form):  # fmt: skip
    folder, model = _tools_model(tiny_model_dir, tmp_path, TOOLS_TEMPLATE if form == "hermes" else LLAMA3_TEMPLATE)
    worker = fake_worker(reply="It is sunny.")
    called = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [called]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]  # fmt: skip
    with api_server(redis_url, folder, model) as server:
        result = _client(server.url).chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER],
                                                             max_tokens=20)  # fmt: skip
    choice = result.choices[0]
    assert choice.message.content == "It is sunny." and choice.message.tool_calls is None and choice.finish_reason == "stop"
    as_dicts = [dict(messages[1], content="", tool_calls=[dict(called, function={"name": "get_weather",
                                                                                "arguments": {"city": "Paris"}})])]
    rendered = model.tokenizer.apply_chat_template(ASK + as_dicts + messages[2:], tools=[WEATHER], tokenize=False,
                                                   add_generation_prompt=True)  # fmt: skip
    assert worker.seen[0].prompt_token_ids == model.tokenizer.encode(rendered, add_special_tokens=False)
    if form == "hermes":
        assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in rendered
    else:
        assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in rendered
        assert '{"output": "sunny, 21 C"}' in rendered


def test_llama3_calls_come_back_as_tool_calls_streamed_and_not(llama3_api, fake_worker):
    url, model = llama3_api
    worker = fake_worker(reply=LLAMA3_CALLS)
    client = _client(url)
    want = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    result = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER], max_tokens=300)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == want
    reference = model.tokenizer.apply_chat_template(ASK, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert "Given the following functions" in reference and '"get_weather"' in reference
    assert worker.seen[0].prompt_token_ids == model.tokenizer.encode(reference, add_special_tokens=False)

    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER], max_tokens=300,
                                                 stream=True))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        (k, *call) for k, call in enumerate(want)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def _accepts(model: ModelInfo, grammar: str, text: str) -> bool:
    """Whether llguidance's matcher of `grammar` takes `text` (the tiny model's tokens) whole."""
    import llguidance
    import llguidance.hf

    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(model.tokenizer, n_vocab=model.vocab_size), grammar)
    ok = all(matcher.consume_token(t) for t in model.tokenizer.encode(text, add_special_tokens=False))
    return ok and matcher.is_accepting()


TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"]}}}  # fmt: skip


@pytest.mark.parametrize("form", ["hermes", "llama3"])
def test_a_required_or_named_tool_choice_is_a_grammar_of_calls(redis_url, tiny_model_dir, tmp_path, fake_worker,
                                                                form):  # fmt: skip
    """tool_choice "required" lets the reply call any tool, one or more (one without parallel
    calls); a named function only that one, with arguments that keep to its parameters; the
    reply comes back as tool_calls."""
    template = TOOLS_TEMPLATE if form == "hermes" else LLAMA3_TEMPLATE
    paris = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' if form == "hermes"
             else '{"name": "get_weather", "parameters": {"city": "Paris"}}')
    utc = paris.replace("get_weather", "get_time").replace('"city": "Paris"', '"zone": "utc"')
    folder, model = _tools_model(tiny_model_dir, tmp_path, template)
    worker = fake_worker(reply=paris)
    with api_server(redis_url, folder, model) as server:
        client = _client(server.url)
        ask = dict(model=MODEL_NAME, messages=ASK, tools=[WEATHER, TIME], max_tokens=300)
        result = client.chat.completions.create(**ask, tool_choice="required")
        named = client.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "get_time"}})
        single = client.chat.completions.create(**ask, tool_choice="required", parallel_tool_calls=False)
    assert result.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in result.choices[0].message.tool_calls] == ["get_weather"]
    required, only_time, one = (m.params["grammar"] for m in worker.seen)
    both = paris + ("\n" if form == "hermes" else "; ") + utc
    assert _accepts(model, required, paris) and _accepts(model, required, utc) and _accepts(model, required, both)
    assert _accepts(model, one, paris) and not _accepts(model, one, both)
    assert _accepts(model, only_time, utc) and not _accepts(model, only_time, paris)
    for grammar in (required, only_time):
        assert not _accepts(model, grammar, "It is sunny.")
        assert not _accepts(model, grammar, utc.replace("utc", "mars"))  # outside the parameters' enum
    plain = parse_chat({"model": MODEL_NAME, "messages": ASK, "tools": [WEATHER]}, model)
    assert plain.requests[0].params["grammar"] is None  # auto: the model decides


def test_tool_choice_none_hides_the_tools_and_parses_nothing(tools_api, fake_worker):
    url, model = tools_api
    worker = fake_worker(reply=CALL)
    result = _client(url).chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER], tool_choice="none",
                                                  max_tokens=100)  # fmt: skip
    assert result.choices[0].message.content == CALL and result.choices[0].finish_reason == "stop"
    plain = model.tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    assert worker.seen[0].prompt_token_ids == model.tokenizer.encode(plain, add_special_tokens=False)


@pytest.mark.parametrize("extra,param", [
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "min_tokens": 3}, "min_tokens"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "logprobs": True}, "logprobs"),
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [dict(WEATHER, extra=1)]}, "tools[0].extra"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]}, "messages[0].tool_call_id"),
])  # fmt: skip
def test_bad_tool_requests_are_refused_and_queue_nothing(tools_api, redis_client, extra, param):
    url, _ = tools_api
    response = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL_NAME, "messages": ASK, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert redis_client.xlen(contract.REQUESTS) == 0


def test_a_template_without_the_call_format_refuses_tools(redis_url, tiny_model_dir, tiny_model, redis_client):
    with api_server(redis_url, tiny_model_dir, tiny_model) as server:
        response = httpx.post(f"{server.url}/v1/chat/completions",
                              json={"model": MODEL_NAME, "messages": ASK, "tools": [WEATHER]})  # fmt: skip
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
    assert "<tool_call>" in response.json()["error"]["message"]
    assert redis_client.xlen(contract.REQUESTS) == 0


def test_where_the_tag_is_a_special_token_the_worker_keeps_special_tokens_in_the_text(tiny_model_dir, tmp_path):
    """Hermes-style tokenizers make <tool_call> a special token, which decoding with
    skip_special_tokens drops: with tools offered, the request asks the worker to keep them,
    unless it says otherwise; without tools nothing changes."""
    from api.protocol import parse_chat

    _, model = _tools_model(tiny_model_dir, tmp_path)
    body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 8}
    assert parse_chat(body | {"tools": [WEATHER]}, model).requests[0].params["skip_special_tokens"] is True
    model.tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    assert model.is_special_token("<tool_call>") and not model.is_special_token("get_weather")
    assert parse_chat(body | {"tools": [WEATHER]}, model).requests[0].params["skip_special_tokens"] is False
    _, llama = _tools_model(tiny_model_dir, tmp_path / "llama", LLAMA3_TEMPLATE)
    llama.tokenizer.add_special_tokens({"additional_special_tokens": ["<|python_tag|>"]})
    assert parse_chat(body | {"tools": [WEATHER]}, llama).requests[0].params["skip_special_tokens"] is False
    asked = parse_chat(body | {"tools": [WEATHER], "skip_special_tokens": True}, model).requests[0]
    assert asked.params["skip_special_tokens"] is True and parse_chat(body, model).requests[0].params[
        "skip_special_tokens"] is True


def test_named_templates_take_tools_through_the_tool_use_one(tiny_model_dir, tmp_path):
    """A tokenizer with named chat templates: transformers renders a chat with tools through its
    "tool_use" template, and that one's call format is what counts."""
    from api.protocol import parse_chat

    _, model = _tools_model(tiny_model_dir, tmp_path)
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    model.tokenizer.chat_template = {"default": plain, "tool_use": TOOLS_TEMPLATE}
    body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 8}
    with_tools = parse_chat(body | {"tools": [WEATHER]}, model)
    assert with_tools.tool_calls and "get_weather" in model.decode(with_tools.requests[0].prompt_token_ids)
    assert model.decode(parse_chat(body, model).requests[0].prompt_token_ids) == "weather in Paris?"
