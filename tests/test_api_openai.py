"""The API against the official `openai` client, a live uvicorn server, real Redis and a fake worker."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.api_support import (  # noqa: F401 (fixtures)
    MODEL_NAME, REPLY, eventually, fake_worker, start_api, tiny_model, tiny_model_dir,
)
from worker import contract


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20)


def test_completion_stream_matches_plain(start_api, fake_worker, redis_client):
    worker = fake_worker()
    client = _client(start_api())
    plain = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=5, seed=7)
    assert plain.object == "text_completion"
    assert plain.choices[0].finish_reason == "length"
    assert plain.choices[0].text == REPLY[: len(plain.choices[0].text)] and plain.choices[0].text
    assert plain.usage.completion_tokens == 5
    assert plain.usage.prompt_tokens == len(worker.seen[0].prompt_token_ids)
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + 5

    chunks = list(client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    # the fake worker writes all deltas at once, so the API writes several events per send: still
    # one chunk per delta for the client
    assert [len(c.choices[0].text) > 0 for c in chunks if c.choices] == [True] * 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    assert worker.seen[0].params["seed"] == 7 and isinstance(worker.seen[1].params["seed"], int)
    assert eventually(lambda: redis_client.xlen(contract.REQUESTS) == 0)  # the worker acked and deleted both


def test_chat_stream_matches_plain(start_api, fake_worker):
    fake_worker()
    client = _client(start_api())
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=4,
                                           response_format={"type": "text"})  # the default, sent as some clients do
    assert plain.object == "chat.completion"
    message = plain.choices[0].message
    assert message.role == "assistant" and message.content and REPLY.startswith(message.content)
    assert plain.usage.completion_tokens == 4

    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_default_max_tokens_runs_to_the_context_limit(start_api, fake_worker):
    worker = fake_worker()
    client = _client(start_api())
    client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}])
    sent = worker.seen[0]
    assert sent.params["max_tokens"] + len(sent.prompt_token_ids) == 128


def test_stream_ends_with_done(start_api, fake_worker):
    fake_worker()
    url = start_api()
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=20) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"]
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)


def test_n_choices_and_prompt_list_fan_out(start_api, fake_worker, redis_client, tiny_model):
    worker = fake_worker()
    client = _client(start_api())
    result = client.completions.create(model=MODEL_NAME, prompt=["hello", "the answer"], max_tokens=2, n=2)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert len({c.text for c in result.choices}) == 1 and result.choices[0].text
    assert result.usage.completion_tokens == 8
    assert redis_client.hget(contract.TOTALS, contract.TOTAL_ENQUEUED) == b"2"

    by_ids = client.completions.create(model=MODEL_NAME, prompt=[[5, 6, 7], [8, 9]], max_tokens=1, echo=True)
    assert [m.prompt_token_ids for m in worker.seen[2:]] == [[5, 6, 7], [8, 9]]
    assert by_ids.choices[1].text.startswith(tiny_model.decode([8, 9], skip_special_tokens=False))
    single = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=1)
    assert worker.seen[4].prompt_token_ids == [5, 6, 7] and len(single.choices) == 1

    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=3, n=3, stream=True))  # fmt: skip
    by_index: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + (choice.delta.content or "")
    assert sorted(by_index) == [0, 1, 2] and len(set(by_index.values())) == 1


def test_token_strings_are_each_tokens_own_text_in_order(tiny_model):
    """Logprobs name tokens by their own text; repeats, special tokens and a second call (served
    from what the first learned) give the tokenizer's decode of each id alone."""
    ids = [5, 17, 5, 0, tiny_model.vocab_size - 1]
    want = [tiny_model.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert tiny_model.token_strings(ids) == want
    assert tiny_model.token_strings(ids[::-1]) == want[::-1] and tiny_model.token_strings([]) == []


def test_echo_logprobs_scoring_format(start_api, fake_worker, tiny_model):
    """lm-evaluation-harness loglikelihood: echo=true, max_tokens=0, logprobs=1."""
    worker = fake_worker()
    client = _client(start_api())
    prompt = "the quick brown fox"
    result = client.completions.create(model=MODEL_NAME, prompt=prompt, echo=True, max_tokens=0, logprobs=1)
    sent = worker.seen[0]
    assert sent.params["prompt_logprobs"] == 1 and sent.params["logprobs"] == 1 and sent.params["max_tokens"] == 0
    choice = result.choices[0]
    assert choice.text == prompt
    lp = choice.logprobs
    ids = sent.prompt_token_ids
    assert lp.tokens == tiny_model.token_strings(ids) and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [-1.0 - 0.1 * i for i in range(len(ids) - 1)]
    for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:]):
        assert max(top, key=top.get) == token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert result.usage.completion_tokens == 0 and result.usage.prompt_tokens == len(ids)


