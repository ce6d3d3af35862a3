"""Test support for the API: a tiny local tokenizer/model folder, a live uvicorn server, a fake worker.

The fake worker plays the worker's side of the Redis contract (XREADGROUP, OutputDelta entries,
heartbeats) with deterministic output, so the API is tested against real Redis and real HTTP.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import redis
import uvicorn

from api.app import create_app
from api.config import ApiConfig
from api.model_info import ModelInfo
from tests.conftest import free_port
from worker import contract
from worker.contract import OutputDelta, RequestMessage, WorkerStats
from worker.engine.sampling_params import SamplingParams

MODEL_NAME = "tiny"
MAX_POSITION_EMBEDDINGS = 128
CORPUS = [
    "hello world the quick brown fox jumps over the lazy dog",
    "a tiny tokenizer for tests of the redjax api, trained on a few lines of text",
    "the answer is forty two and the question is unknown",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# What the fake worker generates, cycled: decoded token by token.
REPLY = " the quick brown fox jumps over the lazy dog"


def make_model_dir(path: Path) -> Path:
    """A byte-level BPE tokenizer with a chat template plus a minimal config.json, saved to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    config = {"model_type": "llama", "max_position_embeddings": MAX_POSITION_EMBEDDINGS, "vocab_size": len(fast)}
    (path / "config.json").write_text(json.dumps(config))
    return path


