"""The serving path end to end: real `redjax worker` and `redjax api --dashboard` processes, real Redis,
the official `openai` client, checked against the offline engine and transformers.

One stack per module (worker startup and JAX compiles cost seconds); each scenario that needs a
stack of its own uses its own Redis database so nothing leaks between them.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import redis

from tests.stack_support import (jax_cache_env, make_served_model, start_api, start_worker, stop, stop_when_in_flight,
                                 wait_until)
from tests.test_dashboard_live import assert_dashboard_live
from worker import contract
from worker.contract import OutputDelta, WorkerStats

os.environ.setdefault("JAX_PLATFORMS", "cpu")

WORKER = "serving-w0"
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=128, page_size=8, num_pages=128)  # as stack_support's worker
PROMPTS = ["hello world", "the quick brown fox", "a tiny tokenizer for tests", "the answer is",
           "jumps over the lazy dog", "forty two", "the question is unknown", "redjax api"]


def _db_url(redis_url: str, db: int) -> str:
    return redis_url.rsplit("/", 1)[0] + f"/{db}"


class Stack:
    def __init__(self, model_dir, redis_url, api, url, worker):
        self.model_dir, self.redis_url, self.api, self.url, self.worker = model_dir, redis_url, api, url, worker
        self.model = model_dir.name
        self.redis = redis.Redis.from_url(redis_url)
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stats(self, name: str = WORKER) -> WorkerStats | None:
        fields = self.redis.hgetall(contract.worker_key(name))
        return WorkerStats.decode(fields) if fields else None

    def xlen(self) -> int:
        return self.redis.xlen(contract.REQUESTS)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return make_served_model(tmp_path_factory.mktemp("served") / "tinyllama")


@pytest.fixture(scope="session")
def jax_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax-cache")


@pytest.fixture(scope="module")
def stack(model_dir, redis_url, jax_cache):
    url = _db_url(redis_url, 1)
    redis.Redis.from_url(url).flushdb()
    worker = start_worker(model_dir, url, WORKER, env=jax_cache_env(jax_cache))
    api, base = start_api(model_dir, url, "--dashboard")
    s = Stack(model_dir, url, api, base, worker)
    try:
        wait_until(lambda: httpx.get(base + "/ready").status_code == 200, 120)
        # warm up the compiles of the common shapes
        s.client.completions.create(model=s.model, prompt="hello", max_tokens=8, temperature=0)
        yield s
    finally:
        api_rc = stop(api)
        worker_rc = stop(worker)
    assert worker_rc == 0 and api_rc == 0


@pytest.fixture(scope="session")
def offline(model_dir):
    from worker.engine.llm import LLM

    return LLM(model=str(model_dir), **ENGINE)


def offline_greedy(llm, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False):
    from worker.engine.sampling_params import SamplingParams

    [result] = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos))
    return result.outputs[0]


def ids_of(stack: Stack, text: str) -> list[int]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(stack.model_dir))
    return tok(text).input_ids


def stream_text(stream) -> tuple[str, str | None]:
    text, reason = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += (choice.delta.content or "") if hasattr(choice, "delta") else (choice.text or "")
            reason = choice.finish_reason or reason
    return text, reason


# ---- 1. the official client: completions and chat, streamed and not ----


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, top_p=0.95, seed=1234),
                                      dict(temperature=1.2, seed=2**40)], ids=["greedy", "seeded", "seed64"])
def test_openai_client_streamed_equals_unstreamed(stack, sampling):
    c = stack.client
    full = c.completions.create(model=stack.model, prompt="the quick brown", max_tokens=24, **sampling)
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens > 0 and full.usage.prompt_tokens > 0
    streamed, reason = stream_text(c.completions.create(model=stack.model, prompt="the quick brown", max_tokens=24,
                                                         stream=True, **sampling))
    assert (streamed, reason) == (full.choices[0].text, full.choices[0].finish_reason)

    messages = [{"role": "user", "content": "what is the answer?"}]
    chat = c.chat.completions.create(model=stack.model, messages=messages, max_tokens=24, **sampling)
    assert chat.choices[0].message.role == "assistant"
    streamed, reason = stream_text(c.chat.completions.create(model=stack.model, messages=messages, max_tokens=24,
                                                              stream=True, **sampling))
    assert (streamed, reason) == (chat.choices[0].message.content, chat.choices[0].finish_reason)
    assert stack.xlen() == 0


def test_models_and_greedy_matches_offline(stack, offline):
    assert [m.id for m in stack.client.models.list().data] == [stack.model]
    ids = ids_of(stack, "the answer is")
    ref = offline_greedy(offline, ids, 20)
    out = stack.client.completions.create(model=stack.model, prompt=ids, max_tokens=20, temperature=0)
    assert out.choices[0].text == ref.text
    assert out.usage.completion_tokens == len(ref.token_ids)
    # the API deletes the output stream it has read to the end: nothing is left in Redis
    wait_until(lambda: not stack.redis.exists(contract.out_stream(out.id.removeprefix("cmpl-"))), 10)


def test_prefix_cache_hits_are_in_usage_and_metrics(stack):
    c, page = stack.client, ENGINE["page_size"]
    prompt = "zebra crossing " + " ".join(PROMPTS)  # an opening no other test sends
    first = c.completions.create(model=stack.model, prompt=prompt, max_tokens=6, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    before = _metric(stack.url, "redjax:prompt_tokens_cached")
    # again, streamed, beside a prompt the cache has not seen: the full pages of the first come from the
    # cache (all but the page of its last token, computed to sample from); the usage sums both
    chunks = list(c.completions.create(model=stack.model, prompt=[prompt, "yak " + prompt], max_tokens=6,
                                       temperature=0, stream=True, stream_options={"include_usage": True}))
    cached = (first.usage.prompt_tokens - 1) // page * page
    assert cached > 0 and chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == 0) == first.choices[0].text
    wait_until(lambda: _metric(stack.url, "redjax:prompt_tokens_cached") == before + cached, 10)
    wait_until(lambda: stack.stats().prefix_cache_hit_rate > 0, 5)  # the worker's heartbeat, its last seconds


# ---- 2. concurrency: batched, and token-for-token the offline engine's output ----


def test_concurrent_streams_are_batched_and_match_offline(stack, offline):
    prompts = [ids_of(stack, p) for p in PROMPTS]
    max_tokens = 48
    refs = [offline_greedy(offline, ids, max_tokens, ignore_eos=True) for ids in prompts]
    seen = {"running": 0, "mean_batch_size": 0.0}
    done = threading.Event()

    def sample_stats():
        while not done.is_set():
            st = stack.stats()
            if st:
                seen["running"] = max(seen["running"], st.running)
                seen["mean_batch_size"] = max(seen["mean_batch_size"], st.mean_batch_size)
            time.sleep(0.05)

    def one(ids):
        stream = stack.client.completions.create(model=stack.model, prompt=ids, max_tokens=max_tokens, temperature=0,
                                                 stream=True, logprobs=0, extra_body={"ignore_eos": True})
        text, tokens, reason = "", [], None
        for chunk in stream:
            ch = chunk.choices[0]
            text += ch.text
            tokens += ch.logprobs.tokens if ch.logprobs else []
            reason = ch.finish_reason or reason
        return text, tokens, reason

    sampler = threading.Thread(target=sample_stats, daemon=True)
    sampler.start()
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(one, prompts))
        # the heartbeat's mean batch size covers the last few seconds, so it still shows the burst
        wait_until(lambda: seen["mean_batch_size"] > 1 or seen["running"] > 1, 10)
    finally:
        done.set()
        sampler.join()
    for (text, tokens, reason), ref in zip(results, refs):
        assert reason == "length"
        assert len(tokens) == len(ref.token_ids) == max_tokens
        assert text == ref.text
    assert seen["mean_batch_size"] > 1 or seen["running"] > 1, seen
    assert stack.xlen() == 0


# ---- 3. cancel frees pages ----


def test_closed_stream_is_cancelled_and_frees_its_pages(stack):
    wait_until(lambda: stack.xlen() == 0 and stack.stats().pages_used == 0 and stack.stats().running == 0, 10)
    aborted = lambda: int(stack.redis.hget(contract.TOTALS, "finished:abort") or 0)  # noqa: E731

    def deltas(request_id: str) -> list[OutputDelta]:
        return [OutputDelta.decode(fields) for _, fields in stack.redis.xrange(contract.out_stream(request_id))]

    for _ in range(8):  # until the worker is caught with the request half done (it is fast)
        before = aborted()
        with ThreadPoolExecutor(1) as pool:
            watcher = pool.submit(stop_when_in_flight, stack.redis, stack.worker)
            try:
                stream = stack.client.completions.create(model=stack.model, prompt="the quick brown fox", max_tokens=200,
                                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
            except BaseException:
                os.kill(stack.worker.pid, signal.SIGCONT)
                raise
            request_id = watcher.result(timeout=60)
        if request_id is None:
            stream.close()
            continue
        try:  # the worker sleeps with the request in flight; the client goes away
            stream.close()
            # the API withdrew the request: cancel flag set and published while the worker sleeps
            wait_until(lambda: stack.redis.exists(contract.cancelled_key(request_id)), 20)
        finally:
            os.kill(stack.worker.pid, signal.SIGCONT)
        wait_until(lambda: any(d.done for d in deltas(request_id)), 20)
        # the stream showed the request unfinished, but the engine may already have generated its
        # last token and been about to publish it when stopped: then it ends by length, not abort
        reasons = [d.finish_reason for d in deltas(request_id) if d.finish_reason]
        if reasons == ["abort"]:
            break
        assert reasons == ["length"]
    else:
        pytest.fail("never caught the worker with a request in flight")
    wait_until(lambda: aborted() == before + 1, 20)
    assert not stack.redis.exists(contract.cancelled_key(request_id))  # the worker closed it: no key left
    wait_until(lambda: stack.xlen() == 0, 10)
    wait_until(lambda: (lambda st: st.pages_used == 0 and st.running == 0 and st.waiting == 0)(stack.stats()), 10)
    *_, (_, last) = stack.redis.xrange(contract.out_stream(request_id))
    assert OutputDelta.decode(last).done
    # and the worker still serves
    out = stack.client.completions.create(model=stack.model, prompt="hello", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens > 0


# ---- 5. bad input through the live API leaves the queue untouched ----


@pytest.mark.parametrize("body", [
    b'{"model": "tinyllama", "prompt": "hi", "max_tokens": "ten"}',
    b'{"model": "tinyllama", "prompt": "hi", "temperature": -1}',
    b'{"model": "tinyllama", "prompt": "hi", "max_tokens": 5, "frobnicate": 1}',
    b'{"model": "tinyllama", "prompt": "hi ' + b"hello world " * 400 + b'"}',
    b'{"model": "tinyllama", "prompt": "hi", ',
    b'{"model": "tinyllama", "prompt": [999999], "max_tokens": 2}',
], ids=["wrong-type", "out-of-range", "unknown-field", "oversized-prompt", "malformed-json", "token-out-of-vocab"])
def test_bad_input_is_rejected_before_the_queue(stack, body):
    totals = stack.redis.hget(contract.TOTALS, contract.TOTAL_ENQUEUED)
    r = httpx.post(stack.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]
    assert stack.xlen() == 0
    assert stack.redis.hget(contract.TOTALS, contract.TOTAL_ENQUEUED) == totals


# ---- 6. lm-evaluation-harness scoring ----


def test_echo_logprobs_equal_transformers(stack):
    import torch
    import transformers

    ids = ids_of(stack, "the quick brown fox jumps over the lazy dog")
    out = stack.client.completions.create(model=stack.model, prompt=ids, echo=True, max_tokens=0, logprobs=1,
                                          temperature=0)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(stack.model_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    assert lp.token_logprobs[1:] == pytest.approx(ref, abs=2e-3)
    assert "".join(lp.tokens) == out.choices[0].text


def test_prompt_logprobs_equal_transformers(stack):
    """vLLM's prompt_logprobs through the `openai` client: each prompt token's logprob, its rank in
    the vocabulary and the top 3 against a torch forward, for a completion and a chat."""
    import numpy as np
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(stack.model_dir), torch_dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(stack.model_dir))
    ids = ids_of(stack, "the quick brown fox jumps over the lazy dog")
    messages = [{"role": "user", "content": "a fox"}]
    out = stack.client.completions.create(model=stack.model, prompt=ids, max_tokens=1, temperature=0,
                                          extra_body={"prompt_logprobs": 3})  # fmt: skip
    chat = stack.client.chat.completions.create(model=stack.model, messages=messages, max_tokens=1,
                                                extra_body={"prompt_logprobs": 3})  # fmt: skip
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    for prompt, scored in ((ids, out.choices[0].prompt_logprobs), (chat_ids, chat.prompt_logprobs)):
        assert len(scored) == len(prompt) and scored[0] is None
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1).numpy()
        for pos, entry in enumerate(scored[1:], start=1):
            row, token = ref[pos - 1], prompt[pos]
            top = [int(t) for t in np.argsort(-row)[:3]]
            assert [int(t) for t in entry] == [token] + [t for t in top if t != token]  # the token first
            own = entry[str(token)]
            assert own["logprob"] == pytest.approx(row[token], abs=2e-3)
            assert 1 + (row > row[token] + 2e-3).sum() <= own["rank"] <= 1 + (row > row[token] - 2e-3).sum()
            assert own["decoded_token"] == tokenizer.decode([token])
            for rank, t in enumerate(top, start=1):
                assert entry[str(t)]["logprob"] == pytest.approx(row[t], abs=2e-3) and entry[str(t)]["rank"] == rank


def test_structured_output_through_the_openai_client(stack):
    """The `openai` client's own structured-output helper (a pydantic model as response_format,
    strict json_schema) and vLLM's structured_outputs against the real worker: what comes back
    parses, streamed and not, greedy and sampled."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Mood(BaseModel):
        mood: Literal["happy", "sad", "calm"]
        level: int = Field(ge=0, le=9)

    messages = [{"role": "user", "content": "How do you feel?"}]
    parsed = stack.client.chat.completions.parse(model=stack.model, messages=messages, response_format=Mood,
                                                 max_tokens=40, temperature=0)  # fmt: skip
    assert isinstance(parsed.choices[0].message.parsed, Mood) and parsed.choices[0].finish_reason == "stop"
    streamed, reason = stream_text(stack.client.chat.completions.create(
        model=stack.model, messages=messages, max_tokens=40, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "mood", "strict": True, "schema": {
            **Mood.model_json_schema(), "additionalProperties": False}}}))
    assert Mood.model_validate_json(streamed) == parsed.choices[0].message.parsed and reason == "stop"
    sampled = stack.client.completions.create(model=stack.model, prompt="The answer is", max_tokens=10, n=3,
                                              temperature=1.0, seed=5,
                                              extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe so"]}})
    assert all(c.text in ("yes", "no", "maybe so") and c.finish_reason == "stop" for c in sampled.choices)
    digits = stack.client.completions.create(model=stack.model, prompt="Count:", max_tokens=12, temperature=0.7,
                                             extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{2}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{2}", digits.choices[0].text)


# ---- 7. dashboard and /metrics against the live stack ----


def _metric(url: str, counter: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    [sample] = [s for s in families[counter].samples if s.name.endswith("_total")]
    return sample.value


def test_dashboard_and_metrics_follow_live_traffic(stack, output_dir):
    before = _metric(stack.url, "redjax:generation_tokens")
    stop_traffic = threading.Event()

    def traffic():
        while not stop_traffic.is_set():
            stream = stack.client.completions.create(model=stack.model, prompt="the answer is", max_tokens=64,
                                                     temperature=0.8, stream=True, extra_body={"ignore_eos": True})
            for _ in stream:
                pass

    threads = [threading.Thread(target=traffic, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        figures = assert_dashboard_live(stack.url + "/dashboard/", output_dir / "dashboard.png", worker_name=WORKER,
                                        timeout_s=30)
    finally:
        stop_traffic.set()
        for t in threads:
            t.join(timeout=60)
    assert figures["fleet-workers"].startswith("1")
    assert re.fullmatch(r"prefix hits [0-9.]+%", figures["fleet-prefix"]), figures["fleet-prefix"]
    wait_until(lambda: _metric(stack.url, "redjax:generation_tokens") > before, 10)


# ---- 3b. a request waits in the queue while no worker runs ----


def test_request_waits_for_a_worker(model_dir, redis_url, offline, jax_cache):
    url = _db_url(redis_url, 3)
    r = redis.Redis.from_url(url)
    r.flushdb()
    api, base = start_api(model_dir, url, env={"REDJAX_NO_WORKER_TIMEOUT_S": "300"})
    worker = None
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
        ids = ids_of_dir(model_dir, "the question is")
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(client.completions.create, model=model_dir.name, prompt=ids, max_tokens=16,
                                 temperature=0)
            wait_until(lambda: r.xlen(contract.REQUESTS) == 1, 20)
            time.sleep(1.5)  # a few fleet-watch polls with no worker alive
            assert not future.done()
            assert r.xlen(contract.REQUESTS) == 1
            worker = start_worker(model_dir, url, "late-worker", env=jax_cache_env(jax_cache))
            out = future.result(timeout=180)
        assert out.choices[0].text == offline_greedy(offline, ids, 16).text
        assert r.xlen(contract.REQUESTS) == 0
    finally:
        stop(api)
        if worker is not None:
            assert stop(worker) == 0


def ids_of_dir(model_dir, text: str) -> list[int]:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(model_dir))(text).input_ids