def test_prompt_logprobs_in_vllm_format(start_api, fake_worker, tiny_model):
    """vLLM's prompt_logprobs: per prompt token {id: {logprob, rank, decoded_token}}, the token
    first, on each completion choice and beside a chat's choices; the engine computes the wider of
    it and echo's logprobs, and each is cut to its own count."""
    worker = fake_worker()
    client = _client(start_api())
    result = client.completions.create(model=MODEL_NAME, prompt=["hello there", "fox"], max_tokens=1, n=2,
                                       extra_body={"prompt_logprobs": 2})  # fmt: skip
    sent = worker.seen[-2:]
    assert [m.params["prompt_logprobs"] for m in sent] == [2, 2] and sent[0].params["logprobs"] is None
    assert [c.index for c in result.choices] == [0, 1, 2, 3] and result.choices[0].logprobs is None
    for choice in result.choices:
        ids = sent[choice.index // 2].prompt_token_ids
        scored = choice.prompt_logprobs
        assert len(scored) == len(ids) and scored[0] is None
        for i, (token, entry) in enumerate(zip(ids[1:], scored[1:])):
            alternative = (token + 1) % 300  # the fake worker's second choice
            assert list(entry) == [str(token), str(alternative)]
            assert entry[str(token)] == {"logprob": pytest.approx(-1.0 - 0.1 * i), "rank": 1 + i % 3,
                                         "decoded_token": tiny_model.token_strings([token])[0]}  # fmt: skip
            assert entry[str(alternative)]["rank"] == 2
    echoed = client.completions.create(model=MODEL_NAME, prompt="hello there", max_tokens=0, echo=True, logprobs=1,
                                       extra_body={"prompt_logprobs": 0})  # fmt: skip
    assert worker.seen[-1].params["prompt_logprobs"] == 1  # the wider of the two
    assert all(len(entry) == 1 for entry in echoed.choices[0].prompt_logprobs[1:])
    assert all(len(top) == 1 for top in echoed.choices[0].logprobs.top_logprobs[1:])
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=1, extra_body={"prompt_logprobs": 1})  # fmt: skip
    ids = worker.seen[-1].prompt_token_ids
    assert worker.seen[-1].params["prompt_logprobs"] == 1 and chat.choices[0].logprobs is None
    assert chat.prompt_logprobs[0] is None and len(chat.prompt_logprobs) == len(ids)
    assert [list(e)[0] for e in chat.prompt_logprobs[1:]] == [str(t) for t in ids[1:]]
    assert all(len(e) == 1 for e in chat.prompt_logprobs[1:])  # the alternative is the token itself here
    plain = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=1)
    assert "prompt_logprobs" not in plain.choices[0].model_extra and worker.seen[-1].params["prompt_logprobs"] is None


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(start_api, fake_worker, tiny_model):
    worker = fake_worker()
    client = _client(start_api())
    ids = tiny_model.encode("the quick brown fox jumps over the lazy dog", add_special_tokens=True)
    result = client.completions.create(model=MODEL_NAME, prompt="the quick brown fox jumps over the lazy dog",
                                       max_tokens=1, echo=True, extra_body={"truncate_prompt_tokens": 5})  # fmt: skip
    assert worker.seen[-1].prompt_token_ids == ids[-5:] and result.usage.prompt_tokens == 5
    assert result.choices[0].text.startswith(tiny_model.decode(ids[-5:], skip_special_tokens=False))
    short = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": 5})  # fmt: skip
    assert worker.seen[-1].prompt_token_ids == [5, 6, 7] and short.usage.prompt_tokens == 3
    client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hello there"}],
                                   max_tokens=1, extra_body={"truncate_prompt_tokens": 4})  # fmt: skip
    whole = tiny_model.render_chat([{"role": "user", "content": "hello there"}])
    assert worker.seen[-1].prompt_token_ids == whole[-4:]


def test_return_tokens_as_token_ids_names_every_token_by_its_id(start_api, fake_worker):
    worker = fake_worker()
    client = _client(start_api())
    result = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=3, logprobs=2, echo=True,
                                       extra_body={"return_tokens_as_token_ids": True, "prompt_logprobs": 1})
    ids = worker.seen[-1].prompt_token_ids
    lp = result.choices[0].logprobs
    assert lp.tokens[: len(ids)] == [f"token_id:{t}" for t in ids] and all(t.startswith("token_id:") for t in lp.tokens)
    assert all(key.startswith("token_id:") for top in lp.top_logprobs[1:] for key in top)
    assert lp.text_offset[len(ids)] == len("hello")  # offsets still count the text
    assert all(v["decoded_token"] == f"token_id:{k}" for e in result.choices[0].prompt_logprobs[1:] for k, v in e.items())
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True})  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert all(c.token.startswith("token_id:") and all(t.token.startswith("token_id:") for t in c.top_logprobs)
               for c in content)  # fmt: skip