class LiveServer:
    """uvicorn serving an app in a thread, on a free port."""

    def __init__(self, app, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def heartbeat(client: redis.Redis, name: str, model: str, state: str = contract.WorkerState.SERVING.value) -> None:
    stats = WorkerStats(
        name=name, model=model, state=state, pid=0, started_at=time.time(),
        updated_at=time.time(), pages_used=0, pages_total=64, running=0, waiting=0, tokens_per_s=0.0,
        prompt_tokens_per_s=0.0, preemptions=0, requests_finished=0, mean_batch_size=0.0, max_num_seqs=8,
    )  # fmt: skip
    contract.write_heartbeat(client, stats)


class FakeWorker:
    """Serves requests from the stream with REPLY's tokens; one delta per token, `delay_s` apart."""

    def __init__(self, redis_url: str, tokenizer, model: str, delay_s: float = 0.0, name: str = "fake-0",
                 reply: str = REPLY) -> None:
        self.client = redis.Redis.from_url(redis_url)
        self.tokenizer = tokenizer
        self.model = model
        self.delay_s = delay_s
        self.name = name
        self.reply_ids = tokenizer.encode(reply, add_special_tokens=False)
        self.seen: list[RequestMessage] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "FakeWorker":
        contract.ensure_group(self.client)
        heartbeat(self.client, self.name, self.model)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.client.delete(contract.worker_key(self.name))
        self.client.close()

    def _loop(self) -> None:
        last_beat = 0.0
        while not self._stop.is_set():
            if time.monotonic() - last_beat > 0.5:
                heartbeat(self.client, self.name, self.model)
                last_beat = time.monotonic()
            streams = {contract.REQUESTS: ">"}
            replies = self.client.xreadgroup(contract.WORKERS_GROUP, self.name, streams, count=8, block=50)
            for _, entries in replies or []:
                for entry_id, fields in entries:
                    message = RequestMessage.decode(fields)
                    self.seen.append(message)
                    self._serve(message)
                    self.client.xack(contract.REQUESTS, contract.WORKERS_GROUP, entry_id)
                    self.client.xdel(contract.REQUESTS, entry_id)

    def _serve(self, message: RequestMessage) -> None:
        params = SamplingParams.from_dict(message.params)
        stream = contract.out_stream(message.id)
        seq = 0
        if params.prompt_logprobs is not None:
            rest = message.prompt_token_ids[1:]
            entries = [None] + [{**_entry(t, -1.0 - 0.1 * i, params.prompt_logprobs), "rank": 1 + i % 3}
                                for i, t in enumerate(rest)]  # fmt: skip
            self._emit(message, OutputDelta(seq=seq, prompt_logprobs=entries).encode())
            seq += 1
        budget = params.max_tokens if params.max_tokens is not None else len(self.reply_ids)
        count = min(budget, len(self.reply_ids))
        produced = 0
        for step in range(count):
            if self._stop.is_set() or self.client.exists(contract.cancelled_key(message.id)):
                self._finish(stream, seq, message, produced, "abort")
                return
            for index in range(params.n):
                token = self.reply_ids[step]
                last = step == count - 1
                delta = OutputDelta(
                    seq=seq, index=index, text=self.tokenizer.decode([token]), token_ids=[token],
                    logprobs=[_entry(token, -0.5, params.logprobs)] if params.logprobs is not None else None,
                    finish_reason=("length" if count == budget else "stop") if last else None,
                )  # fmt: skip
                self._emit(message, delta.encode())
                seq += 1
                produced += 1
            time.sleep(self.delay_s)
        if count == 0:
            for index in range(params.n):
                self._emit(message, OutputDelta(seq=seq, index=index, finish_reason="length").encode())
                seq += 1
        self._finish(stream, seq, message, produced, None)

    def _emit(self, message: RequestMessage, entry: dict) -> None:
        """XADD one entry to the request's out_stream and tell its API (as a worker does)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.xadd(contract.out_stream(message.id), entry)
        if message.notify:
            contract.notify_outputs(pipe, message.notify, [message.id])
        pipe.execute()

    def _finish(self, stream: str, seq: int, message: RequestMessage, produced: int, reason: str | None) -> None:
        usage = {"prompt_tokens": len(message.prompt_token_ids), "completion_tokens": produced,
                 "total_tokens": len(message.prompt_token_ids) + produced}  # fmt: skip
        final = OutputDelta(seq=seq, finish_reason=reason, done=True, usage=usage)
        self._emit(message, final.encode())
        self._emit(message, final.encode())  # a duplicate seq, which readers must drop
        self.client.expire(stream, contract.OUTPUT_TTL_S)


def eventually(check, timeout_s: float = 5.0) -> bool:
    """Poll `check()` until it is true or the timeout passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while not (ok := check()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(ok)


def _entry(token: int, logprob: float, top: int | None) -> dict:
    alternatives = [[token, logprob], [(token + 1) % 300, logprob - 1.0]][: (top or 0)]
    return {"token_id": token, "logprob": logprob, "top": alternatives}


def api_server(redis_url: str, model_dir: Path, model: ModelInfo, **overrides) -> LiveServer:
    """A LiveServer (use as a context manager) for the tiny model; `overrides` are ApiConfig fields."""
    port = free_port()
    settings = {"model_dir": str(model_dir), "redis_url": redis_url, "served_model_name": MODEL_NAME, "port": port,
                **overrides}  # fmt: skip
    return LiveServer(create_app(ApiConfig(**settings), model=model), port)


# Fixtures: test modules import these names so pytest finds them.

@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir) -> ModelInfo:
    return ModelInfo.load(str(tiny_model_dir), MODEL_NAME)


@pytest.fixture
def start_api(redis_client, redis_url, tiny_model_dir, tiny_model):
    """start_api(**config_overrides) -> base URL of a live API on a flushed Redis; stopped after the test."""
    servers: list[LiveServer] = []

    def start(**overrides) -> str:
        url = overrides.pop("redis_url", redis_url)
        servers.append(api_server(url, tiny_model_dir, tiny_model, **overrides).__enter__())
        return servers[-1].url

    yield start
    for server in servers:
        server.__exit__()


@pytest.fixture
def fake_worker(redis_url, tiny_model):
    """fake_worker(delay_s=0.0, reply=REPLY) -> a running FakeWorker; stopped after the test."""
    workers: list[FakeWorker] = []

    def start(delay_s: float = 0.0, reply: str = REPLY) -> FakeWorker:
        workers.append(FakeWorker(redis_url, tiny_model.tokenizer, MODEL_NAME, delay_s=delay_s, reply=reply).__enter__())
        return workers[-1]

    yield start
    for worker in workers:
        worker.__exit__()
