"""The worker's Redis side, on threads of its own so Redis I/O never stalls a device step.

Three threads, each asleep until it has something to do (no polling: on a small machine every
wake-up of a thread takes a core from the engine's compute threads for a moment):

- `redis-in` pulls requests only up to the capacity the engine loop last reported (pull-based
  admission), blocking in XREADGROUP while there is room and on the capacity while there is none;
  it also claims requests left by workers whose heartbeat expired, writes the heartbeat, and drops
  the requests of API processes that are gone (their alive key expired: no client is left to read
  them), both when it pulls them and, every API_CHECK_S, those it holds.
- `redis-out` waits on the outbox: the engine loop hands over what one turn of it produced (the
  deltas of a step, finished and handed-back requests) as one batch, written in one pipelined
  round trip with one notification per API.
- `redis-cancels` waits on the cancel channel.
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
PULL_BLOCK_S = 0.1  # longest XREADGROUP wait: how stale the pull's capacity and the heartbeat can get
CANCEL_WAIT_S = 0.5  # longest wait for a cancel before the thread looks at the stop flag again
RETRY_S = 0.5  # after a Redis error
API_CHECK_S = 2.0  # how often the APIs of the requests held are checked for life
# an entry pending under this worker's own name that has waited this much longer than the worker has
# run was delivered to a dead worker of the same name (a restarted container: same hostname, pid 1)
OWN_MARGIN_S = 1.0
# WorkerStats running counts whose gains each heartbeat adds to a TOTALS field (/metrics' counters)
HEARTBEAT_TOTALS = {"preemptions": contract.TOTAL_PREEMPTIONS, "step_compiles": contract.TOTAL_STEP_COMPILES,
                    "compile_stall_s": contract.TOTAL_COMPILE_STALL_S}


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
    failed: str = ""  # why it is answered with an error instead of run (claimed from too many dead workers)


@dataclass
class Finished:
    """Everything the I/O thread needs to close a request."""

    request_id: str
    usage: dict[str, Any]  # OpenAI's usage object
    event: RequestEvent
    handed_back: bool = False  # re-enqueued instead of completed (drain timeout)


Item = tuple[str, list[OutputDelta]] | Finished | RequestMessage  # what the engine loop hands over


class RedisIO:
    def __init__(self, config: WorkerConfig, client: redis.Redis):
        self.config = config
        self.client = client
        self.inbox: queue.Queue[Incoming] = queue.Queue()  # new or resumed requests for the engine loop
        self.cancels: queue.Queue[str] = queue.Queue()  # request ids to abort
        self.wakeup = threading.Event()  # set when the inbox or cancels get something
        self._pending: list[Item] = []  # this turn of the engine loop's output, not yet handed over
        self._outbox: queue.Queue[list[Item] | None] = queue.Queue()  # batches for redis-out; None: stop
        self._capacity = 0
        self._room = threading.Event()  # set while capacity > 0
        self._stats: WorkerStats | None = None
        self._lock = threading.Lock()  # the capacity and the stats, between the engine loop and redis-in
        self._stop = threading.Event()
        self._started = time.monotonic()  # before the first pull: every entry this process pulls is younger
        self._draining = False  # set by a signal handler: pull and claim nothing more
        # request id -> (entry id, its API's notify stream), for requests this worker holds
        self._pulled: dict[str, tuple[str, str]] = {}
        self._orphaned: set[str] = set()  # request ids already handed to the engine loop as cancels
        self._missing_apis: set[str] = set()  # notify streams whose API's alive key the last check missed
        # heartbeat field -> TOTALS field: of each running count, the part already added to TOTALS
        self._counted: dict[str, float] = dict.fromkeys(HEARTBEAT_TOTALS, 0)
        self._pubsub = None
        self._threads = [
            threading.Thread(target=self._read, name="redis-in", daemon=True),
            threading.Thread(target=self._write, name="redis-out", daemon=True),
            threading.Thread(target=self._listen_cancels, name="redis-cancels", daemon=True),
        ]

    # ---- called from the engine loop ----

    def start(self) -> None:
        contract.ensure_group(self.client)
        self.client.sadd(contract.WORKERS, self.config.name)
        # subscribed before the first pull: a cancel sent after a request's admission check is heard
        self._pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(contract.CANCEL_CHANNEL)
        for thread in self._threads:
            thread.start()

    def set_capacity(self, n: int) -> None:
        with self._lock:
            self._capacity = n
            if n > 0:
                self._room.set()
            else:
                self._room.clear()

    def stop_pulling(self) -> None:
        """Pull and claim nothing more, from now on. Safe in a signal handler: one assignment, no
        lock (redis-in reads it before each pull)."""
        self._draining = True

    def set_stats(self, stats: WorkerStats) -> None:
        with self._lock:
            self._stats = stats

    def publish(self, request_id: str, deltas: list[OutputDelta]) -> None:
        self._pending.append((request_id, deltas))

    def finish(self, done: Finished) -> None:
        self._pending.append(done)

    def hand_back(self, message: RequestMessage) -> None:
        """Re-enqueue a request this worker will not finish (drain); another worker resumes it."""
        self._pending.append(message)

    def send(self) -> None:
        """Hand everything published, finished or handed back since the last call to redis-out."""
        if self._pending:
            self._outbox.put(self._pending)
            self._pending = []

    def stop(self) -> None:
        """Write everything handed over, remove the heartbeat, stop the threads."""
        self.send()
        self._stop.set()
        self._room.set()
        self._outbox.put(None)
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=30)
        try:
            self._flush()  # what a writer that never started, or gave up on a Redis away, left
            self.client.delete(contract.worker_key(self.config.name))
        except redis.RedisError as exc:
            log.error("redis unreachable at shutdown (%s): output not yet written is lost", type(exc).__name__)

    # ---- the threads ----

    def _read(self) -> None:
        last_beat = last_claim = last_api_check = 0.0
        group_gone = False
        while not self._stop.is_set():
            try:
                if group_gone:  # Redis lost its data (restarted without persistence): begin anew
                    contract.ensure_group(self.client)
                    log.warning("created the request stream's consumer group again")
                    group_gone = False
                now = time.monotonic()
                if now - last_beat >= contract.HEARTBEAT_INTERVAL_S:
                    self._heartbeat()
                    last_beat = now
                if now - last_claim >= self.config.claim_interval_s:
                    self._claim_orphans()
                    last_claim = now
                if now - last_api_check >= API_CHECK_S:
                    self._drop_requests_of_gone_apis()
                    last_api_check = now
                self._pull()
            except redis.RedisError as exc:  # Redis away: keep the engine running, retry shortly
                log.warning("redis error in worker I/O: %s", type(exc).__name__)
                group_gone = "NOGROUP" in str(exc)
                self._stop.wait(RETRY_S)

    def _write(self) -> None:
        while (batch := self._outbox.get()) is not None:
            items = batch + self._take_outbox()
            # Redis away: the same items again once it is back. Readers drop repeated seqs; a batch
            # whose first try reached Redis before the connection broke is applied twice.
            while True:
                try:
                    self._write_items(items)
                    break
                except redis.RedisError as exc:
                    log.warning("redis error in worker I/O: %s", type(exc).__name__)
                    if self._stop.wait(RETRY_S):  # stopping: one more try, in stop()
                        self._outbox.put(items)
                        return

    def _listen_cancels(self) -> None:
        while not self._stop.is_set():
            try:
                message = self._pubsub.get_message(timeout=CANCEL_WAIT_S)
            except redis.RedisError as exc:
                log.warning("redis error in worker I/O: %s", type(exc).__name__)
                self._stop.wait(RETRY_S)
                continue
            if message is not None and (request_id := _s(message["data"])) in self._pulled:
                self.cancels.put(request_id)
                self.wakeup.set()
        self._pubsub.close()

    def _pull(self) -> None:
        """Requests up to the capacity: blocks in XREADGROUP for new ones while there is room, on
        the room itself while there is none."""
        if self._draining:
            self._stop.wait(PULL_BLOCK_S)
            return
        with self._lock:
            capacity = self._capacity
        if capacity <= 0:
            self._room.wait(PULL_BLOCK_S)
            return
        reply = self.client.xreadgroup(
            contract.WORKERS_GROUP, self.config.name, {contract.REQUESTS: ">"}, count=capacity,
            block=int(PULL_BLOCK_S * 1000),
        )
        self._admit([(_s(entry_id), fields) for _, entries in reply or [] for entry_id, fields in entries])
        if reply:
            with self._lock:
                self._capacity = max(0, self._capacity - sum(len(e) for _, e in reply))
                if self._capacity == 0:
                    self._room.clear()

    def _admit(self, entries: list[tuple[str, dict]], resumed: bool = False,
               doomed: frozenset[str] | set[str] = frozenset()) -> None:
        """Hand pulled (or claimed) request entries to the engine thread; whether each was cancelled
        before it got here is asked for all of them in one round trip. `doomed` entries are handed
        over to be answered with an error (Incoming.failed)."""
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
        apis = _ask_alive(pipe, {incoming.message.notify for incoming in admitted})
        replies = pipe.execute()
        gone, dropped = _gone(apis, replies[len(admitted):]), 0
        for incoming, cancelled in zip(admitted, replies):
            if resumed or incoming.message.attempt > 0:
                self._read_emitted(incoming)
            orphan = incoming.message.notify in gone
            incoming.cancelled = bool(cancelled) or orphan
            if orphan:
                self._orphaned.add(incoming.message.id)
                dropped += 1
            if incoming.entry_id in doomed:
                incoming.failed = (f"the request was running on {contract.MAX_DEATHS} or more workers that died; "
                                   "it is not run again")
            self._pulled[incoming.message.id] = (incoming.entry_id, incoming.message.notify)
            self.inbox.put(incoming)
        if dropped:
            log.warning("dropping %d queued request(s): the API process that took them is gone", dropped)
        self.wakeup.set()

    def _drop_requests_of_gone_apis(self) -> None:
        """Cancel, in the engine loop, the held requests whose API process is gone: its alive key was
        missing at two checks in a row. A Redis that restarted empty has lost every key, and a live
        API sets its own again within a second; the requests it waits for are not dropped."""
        held = list(self._pulled.items())
        pipe = self.client.pipeline(transaction=False)
        apis = _ask_alive(pipe, {notify for _, (_, notify) in held})
        if not apis:
            self._missing_apis = set()
            return
        missing = _gone(apis, pipe.execute())
        gone, self._missing_apis = missing & self._missing_apis, missing
        dropped = [rid for rid, (_, notify) in held if notify in gone and rid not in self._orphaned]
        for request_id in dropped:
            self._orphaned.add(request_id)
            self.cancels.put(request_id)
        if dropped:
            log.warning("aborting %d request(s): the API process that took them is gone", len(dropped))
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
        """Claim requests pending on consumers whose heartbeat has expired, and those pending under
        this worker's own name since before it started (a dead worker of the same name held them)."""
        with self._lock:
            capacity = self._capacity
        if capacity <= 0 or self._draining:
            return
        pending = self.client.xpending_range(contract.REQUESTS, contract.WORKERS_GROUP, "-", "+", count=100)
        alive: dict[str, bool] = {}
        orphans: dict[str, int] = {}  # entry id -> workers it was delivered to, each of them dead
        before_us_ms = (time.monotonic() - self._started + OWN_MARGIN_S) * 1000
        for p in pending:
            consumer = _s(p["consumer"])
            if consumer == self.config.name:
                if p["time_since_delivered"] > before_us_ms:
                    orphans[_s(p["message_id"])] = p["times_delivered"]
                continue
            if consumer not in alive:
                alive[consumer] = bool(self.client.exists(contract.worker_key(consumer)))
            if not alive[consumer] and p["time_since_delivered"] >= contract.HEARTBEAT_TTL_S * 1000:
                orphans[_s(p["message_id"])] = p["times_delivered"]
        if not orphans:
            return
        claimed = self.client.xclaim(
            contract.REQUESTS, contract.WORKERS_GROUP, self.config.name, contract.HEARTBEAT_TTL_S * 1000,
            list(orphans)[:capacity],
        )
        entries = [(_s(entry_id), fields) for entry_id, fields in claimed if fields]
        doomed = {entry_id for entry_id, _ in entries if orphans[entry_id] >= contract.MAX_DEATHS}
        for entry_id, _ in entries:
            if entry_id in doomed:
                log.warning("request entry %s was held by %d workers that died: answering it with an error instead "
                            "of running it again", entry_id, orphans[entry_id])
            else:
                log.info("claimed request entry %s from a dead worker", entry_id)
        self._admit(entries, resumed=True, doomed=doomed)

    def _heartbeat(self) -> None:
        """Write the heartbeat, and add what its running counts (preemptions, compiles) gained since
        the last one to the fleet's counters."""
        with self._lock:
            stats = self._stats
        if stats is None:
            return
        contract.write_heartbeat(self.client, stats)
        pipe = self.client.pipeline()  # (no round trip until it holds a command)
        for name, total in HEARTBEAT_TOTALS.items():
            if (new := getattr(stats, name) - self._counted[name]) > 0:
                (pipe.hincrby if isinstance(new, int) else pipe.hincrbyfloat)(contract.TOTALS, total, new)
                self._counted[name] = getattr(stats, name)
        if len(pipe):
            pipe.execute()

    def _take_outbox(self, stop_at_none: bool = True) -> list[Item]:
        items: list[Item] = []
        while True:
            try:
                batch = self._outbox.get_nowait()
            except queue.Empty:
                return items
            if batch is None and stop_at_none:  # put back for the writer's loop to see
                self._outbox.put(None)
                return items
            items += batch or []

    def _flush(self) -> None:
        """Write every batch handed over and not yet written, on the caller's thread."""
        if items := self._take_outbox(stop_at_none=False):
            self._write_items(items)

    def _write_items(self, items: list[Item]) -> None:
        """Every delta an entry, finished requests closed, handed-back ones re-enqueued, all in one
        pipelined round trip; one notification per API, after the entries it announces."""
        pipe = self.client.pipeline(transaction=False)
        generated = 0
        touched: dict[str, list[str]] = {}  # notify stream -> requests with new entries
        totals = contract.TotalsDelta()  # the batch's counters, one increment per field
        settled: list[str] = []  # request entries finished or re-enqueued: acknowledged and deleted at once
        for item in items:
            if isinstance(item, tuple):
                request_id, deltas = item
                for delta in deltas:
                    generated += len(delta.token_ids)
                    pipe.xadd(contract.out_stream(request_id), delta.encode())
                if notify := self._pulled.get(request_id, ("", ""))[1]:
                    touched.setdefault(notify, []).append(request_id)
            elif isinstance(item, Finished):
                self._close(pipe, item, totals, settled)
            else:
                self._requeue(pipe, item, settled)
        for notify, request_ids in touched.items():  # after the entries they announce
            contract.notify_outputs(pipe, notify, request_ids)
        if generated:
            totals.count(contract.TOTAL_GENERATION_TOKENS, generated)
        totals.write(pipe)
        if settled:  # after their outputs and replacements, in the same round trip
            pipe.xack(contract.REQUESTS, contract.WORKERS_GROUP, *settled)
            pipe.xdel(contract.REQUESTS, *settled)
        pipe.execute()

    def _close(self, pipe, done: Finished, totals: contract.TotalsDelta, settled: list[str]) -> None:
        entry_id = self._pulled.pop(done.request_id, (None, ""))[0]
        self._orphaned.discard(done.request_id)
        if not done.handed_back:
            pipe.expire(contract.out_stream(done.request_id), contract.OUTPUT_TTL_S)
            pipe.delete(contract.cancelled_key(done.request_id))  # closed: no worker pulls it again
            contract.record_finished(pipe, done.event, totals)
            totals.count(contract.TOTAL_PROMPT_TOKENS, done.usage.get("prompt_tokens", 0))
            totals.count(contract.TOTAL_CACHED_PROMPT_TOKENS,
                         done.usage.get("prompt_tokens_details", {}).get("cached_tokens", 0))
        if entry_id is not None:
            settled.append(entry_id)

    def _requeue(self, pipe, message: RequestMessage, settled: list[str]) -> None:
        entry_id = self._pulled.pop(message.id, (None, ""))[0]
        message.attempt += 1
        pipe.xadd(contract.REQUESTS, message.encode())
        if entry_id is not None:
            settled.append(entry_id)


def _ask_alive(pipe, notify_streams: set[str]) -> list[str]:
    """Queue on `pipe` whether the API behind each notify stream is alive; the streams asked about,
    in the order of their replies (requests from other producers name none)."""
    apis = sorted(n for n in notify_streams if n)
    for notify in apis:
        pipe.exists(contract.api_alive_key(notify))
    return apis


def _gone(apis: list[str], alive: list) -> set[str]:
    """The notify streams of `_ask_alive` whose API's alive key is missing."""
    return {notify for notify, ok in zip(apis, alive) if not ok}


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