def test_echo_with_generation_and_logprobs(start_api, fake_worker):
    fake_worker()
    client = _client(start_api())
    result = client.completions.create(model=MODEL_NAME, prompt="hello", echo=True, max_tokens=3, logprobs=2)
    choice = result.choices[0]
    assert choice.text.startswith("hello") and len(choice.text) > len("hello")
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[-3:] == [-0.5, -0.5, -0.5]
    assert all(len(top) == 2 for top in lp.top_logprobs[-3:])
    assert lp.text_offset[-3] == len("hello")


def test_chat_logprobs(start_api, fake_worker):
    fake_worker()
    client = _client(start_api())
    result = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=2, logprobs=True, top_logprobs=2)  # fmt: skip
    content = result.choices[0].logprobs.content
    assert len(content) == 2 and all(c.logprob == -0.5 and len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == result.choices[0].message.content


def test_models_and_request_id(start_api):
    url = start_api()
    models = _client(url).models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    echoed = httpx.get(f"{url}/v1/models", headers={"X-Request-Id": "abc-123"})
    assert echoed.headers["x-request-id"] == "abc-123"
    replaced = httpx.get(f"{url}/v1/models", headers={"X-Request-Id": "bad id with spaces"})
    assert replaced.headers["x-request-id"] != "bad id with spaces" and len(replaced.headers["x-request-id"]) == 32
    assert httpx.get(f"{url}/nope").headers["x-request-id"]


def test_chat_template_switches_render_as_transformers_does(start_api, fake_worker, tiny_model):
    """add_generation_prompt and continue_final_message (vLLM's extensions) sent through the
    client's extra_body reach the worker as transformers' own apply_chat_template renders them."""
    worker = fake_worker()
    client = _client(start_api())
    asked = [{"role": "user", "content": "hello"}]
    begun = asked + [{"role": "assistant", "content": "the quick"}]
    cases = [
        (asked, {}, {"add_generation_prompt": True}),
        (asked, {"add_generation_prompt": False}, {"add_generation_prompt": False}),
        (begun, {"continue_final_message": True}, {"continue_final_message": True}),
        (begun, {"continue_final_message": True, "add_generation_prompt": False}, {"continue_final_message": True}),
    ]
    for messages, extra, reference in cases:
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1, extra_body=extra)
        text = tiny_model.tokenizer.apply_chat_template(messages, tokenize=False, **reference)
        assert worker.seen[-1].prompt_token_ids == tiny_model.tokenizer.encode(text, add_special_tokens=False)
    opened, closed, continued, _ = [m.prompt_token_ids for m in worker.seen]
    assert tiny_model.decode(continued, skip_special_tokens=False).endswith("<|assistant|>the quick")
    assert tiny_model.decode(opened).endswith("<|assistant|>") and not tiny_model.decode(closed).endswith("|>")


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(start_api, fake_worker):
    worker = fake_worker()
    client = _client(start_api())
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, stream=True, stream_options=options))  # fmt: skip
    prompt = len(worker.seen[0].prompt_token_ids)
    assert all(c.usage.prompt_tokens == prompt for c in chunks)
    assert [c.usage.completion_tokens for c in chunks if c.choices] == [0, 1, 2, 3, 4]  # the role chunk, then a token each
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == prompt + 4
    plain = list(client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, stream=True,
                                           stream_options={"include_usage": True}))  # fmt: skip
    assert [c.usage for c in plain[:-1]] == [None, None] and plain[-1].usage.completion_tokens == 2


def test_retrieve_model_tokenize_and_detokenize(start_api, fake_worker, tiny_model):
    """`models.retrieve` through the client; /tokenize gives the ids the generation endpoints
    enqueue for the same prompt or messages (transformers' encoding), /detokenize inverts it."""
    worker = fake_worker()
    url = start_api()
    client = _client(url)
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")

    prompt, messages = "the quick brown fox", [{"role": "user", "content": "hello"}]
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
    client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    counted = httpx.post(f"{url}/tokenize", json={"model": MODEL_NAME, "prompt": prompt, "return_token_strs": True}).json()
    assert counted["tokens"] == worker.seen[0].prompt_token_ids == tiny_model.tokenizer(prompt).input_ids
    assert counted["count"] == len(counted["tokens"]) and counted["max_model_len"] == 128
    assert counted["token_strs"] == tiny_model.token_strings(counted["tokens"])  # each token's text, as in logprobs
    assert "".join(counted["token_strs"]).endswith(prompt)
    chat = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == worker.seen[1].prompt_token_ids and "token_strs" not in chat
    bare = httpx.post(f"{url}/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()["tokens"]
    assert bare == tiny_model.tokenizer(prompt, add_special_tokens=False).input_ids
    back = httpx.post(f"{url}/detokenize", json={"model": MODEL_NAME, "tokens": chat["tokens"]}).json()
    assert back["prompt"] == tiny_model.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert len(worker.seen) == 2  # the tokenizer's routes queue nothing
