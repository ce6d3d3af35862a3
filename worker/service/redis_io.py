"""The worker's Redis side, on its own thread so Redis I/O never stalls a device step.

It pulls requests only up to the capacity the engine loop last reported (pull-based
admission), claims requests left by workers whose heartbeat expired, listens for cancels,
publishes output deltas (coalescing what arrives within a few milliseconds into one entry),
acknowledges finished requests and writes the heartbeat.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from worker import contract
from worker.contract import OutputDelta, RequestEvent, RequestMessage, WorkerStats
from worker.service.config import WorkerConfig

log = logging.getLogger("redjax.worker")


@dataclass
class Incoming:
    """A request handed to the engine loop. `emitted`/`finished` are non-empty when resuming."""

    entry_id: str
    message: RequestMessage
    emitted: dict[int, list[int]] = field(default_factory=dict)
    held: dict[int, int] = field(default_factory=dict)  # trailing emitted tokens whose text was not sent
    finished: dict[int, str] = field(default_factory=dict)
    next_seq: int = 0
    cancelled: bool = False


@dataclass
class Finished:
    """Everything the I/O thread needs to close a request."""

    request_id: str
    usage: dict[str, int]
    event: RequestEvent
    handed_back: bool = False  # re-enqueued instead of completed (drain timeout)


class RedisIO:
    def __init__(self, config: WorkerConfig, client: redis.Redis):
        self.config = config
        self.client = client
        self.inbox: queue.Queue[Incoming] = queue.Queue()  # new or resumed requests for the engine loop
        self.cancels: queue.Queue[str] = queue.Queue()  # request ids to abort
        self.wakeup = threading.Event()  # set when the inbox or cancels get something
        self._outbox: queue.Queue[tuple[str, list[OutputDelta]] | Finished | RequestMessage] = queue.Queue()
        self._capacity = 0
        self._stats: WorkerStats | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # request id -> (entry id, its API's notify stream), for requests this worker holds
        self._pulled: dict[str, tuple[str, str]] = {}
        self._thread = threading.Thread(target=self._run, name="redis-io", daemon=True)

    # ---- called from the engine loop ----

    def start(self) -> None:
        contract.ensure_group(self.client)
        self.client.sadd(contract.WORKERS, self.config.name)
        self._thread.start()

    def set_capacity(self, n: int) -> None:
        with self._lock:
            self._capacity = n

    def set_stats(self, stats: WorkerStats) -> None:
        with self._lock:
            self._stats = stats

    def publish(self, request_id: str, deltas: list[OutputDelta]) -> None:
        self._outbox.put((request_id, deltas))

    def finish(self, done: Finished) -> None:
        self._outbox.put(done)

    def hand_back(self, message: RequestMessage) -> None:
        """Re-enqueue a request this worker will not finish (drain); another worker resumes it."""
        self._outbox.put(message)

    def stop(self) -> None:
        """Flush everything queued, remove the heartbeat, stop the thread."""
        self._stop.set()
        self._thread.join(timeout=30)
        self._flush()
        self.client.delete(contract.worker_key(self.config.name))

    # ---- the thread ----

    def _run(self) -> None:
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(contract.CANCEL_CHANNEL)
        last_beat = last_claim = 0.0
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                self._flush()
                self._take_cancels(pubsub)
                if now - last_beat >= contract.HEARTBEAT_INTERVAL_S:
                    self._heartbeat()
                    last_beat = now
                if now - last_claim >= self.config.claim_interval_s:
                    self._claim_orphans()
                    last_claim = now
                self._pull()
            except redis.RedisError as exc:  # Redis away: keep the engine running, retry shortly
                log.warning("redis error in worker I/O: %s", type(exc).__name__)
                time.sleep(0.5)
        pubsub.close()

    def _pull(self) -> None:
        with self._lock:
            capacity = self._capacity
        if capacity <= 0:
            self._stop.wait(self.config.flush_interval_s)
            return
        block_ms = max(1, int(self.config.flush_interval_s * 1000))
        reply = self.client.xreadgroup(
            contract.WORKERS_GROUP, self.config.name, {contract.REQUESTS: ">"}, count=capacity, block=block_ms
        )
        self._admit([(_s(entry_id), fields) for _, entries in reply or [] for entry_id, fields in entries])
        if reply:
            with self._lock:
                self._capacity = max(0, self._capacity - sum(len(e) for _, e in reply))

    def _admit(self, entries: list[tuple[str, dict]], resumed: bool = False) -> None:
        """Hand pulled (or claimed) request entries to the engine thread; whether each was cancelled
        before it got here is asked for all of them in one round trip."""
        admitted = []
        for entry_id, fields in entries:
            try:
                admitted.append(Incoming(entry_id, RequestMessage.decode(fields)))
            except (ValueError, TypeError, KeyError):
                log.error("dropping malformed request entry %s", entry_id)
                self.client.pipeline().xack(contract.REQUESTS, contract.WORKERS_GROUP, entry_id).xdel(
                    contract.REQUESTS, entry_id).execute()
        if not admitted:
            return
        pipe = self.client.pipeline(transaction=False)
        for incoming in admitted:
            pipe.exists(contract.cancelled_key(incoming.message.id))
        for incoming, cancelled in zip(admitted, pipe.execute()):
            if resumed or incoming.message.attempt > 0:
                self._read_emitted(incoming)
            incoming.cancelled = bool(cancelled)
            self._pulled[incoming.message.id] = (incoming.entry_id, incoming.message.notify)
            self.inbox.put(incoming)
        self.wakeup.set()

    def _read_emitted(self, incoming: Incoming) -> None:
        """What earlier workers already published for this request (resume point)."""
        seen = -1
        for _, fields in self.client.xrange(contract.out_stream(incoming.message.id)):
            delta = OutputDelta.decode(fields)
            if delta.seq <= seen:
                continue
            seen = delta.seq
            incoming.emitted.setdefault(delta.index, []).extend(delta.token_ids)
            # a detokenizer emits the text of all its tokens or none (an unfinished character)
            incoming.held[delta.index] = 0 if delta.text else incoming.held.get(delta.index, 0) + len(delta.token_ids)
            if delta.finish_reason:
                incoming.finished[delta.index] = delta.finish_reason
        incoming.next_seq = seen + 1

    def _claim_orphans(self) -> None:
        """Claim requests pending on consumers whose heartbeat has expired."""
        with self._lock:
            capacity = self._capacity
        if capacity <= 0:
            return
        pending = self.client.xpending_range(contract.REQUESTS, contract.WORKERS_GROUP, "-", "+", count=100)
        alive: dict[str, bool] = {}
        orphans = []
        for p in pending:
            consumer = _s(p["consumer"])
            if consumer == self.config.name:
                continue
            if consumer not in alive:
                alive[consumer] = bool(self.client.exists(contract.worker_key(consumer)))
            if not alive[consumer] and p["time_since_delivered"] >= contract.HEARTBEAT_TTL_S * 1000:
                orphans.append(_s(p["message_id"]))
        if not orphans:
            return
        claimed = self.client.xclaim(
            contract.REQUESTS, contract.WORKERS_GROUP, self.config.name, contract.HEARTBEAT_TTL_S * 1000,
            orphans[:capacity],
        )
        entries = [(_s(entry_id), fields) for entry_id, fields in claimed if fields]
        for entry_id, _ in entries:
            log.info("claimed request entry %s from a dead worker", entry_id)
        self._admit(entries, resumed=True)

    def _take_cancels(self, pubsub) -> None:
        while True:
            message = pubsub.get_message(timeout=0)
            if message is None:
                return
            request_id = _s(message["data"])
            if request_id in self._pulled:
                self.cancels.put(request_id)
                self.wakeup.set()

    def _heartbeat(self) -> None:
        with self._lock:
            stats = self._stats
        if stats is None:
            return
        key = contract.worker_key(self.config.name)
        self.client.pipeline().hset(key, mapping=stats.encode()).expire(key, contract.HEARTBEAT_TTL_S).sadd(
            contract.WORKERS, self.config.name).execute()

    def _flush(self) -> None:
        """Write every queued delta (one entry per request per flush), then close finished requests."""
        items: list[Any] = []
        while True:
            try:
                items.append(self._outbox.get_nowait())
            except queue.Empty:
                break
        if not items:
            return
        pipe = self.client.pipeline(transaction=False)
        generated = 0
        touched: dict[str, list[str]] = {}  # notify stream -> requests with new entries
        for item in items:
            if isinstance(item, tuple):
                request_id, deltas = item
                for delta in deltas:
                    generated += len(delta.token_ids)
                    pipe.xadd(contract.out_stream(request_id), delta.encode())
                if notify := self._pulled.get(request_id, ("", ""))[1]:
                    touched.setdefault(notify, []).append(request_id)
            elif isinstance(item, Finished):
                self._close(pipe, item)
            else:
                self._requeue(pipe, item)
        for notify, request_ids in touched.items():  # after the entries they announce
            contract.notify_outputs(pipe, notify, request_ids)
        if generated:
            pipe.hincrby(contract.TOTALS, contract.TOTAL_GENERATION_TOKENS, generated)
        pipe.execute()

    def _close(self, pipe, done: Finished) -> None:
        entry_id = self._pulled.pop(done.request_id, (None, ""))[0]
        if not done.handed_back:
            pipe.expire(contract.out_stream(done.request_id), contract.OUTPUT_TTL_S)
            contract.record_finished(pipe, done.event)
            pipe.hincrby(contract.TOTALS, contract.TOTAL_PROMPT_TOKENS, done.usage.get("prompt_tokens", 0))
        if entry_id is not None:
            pipe.xack(contract.REQUESTS, contract.WORKERS_GROUP, entry_id)
            pipe.xdel(contract.REQUESTS, entry_id)

    def _requeue(self, pipe, message: RequestMessage) -> None:
        entry_id = self._pulled.pop(message.id, (None, ""))[0]
        message.attempt += 1
        pipe.xadd(contract.REQUESTS, message.encode())
        if entry_id is not None:
            pipe.xack(contract.REQUESTS, contract.WORKERS_GROUP, entry_id)
            pipe.xdel(contract.REQUESTS, entry_id)


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
