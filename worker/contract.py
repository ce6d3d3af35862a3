"""The Redis contract shared by api, worker and dashboard: every key, field and status.

Imports nothing heavy (no JAX, no numpy) so the API and dashboard can use it freely.
Every write helper takes a redis client *or* pipeline so callers compose atomic steps.

Delivery is at least once. A request entry is acknowledged (XACK + XDEL) only when it is
finished; output entries carry a per-request sequence number `seq` and readers drop any
`seq` they have already seen. A worker that takes over a dead worker's request reads the
output stream to learn what was already emitted, re-prefills prompt + emitted tokens, and
continues numbering where the stream left off.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

PREFIX = "redjax"

# Stream of requests, one entry each; field "data" holds a RequestMessage as JSON.
# Workers read it through the consumer group below. Finished entries are XACKed and XDELed,
# so XLEN counts requests that are waiting or in flight.
REQUESTS = f"{PREFIX}:requests"
WORKERS_GROUP = "workers"

# Pub/sub channel: message = request id to cancel. Also sets cancelled_key(id) (TTL below) so
# a worker that pulls the request later, or missed the message, still sees the cancel. The worker
# that closes the request deletes the key; the TTL clears keys of cancels that came too late.
CANCEL_CHANNEL = f"{PREFIX}:cancel"
CANCEL_TTL_S = 3600

# Set of worker names ever seen; liveness is whether worker_key(name) still exists.
WORKERS = f"{PREFIX}:workers"
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TTL_S = 5  # a worker whose hash expired is gone; its pending entries may be claimed
# a request entry delivered to this many workers that each died holding it (a request that crashes
# workers, or two crashes in a row) is answered with an error by the next one instead of run again
MAX_DEATHS = 2

# Stream of finished-request records (RequestEvent as fields), capped; never prompt or output text.
EVENTS = f"{PREFIX}:events"
EVENTS_MAXLEN = 10_000

# Hash of fleet-wide monotonically increasing counters (see TOTAL_* and histogram fields).
TOTALS = f"{PREFIX}:totals"
TOTAL_PROMPT_TOKENS = "prompt_tokens"
TOTAL_CACHED_PROMPT_TOKENS = "prompt_tokens_cached"  # of those, served from the prefix cache
TOTAL_GENERATION_TOKENS = "generation_tokens"
TOTAL_PREEMPTIONS = "preemptions"
TOTAL_STEP_COMPILES = "step_compiles"  # step variants workers compiled while serving (after their warm-up)
TOTAL_COMPILE_STALL_S = "compile_stall_s"  # seconds of those their engine threads waited (every stream did)
TOTAL_REJECTED = "rejected"  # requests refused with 429 by the API
TOTAL_ENQUEUED = "enqueued"
# Requests finished, per reason: field "finished:<reason>".
# Latency histograms: field "<name>:bucket:<bound>" counts observations above the previous bound
# up to <bound> (readers add them up into Prometheus' cumulative buckets), plus "<name>:sum" and
# "<name>:count". Names: ttft_s, tpot_s, e2e_s, queue_s.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))

# An output stream expires this long after its final entry. The API deletes the stream as soon as
# it has read that entry; the TTL clears the streams nobody reads (their client left). An API
# that reads nothing for longer has lost its alive key (API_ALIVE_TTL_S), and its requests with it.
OUTPUT_TTL_S = 60


def out_stream(request_id: str) -> str:
    """Stream of OutputDelta entries (field "data", JSON) for one request."""
    return f"{PREFIX}:out:{request_id}"


def api_notify_stream(instance: str) -> str:
    """Private to one API process: workers XADD {"ids": JSON list of request ids} to it after
    writing new entries to those requests' out_streams (`notify_outputs`), so the API's single
    output reader blocks on this one stream and then reads only the out_streams named, however
    many requests are queued. Trimmed to about NOTIFY_MAXLEN entries; TTL NOTIFY_TTL_S."""
    return f"{PREFIX}:api-notify:{instance}"


NOTIFY_MAXLEN = 4096
NOTIFY_TTL_S = 3600


def api_alive_key(notify: str) -> str:
    """Exists while the API process behind notify stream `notify` runs: its enqueue script sets it
    and its fleet watch refreshes it every HEARTBEAT_INTERVAL_S, TTL API_ALIVE_TTL_S. Workers drop
    the requests of an API whose key is gone (no client is left to read them)."""
    return f"{notify}:alive"


API_ALIVE_TTL_S = 15


def notify_outputs(pipe, stream: str, request_ids: list[str]) -> None:
    """Queue on `pipe` (a client or pipeline) the notification that `request_ids` have new output."""
    pipe.xadd(stream, {"ids": json.dumps(request_ids)}, maxlen=NOTIFY_MAXLEN, approximate=True)
    pipe.expire(stream, NOTIFY_TTL_S)


def cancelled_key(request_id: str) -> str:
    return f"{PREFIX}:cancelled:{request_id}"


def worker_key(name: str) -> str:
    """Hash of WorkerStats fields, refreshed every HEARTBEAT_INTERVAL_S, TTL HEARTBEAT_TTL_S."""
    return f"{PREFIX}:worker:{name}"


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens or the model's context limit
    ABORT = "abort"  # cancelled by the client
    ERROR = "error"  # the worker could not run it; `error` says why


class WorkerState(str, Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"  # got SIGTERM: takes no new work


@dataclass
class RequestMessage:
    id: str
    model: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams.to_dict(); seed is always set by the API
    enqueued_at: float = field(default_factory=time.time)
    attempt: int = 0  # incremented each time a draining worker hands it back to the queue
    notify: str = ""  # the enqueuing API's api_notify_stream ("": nobody to notify)

    def encode(self) -> dict[str, str]:
        # vars(), not asdict(): asdict deep-copies the prompt's token list (a tenth of the API's
        # per-request CPU in a profile of 256 concurrent requests)
        return {"data": json.dumps(vars(self), separators=(",", ":"))}

    @classmethod
    def decode(cls, fields: dict) -> "RequestMessage":
        return cls(**json.loads(_str(fields.get(b"data", fields.get("data")))))


@dataclass
class OutputDelta:
    """One entry of out_stream(id). `seq` numbers entries from 0; duplicates are dropped by readers.

    A delta belongs to choice `index` (0..n-1). `finish_reason` set means that choice ended.
    The last entry of a request has `done=True` and `usage`; an `error` entry is also final.
    A delta with `text` carries the text of all its `token_ids` (and of any before it); tokens in
    deltas without text ended inside a character, and a worker resuming the request holds them.
    """

    seq: int
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # per token: {"token_id", "logprob", "top": [[token_id, logprob], ...]}; only when requested
    logprobs: list[dict[str, Any]] | None = None
    # first entry only when prompt logprobs were requested: one dict per prompt token (first is null),
    # as above with "rank" too (the token's rank in the vocabulary, 1 for the likeliest)
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    done: bool = False
    usage: dict[str, Any] | None = None  # prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details
    error: str | None = None

    @property
    def final(self) -> bool:
        """Whether this is the request's last entry (nothing after it is read)."""
        return self.done or bool(self.error) or self.finish_reason == FinishReason.ERROR.value

    def encode(self) -> dict[str, str]:
        data = {k: v for k, v in vars(self).items() if v not in (None, "", [], False) or k in ("seq", "index")}
        return {"data": json.dumps(data, separators=(",", ":"))}

    @classmethod
    def decode(cls, fields: dict) -> "OutputDelta":
        return cls(**json.loads(_str(fields.get(b"data", fields.get("data")))))


