"""Readiness, cancels (disconnect, no worker), worker failures and at-least-once delivery."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.api_support import (  # noqa: F401 (fixtures)
    MODEL_NAME, eventually, fake_worker, heartbeat, start_api, tiny_model, tiny_model_dir,
)
from worker import contract
from worker.contract import OutputDelta, RequestMessage


def _take_request(redis_client, timeout_s: float = 5.0) -> RequestMessage:
    """Play the worker: pull one request through the consumer group."""
    contract.ensure_group(redis_client)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        streams = {contract.REQUESTS: ">"}
        replies = redis_client.xreadgroup(contract.WORKERS_GROUP, "test-worker", streams, count=1, block=100)
        if replies:
            return RequestMessage.decode(replies[0][1][0][1])
    raise AssertionError("no request was enqueued")


def _post(url: str, path: str, body: dict, timeout: float = 20):
    return httpx.post(f"{url}{path}", json={"model": MODEL_NAME, **body}, timeout=timeout)


def test_health_and_ready(start_api, redis_client):
    url = start_api()
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    not_ready = httpx.get(f"{url}/ready")
    assert not_ready.status_code == 503 and not_ready.json()["error"]["code"] == "no_worker"
    heartbeat(redis_client, "other", "another-model")
    assert httpx.get(f"{url}/ready").status_code == 503
    heartbeat(redis_client, "w1", MODEL_NAME)
    ready = httpx.get(f"{url}/ready")
    assert ready.status_code == 200 and ready.json()["workers"] == ["w1"]
    redis_client.delete(contract.worker_key("w1"))  # heartbeat expired
    assert httpx.get(f"{url}/ready").status_code == 503


def test_a_starting_worker_is_not_ready_but_keeps_requests_queued_for_it(start_api, fake_worker, redis_client):
    """A worker compiling its step variants heartbeats as "starting": /ready says so (503), and a
    request sent meanwhile waits in the queue past the no-worker limit instead of being failed."""
    url = start_api(no_worker_timeout_s=1.0)
    heartbeat(redis_client, "warming", MODEL_NAME, state=contract.WorkerState.STARTING.value)
    not_ready = httpx.get(f"{url}/ready")
    assert not_ready.status_code == 503 and not_ready.json()["error"]["code"] == "worker_starting"
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(_post, url, "/v1/completions", {"prompt": "hello", "max_tokens": 3})
        deadline = time.monotonic() + 2.5  # 2.5x the no-worker limit, within the heartbeat's 5 s life
        while time.monotonic() < deadline:
            assert not future.done()
            time.sleep(0.1)
        assert redis_client.xlen(contract.REQUESTS) == 1 and not redis_client.keys(contract.cancelled_key("*"))
        fake_worker()  # warm now: serving
        response = future.result(timeout=20)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    ready = httpx.get(f"{url}/ready")
    assert ready.status_code == 200 and ready.json()["workers"] == ["fake-0"]  # the starting one is not listed


def test_no_worker_cancels_and_removes_the_request(start_api, redis_client):
    url = start_api(no_worker_timeout_s=1.0)
    response = _post(url, "/v1/completions", {"prompt": "hello"})
    assert response.status_code == 503 and response.json()["error"]["code"] == "no_worker"
    assert redis_client.xlen(contract.REQUESTS) == 0  # XDELed: no worker had taken it
    assert len(redis_client.keys(contract.cancelled_key("*"))) == 1


def test_no_worker_stream_is_503_before_any_byte(start_api, redis_client):
    url = start_api(no_worker_timeout_s=1.0)
    response = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True})
    assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
    assert redis_client.xlen(contract.REQUESTS) == 0


def _cancel_messages(pubsub) -> list[str]:
    out = []
    while (message := pubsub.get_message(timeout=0.2)) is not None:
        if message["type"] == "message":
            out.append(message["data"].decode())
    return out


def test_disconnect_while_waiting_publishes_cancel(start_api, redis_client):
    url = start_api()
    heartbeat(redis_client, "w1", MODEL_NAME)  # alive but never reads: the request waits in the queue
    pubsub = redis_client.pubsub()
    pubsub.subscribe(contract.CANCEL_CHANNEL)
    with pytest.raises(httpx.ReadTimeout):
        _post(url, "/v1/completions", {"prompt": "hello"}, timeout=1.0)
    assert eventually(lambda: redis_client.keys(contract.cancelled_key("*")))
    request_id = redis_client.keys(contract.cancelled_key("*"))[0].decode().rsplit(":", 1)[1]
    assert eventually(lambda: request_id in _cancel_messages(pubsub))
    assert redis_client.xlen(contract.REQUESTS) == 0  # still undelivered, so taken off the queue
    pubsub.close()


def test_disconnect_mid_stream_publishes_cancel(start_api, fake_worker, redis_client):
    url = start_api()
    fake_worker(delay_s=0.2)
    pubsub = redis_client.pubsub()
    pubsub.subscribe(contract.CANCEL_CHANNEL)
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 20, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=20) as response:
        assert response.status_code == 200
        next(line for line in response.iter_lines() if line.startswith("data: "))
    assert eventually(lambda: redis_client.keys(contract.cancelled_key("*")))
    request_id = redis_client.keys(contract.cancelled_key("*"))[0].decode().rsplit(":", 1)[1]
    assert eventually(lambda: request_id in _cancel_messages(pubsub))
    pubsub.close()


def test_duplicate_seq_is_dropped(start_api, redis_client):
    url = start_api()
    heartbeat(redis_client, "w1", MODEL_NAME)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(_post, url, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
        request = _take_request(redis_client)
        stream = contract.out_stream(request.id)
        for delta in [OutputDelta(seq=0, text="a", token_ids=[5]), OutputDelta(seq=0, text="a", token_ids=[5]),
                      OutputDelta(seq=1, text="b", token_ids=[6], finish_reason="length"),
                      OutputDelta(seq=2, done=True)]:  # fmt: skip
            redis_client.xadd(stream, delta.encode())
        response = future.result()
    body = response.json()
    assert body["choices"][0]["text"] == "ab" and body["choices"][0]["finish_reason"] == "length"
    # no usage from the worker: the API counts it
    assert body["usage"] == {"prompt_tokens": len(request.prompt_token_ids), "completion_tokens": 2,
                             "total_tokens": len(request.prompt_token_ids) + 2}  # fmt: skip


@pytest.mark.parametrize("final,status,code", [
    (OutputDelta(seq=1, error="out of pages", finish_reason="error", done=True), 500, "worker_error"),
    (OutputDelta(seq=1, finish_reason="abort", done=True), 503, "aborted"),
])  # fmt: skip
def test_worker_failure(start_api, redis_client, final, status, code):
    url = start_api()
    heartbeat(redis_client, "w1", MODEL_NAME)
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(_post, url, "/v1/completions", {"prompt": "hello"})
        streamed = pool.submit(_stream_lines, url, {"prompt": "hello", "stream": True})
        for _ in range(2):
            stream = contract.out_stream(_take_request(redis_client).id)
            redis_client.xadd(stream, OutputDelta(seq=0, text="a", token_ids=[5]).encode())
            redis_client.xadd(stream, final.encode())
        response = plain.result()
        lines = streamed.result()
    assert response.status_code == status and response.json()["error"]["code"] == code
    assert json.loads(lines[-2])["error"]["code"] == code and lines[-1] == "[DONE]"  # error after 200


def _stream_lines(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{url}/v1/completions", json={"model": MODEL_NAME, **body}, timeout=20) as response:
        assert response.status_code == 200
        return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def test_request_timeout_is_504(start_api, redis_client):
    url = start_api(request_timeout_s=1.0)
    heartbeat(redis_client, "w1", MODEL_NAME)
    response = _post(url, "/v1/completions", {"prompt": "hello"})
    assert response.status_code == 504 and response.json()["error"]["code"] == "request_timeout"
    assert redis_client.xlen(contract.REQUESTS) == 0
