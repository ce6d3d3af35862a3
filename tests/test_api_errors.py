"""Bad requests get the right status in OpenAI's error format and never reach the request stream."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.api_support import (  # noqa: F401
    MODEL_NAME, api_server, eventually, fake_worker, heartbeat, start_api, tiny_model, tiny_model_dir,
)
from worker import contract

LONG_PROMPT = "hello world " * 100  # about 200 tokens; the tiny model allows 128

COMPLETION_CASES = [
    ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    ({"prompt": "hi", "min_tokens": "3"}, 400, "min_tokens"),
    ({"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "temperature": 101}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ({"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ({"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ({"prompt": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"prompt": "hi", "truncate_prompt_tokens": 100000}, 400, "truncate_prompt_tokens"),
    ({"prompt": "hi", "return_tokens_as_token_ids": "yes"}, 400, "return_tokens_as_token_ids"),
    ({"prompt": "hi", "structured_outputs": {"regex": "a("}}, 400, "structured_outputs.regex"),
    ({"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs"),
    ({"prompt": "hi", "structured_outputs": {"choice": []}}, 400, "structured_outputs.choice"),
    ({"prompt": "hi", "structured_outputs": {"grammar": "start: x"}}, 400, "structured_outputs.grammar"),
    ({"prompt": "hi", "structured_outputs": {"json": "{not json"}}, 400, "structured_outputs.json"),
    ({"prompt": "hi", "structured_outputs": {"json_object": True}, "ignore_eos": True}, 400, "ignore_eos"),
    ({"prompt": "hi", "structured_outputs": {"xml": "<a/>"}}, 400, "structured_outputs"),
    ({"prompt": "hi", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "n": True}, 400, "n"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ({"prompt": "hi", "stop": 5}, 400, "stop"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "hi", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": 200}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "echo": "yes"}, 400, "echo"),
    ({"prompt": "hi", "user": 5}, 400, "user"),
    ({"prompt": "hi", "best_of": 2}, 400, "best_of"),
    ({"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "hi", "stream": True, "stream_options": {"bogus": 1}}, 400, "stream_options.bogus"),
    ({"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400,
     "stream_options.continuous_usage_stats"),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": 1}}, 400,
     "continuous_usage_stats"),
    ({"prompt": "hi", "chat_template_kwargs": {}}, 400, "chat_template_kwargs"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ["a", [1]]}, 400, "prompt"),
    ({"prompt": [1, 99999]}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": LONG_PROMPT}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": 200}, 400, "max_tokens"),
    ({"prompt": ["hi"] * 65}, 400, "prompt"),
]

CHAT_CASES = [
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, 400, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, 400, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": []}, 400, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "echo": True}, 400, "echo"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": "2"}, 400, "prompt_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 0, "stream": True}, 400, "prompt_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "max_completion_tokens": 1}, 400,
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "prompt"),
    ({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"}, 400, "add_generation_prompt"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, 400,
     "response_format.type"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {}}},
     400, "response_format.json_schema"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, 400, "response_format.json_schema.schema"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}, "min_tokens": 2},
     400, "min_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"},
      "structured_outputs": {"regex": "a"}}, 400, "structured_outputs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": "text"}, 400, "response_format"),
    ({"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True,
      "add_generation_prompt": True}, 400, "continue_final_message"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": ["a"]}, 400, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": True}}, 400,
     "chat_template_kwargs.tokenize"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"bos_token": "<x>"}}, 400,
     "chat_template_kwargs.bos_token"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"add_generation_prompt": False}},
     400, "chat_template_kwargs.add_generation_prompt"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"not a name": 1}}, 400,
     "chat_template_kwargs.not a name"),
]


def _assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["x-request-id"]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.fixture(scope="module")
def shared_api(redis_url, tiny_model_dir, tiny_model):
    with api_server(redis_url, tiny_model_dir, tiny_model) as server:
        yield server.url


@pytest.fixture
def api(shared_api, redis_client):
    yield shared_api
    assert redis_client.xlen(contract.REQUESTS) == 0  # nothing was enqueued


@pytest.mark.parametrize("body,status,param", COMPLETION_CASES)
def test_bad_completion(api, body, status, param):
    response = httpx.post(f"{api}/v1/completions", json={"model": MODEL_NAME, **body})
    assert _assert_openai_error(response, status)["param"] == param


@pytest.mark.parametrize("body,status,param", CHAT_CASES)
def test_bad_chat(api, body, status, param):
    response = httpx.post(f"{api}/v1/chat/completions", json={"model": MODEL_NAME, **body})
    assert _assert_openai_error(response, status)["param"] == param


def test_context_length_message(api):
    response = httpx.post(f"{api}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 200})
    error = _assert_openai_error(response, 400)
    assert error["code"] == "context_length_exceeded" and "maximum context length is 128" in error["message"]


def test_unknown_model_is_404(api):
    response = httpx.post(f"{api}/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert _assert_openai_error(response, 404)["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=f"{api}/v1", api_key="x", max_retries=0).completions.create(model="gpt-9", prompt="hi")


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_malformed_json(api, raw):
    response = httpx.post(f"{api}/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert _assert_openai_error(response, 400)["code"] == "invalid_json"


def test_routes_and_methods(api):
    _assert_openai_error(httpx.get(f"{api}/v1/nothing"), 404)
    _assert_openai_error(httpx.get(f"{api}/v1/completions"), 405)
    _assert_openai_error(httpx.get(f"{api}/tokenize"), 405)
    assert _assert_openai_error(httpx.get(f"{api}/v1/models/gpt-4"), 404)["code"] == "model_not_found"


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": [1, 2]}, "prompt"),
    ("/tokenize", {"prompt": "hi", "model": "gpt-4"}, "model"),
    ("/tokenize", {"prompt": "hi", "max_tokens": 3}, "max_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("/detokenize", {"tokens": "hi"}, "tokens"),
    ("/detokenize", {"tokens": [99999]}, "tokens"),
    ("/detokenize", {"tokens": [1], "prompt": "x"}, "prompt"),
])  # fmt: skip
def test_bad_tokenize_and_detokenize(api, path, body, param):
    response = httpx.post(f"{api}{path}", json=body)
    assert _assert_openai_error(response, 404 if param == "model" else 400)["param"] == param


def test_body_too_large(start_api, redis_client):
    url = start_api(max_body_bytes=2048)
    body = {"model": MODEL_NAME, "prompt": "x" * 4096}
    _assert_openai_error(httpx.post(f"{url}/v1/completions", json=body), 413)

    def chunks():  # no Content-Length: the limit applies while the body is read
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(8):
            yield b"x" * 512
        yield b'"}'

    _assert_openai_error(httpx.post(f"{url}/v1/completions", content=chunks()), 413)
    assert redis_client.xlen(contract.REQUESTS) == 0


def test_api_key(start_api, redis_client):
    url = start_api(api_key="sekrit")
    body = {"model": MODEL_NAME, "prompt": "hi"}
    _assert_openai_error(httpx.post(f"{url}/v1/completions", json=body), 401)
    wrong = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert _assert_openai_error(wrong, 401)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
    assert openai.OpenAI(base_url=f"{url}/v1", api_key="sekrit", max_retries=0).models.list().data
    for path in ("/tokenize", "/detokenize"):  # the tokenizer's routes too, though outside /v1
        _assert_openai_error(httpx.post(f"{url}{path}", json={"prompt": "hi", "tokens": [1]}), 401)
    keyed = httpx.post(f"{url}/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer sekrit"})
    assert keyed.status_code == 200 and keyed.json()["count"] > 0
    assert httpx.get(f"{url}/health").status_code == 200  # only /v1/* and those are guarded
    assert redis_client.xlen(contract.REQUESTS) == 0


def test_queue_full_is_429(start_api, redis_client):
    url = start_api(max_queue_len=2)
    for _ in range(2):
        redis_client.xadd(contract.REQUESTS, {"data": "{}"})
    response = httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"})
    assert _assert_openai_error(response, 429)["code"] == "queue_full"
    assert response.headers["retry-after"] == "1"
    assert redis_client.xlen(contract.REQUESTS) == 2
    assert redis_client.hget(contract.TOTALS, contract.TOTAL_REJECTED) == b"1"
    with pytest.raises(openai.RateLimitError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).completions.create(model=MODEL_NAME, prompt="x")


def test_redis_down_is_503(start_api):
    url = start_api(redis_url="redis://127.0.0.1:1/0")
    response = httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"})
    assert _assert_openai_error(response, 503)["code"] == "queue_unavailable"
    _assert_openai_error(httpx.get(f"{url}/ready"), 503)
    assert httpx.get(f"{url}/health").status_code == 200


def test_connections_redis_closed_are_replaced_not_failed(start_api, fake_worker, redis_client):
    """Connections the server closed (a Redis restart does this to every one) are replaced when
    next taken from the pool. With redis-py 8.1's default protocol over TCP they were not: each
    idle pooled connection failed one request with a 503 (session 50: 32 of the next 100)."""
    url = start_api()
    fake_worker()
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}

    def burst() -> list[int]:
        with ThreadPoolExecutor(48) as pool:
            return list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code,
                                 range(48)))  # fmt: skip

    assert burst() == [200] * 48  # the pool now holds many connections
    api_connections = [c for c in redis_client.client_list() if c.get("name", "").startswith("redjax-api")]
    assert len(api_connections) > 4
    for connection in api_connections:
        redis_client.client_kill_filter(_id=connection["id"])
    assert burst() == [200] * 48


def test_a_request_lost_with_redis_data_gets_a_503_at_once(start_api, redis_client):
    """Redis restarts empty (here: FLUSHALL) while a request waits in its queue: the API sees its
    alive key gone, and the request, which Redis no longer holds, gets a 503 `request_lost` within
    seconds (the official client retries it) instead of waiting for the request timeout (600 s)."""
    url = start_api()
    heartbeat(redis_client, "w1", MODEL_NAME)  # a live worker that pulls nothing: the request waits
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(httpx.post, f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"},
                              timeout=60)  # fmt: skip
        assert eventually(lambda: redis_client.xlen(contract.REQUESTS) == 1, 10)
        key = next(iter(redis_client.keys("*:alive")))
        assert eventually(lambda: redis_client.ttl(key) > 0 and not waiting.done(), 3)
        redis_client.flushall()
        heartbeat(redis_client, "w1", MODEL_NAME)
        response = waiting.result(timeout=30)
    assert _assert_openai_error(response, 503)["code"] == "request_lost"


@pytest.mark.parametrize("words", [20, 2000])  # bodies under and over routes.INLINE_PARSE_BYTES
def test_prompts_parsed_inline_or_in_a_thread_count_the_same(api, tiny_model_dir, redis_client, words):
    """Short bodies are tokenized on the event loop, long ones in a worker thread: either way the
    prompt length in the context error is transformers' own count, and nothing is enqueued."""
    import json

    import transformers

    from api.routes import INLINE_PARSE_BYTES

    prompt = " ".join(["stone", "river", "light"] * words)[: words * 6]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 500}
    assert (len(json.dumps(body)) > INLINE_PARSE_BYTES) == (words > 100)
    want = len(transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))(prompt)["input_ids"])
    response = httpx.post(f"{api}/v1/completions", json=body)
    error = _assert_openai_error(response, 400)
    assert error["code"] == "context_length_exceeded" and f"({want} in the prompt, 500 for" in error["message"]
    assert redis_client.xlen(contract.REQUESTS) == 0