@dataclass
class WorkerStats:
    """Heartbeat hash of one worker (all values stored as strings)."""

    name: str
    model: str
    state: str
    pid: int
    started_at: float
    updated_at: float
    pages_used: int
    pages_total: int
    running: int  # sequences in the running batch
    waiting: int  # sequences admitted to the worker but not yet running
    tokens_per_s: float  # generated tokens per second over the last few seconds
    prompt_tokens_per_s: float
    preemptions: int  # total since start
    requests_finished: int  # total since start
    mean_batch_size: float  # sequences per engine step over the last few seconds
    max_num_seqs: int
    prefix_cache_hit_rate: float = 0.0  # prompt tokens admitted over the last few seconds that the cache served
    draft_acceptance_rate: float = 0.0  # speculation: draft tokens checked over the last few seconds that stood
    draft_gate: str = ""  # speculation: what the draft gate chose by batch size, "1:drafts 8:fused" (draft_gate.py)
    step_compiles: int = 0  # step variants compiled since the warm-up ended (variant_compiles.py)
    compile_stall_s: float = 0.0  # seconds of those the engine thread waited for, every stream with it
    compiles_pending: int = 0  # step variants compiling in the background or queued to while idle (idle_compiles.py)

    def encode(self) -> dict[str, str]:
        return {k: str(v) for k, v in vars(self).items()}

    @classmethod
    def decode(cls, fields: dict) -> "WorkerStats":
        raw = {_str(k): _str(v) for k, v in fields.items()}
        out: dict[str, Any] = {}
        for f in cls.__dataclass_fields__.values():
            value = raw.get(f.name, "0")
            out[f.name] = {"int": int, "float": float}.get(f.type, str)(float(value) if f.type == "int" else value)
        return cls(**out)


def write_heartbeat(client, stats: WorkerStats) -> None:
    """A worker's heartbeat, in one round trip: its stats hash with a fresh TTL, its name in WORKERS."""
    key = worker_key(stats.name)
    client.pipeline().hset(key, mapping=stats.encode()).expire(key, HEARTBEAT_TTL_S).sadd(WORKERS, stats.name).execute()


@dataclass
class RequestEvent:
    """A finished request, as recorded in EVENTS. Times in seconds; never text."""

    id: str
    worker: str
    model: str
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    enqueued_at: float
    queue_s: float  # enqueue -> first scheduled
    ttft_s: float  # enqueue -> first token published
    tpot_s: float  # mean time per output token after the first
    e2e_s: float  # enqueue -> finished
    finished_at: float

    def encode(self) -> dict[str, str]:
        return {k: str(v) for k, v in vars(self).items()}

    @classmethod
    def decode(cls, fields: dict) -> "RequestEvent":
        raw = {_str(k): _str(v) for k, v in fields.items()}
        conv = {"int": int, "float": float, "str": str}
        return cls(**{name: conv[f.type](raw[name]) for name, f in cls.__dataclass_fields__.items()})


class TotalsDelta:
    """Increments to TOTALS fields, summed over a batch of finished requests and written as one
    HINCRBY (HINCRBYFLOAT for sums) per field: 64 requests finishing in one step move ~25 fields,
    where a command per increment took 15 per request (most of a worker's Redis CPU)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.sums: dict[str, float] = {}

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def add(self, name: str, value: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + value

    def write(self, pipe) -> None:
        for name, n in self.counts.items():
            pipe.hincrby(TOTALS, name, n)
        for name, value in self.sums.items():
            pipe.hincrbyfloat(TOTALS, name, value)


def record_finished(pipe, event: RequestEvent, totals: TotalsDelta | None = None) -> None:
    """Append the event to EVENTS and count it in every fleet counter it touches: in `totals`, for
    the caller to write once for its whole batch, else now (call inside a pipeline)."""
    pipe.xadd(EVENTS, event.encode(), maxlen=EVENTS_MAXLEN, approximate=True)
    batch = totals if totals is not None else TotalsDelta()
    batch.count(f"finished:{event.finish_reason}")
    observations = {"ttft_s": event.ttft_s, "e2e_s": event.e2e_s, "queue_s": event.queue_s}
    if event.output_tokens > 1:
        observations["tpot_s"] = event.tpot_s
    for name, value in observations.items():
        observe(batch, name, value)
    if totals is None:
        batch.write(pipe)


def observe(totals: TotalsDelta, name: str, value: float) -> None:
    """Add one observation to the histogram `name` in TOTALS: its bucket (the first bound >= value;
    readers add the buckets up into Prometheus' cumulative ones), the sum and the count. One
    increment per observation, where cumulative fields took up to one per bound."""
    bound = next((b for b in LATENCY_BUCKETS_S if value <= b), LATENCY_BUCKETS_S[-1])
    totals.count(bucket_field(name, bound))
    totals.add(f"{name}:sum", value)
    totals.count(f"{name}:count")


def bucket_field(name: str, bound: float) -> str:
    """The TOTALS field counting observations of `name` above the previous bound, up to `bound`."""
    return f"{name}:bucket:{bound_label(bound)}"


def bound_label(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def ensure_group(client) -> None:
    """Create the request stream and its consumer group if missing (idempotent)."""
    try:
        client.xgroup_create(REQUESTS, WORKERS_GROUP, id="0", mkstream=True)
    except Exception as exc:  # redis.ResponseError BUSYGROUP: already exists
        if "BUSYGROUP" not in str(exc):
            raise


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
