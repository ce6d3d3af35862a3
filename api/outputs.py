"""One background task reads the output streams of every active request of this API process.

Workers announce new output on this process's notify stream (contract.api_notify_stream) with
the ids of the requests concerned. The reader blocks in XREAD on that one stream, then reads
only the out_streams named, from where it last stopped, so a read costs what has new output, not
what is queued. Once a second (SWEEP_S) it reads every subscribed stream instead: outputs of a
notification trimmed away, or written by anything that does not notify, arrive within a second.
Each decoded OutputDelta goes to the request's own asyncio queue; `seq`s already seen are
dropped (delivery is at least once). A stream whose final entry has been read is deleted with
the next read: the worker's TTL on it (OUTPUT_TTL_S) is only for streams nobody reads. Twice a
second the reader also puts TICK on the queues of runs past a deadline (the caller's `overdue`),
so a run waits on its queue alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError

from worker.contract import REQUESTS, OutputDelta, out_stream

log = logging.getLogger("redjax.api")

BLOCK_MS = 1000  # longest wait for a notification
SWEEP_S = 1.0  # every subscribed stream is read at least this often
NOTIFY_BATCH = 1024  # notifications per XREAD
BATCH = 256  # entries per stream per XREAD
RETRY_S = 0.5  # pause between reads while Redis fails
OUTAGE_S = 10.0  # Redis failing this long fails the requests; a restart of a Redis with AOF is shorter
TICK_S = 0.5  # how often the reader looks for runs past a deadline
TICK = object()  # put on an overdue run's queue as (None, TICK): no output, a moment to end on its deadline


class ReaderFailed(Exception):
    """Put on a subscriber's queue when Redis failed; the request cannot learn its outcome."""


class RequestLost(ReaderFailed):
    """Put on a subscriber's queue when Redis lost its data and the request with it (`fail_lost`)."""


@dataclass
class Subscription:
    request_id: str
    queue: asyncio.Queue  # receives (request_id, OutputDelta | ReaderFailed), and (None, TICK)
    started: float = 0.0  # time.monotonic() when its run started: what its deadlines count from
    last_id: str = "0"  # last stream entry id read
    seen: set[int] = field(default_factory=set)  # seq numbers delivered
    entry_id: str = ""  # its entry in the request stream, once enqueued
    final: bool = False  # its final entry has been delivered


class OutputReader:
    def __init__(self, client: Redis, notify_stream: str) -> None:
        self.client = client  # a connection of its own: it spends its life blocked in XREAD
        self.notify_stream = notify_stream
        self._subs: dict[str, Subscription] = {}
        self._changed = asyncio.Event()
        self._notify_id = "0"
        self._swept = 0.0  # monotonic time of the last read of every subscribed stream
        self._spent: list[str] = []  # out_streams whose final entry was read: deleted at the next read
        self.sweep_s = SWEEP_S
        self._closed = False

    def subscribe(self, request_id: str, queue: asyncio.Queue, started: float = 0.0) -> Subscription:
        """Deliver request_id's deltas to `queue` as (request_id, delta); several requests may share one.
        `started`: when its run started (time.monotonic()), for tick()'s deadlines."""
        sub = Subscription(request_id, queue, started)
        self._subs[request_id] = sub
        self._changed.set()
        return sub

    def unsubscribe(self, request_id: str) -> None:
        self._subs.pop(request_id, None)

    @property
    def active(self) -> int:
        return len(self._subs)

    async def fail_lost(self, client: Redis) -> int:
        """After Redis lost its data (it restarted without persistence): fail the subscribed requests
        it no longer holds, neither their queue entry nor any output (a worker that runs one has
        written output again by now). Their clients get a 503 now instead of waiting for the
        request timeout; a worker that still holds one drops it at the cancel. How many failed."""
        subs = [sub for sub in self._subs.values() if sub.entry_id and not sub.final]
        if not subs:
            return 0
        pipe = client.pipeline(transaction=False)
        for sub in subs:
            pipe.xrange(REQUESTS, sub.entry_id, sub.entry_id)
            pipe.exists(out_stream(sub.request_id))
        replies = await pipe.execute()
        lost = [sub for sub, entry, output in zip(subs, replies[::2], replies[1::2]) if not entry and not output]
        for sub in lost:
            if self._subs.pop(sub.request_id, None) is not None:
                sub.queue.put_nowait((sub.request_id, RequestLost("Redis lost the request")))
        return len(lost)

    async def tick(self, overdue: Callable[[float], bool]) -> None:
        """Each TICK_S until cancelled, put TICK on the queue of every subscription for which
        `overdue(started)` holds: one timer here instead of a timeout per awaited delta, and only
        the runs that must end are woken. (Until session 48 every queue got TICK twice a second:
        with 1024 streams open the API spent ~8 % of its CPU on runs that had nothing to do.)"""
        while True:
            await asyncio.sleep(TICK_S)
            due = {id(s.queue): s.queue for s in self._subs.values() if overdue(s.started)}
            for queue in due.values():
                queue.put_nowait((None, TICK))

    def close(self) -> None:
        """Make run() return at its next turn (at most BLOCK_MS): with redis-py 8 a task cancelled
        right after a blocking read returned can miss the cancellation and read on."""
        self._closed = True
        self._changed.set()

    async def run(self) -> None:
        """Read until closed or cancelled. When Redis fails, the reader retries at once (a connection
        a Redis restart left behind fails once, and the retry reconnects), then every RETRY_S; its
        requests fail only once Redis has failed for OUTAGE_S. A Redis with AOF that restarts in
        that time still holds their queue entries and outputs, and they finish (session 50: before,
        all 128 requests in flight got a 503 when such a Redis restarted in 1 s)."""
        failing_since: float | None = None
        while not self._closed:
            if not self._subs and not self._spent:
                self._changed.clear()
                await self._changed.wait()
                continue
            try:
                request_ids = await self._notified() if self._subs else set()
                if time.monotonic() - self._swept >= self.sweep_s:
                    request_ids, self._swept = set(self._subs), time.monotonic()
                streams = {out_stream(rid): self._subs[rid].last_id for rid in request_ids if rid in self._subs}
                replies = await self._read(streams)
                failing_since = None
            except (RedisError, OSError) as exc:
                if self._closed:
                    return
                if failing_since is None:
                    failing_since = time.monotonic()
                    continue
                if time.monotonic() - failing_since < OUTAGE_S:
                    await asyncio.sleep(RETRY_S)
                    continue
                log.warning("output reader: redis error %s; failing %d requests", type(exc).__name__, self.active)
                for sub in list(self._subs.values()):
                    sub.queue.put_nowait((sub.request_id, ReaderFailed(str(exc))))
                self._subs.clear()
                failing_since = None  # the next requests get their time too
                continue
            for name, entries in replies or []:
                self._dispatch(name.decode() if isinstance(name, bytes) else name, entries)

    async def _read(self, streams: dict[str, str]) -> list | None:
        """XREAD `streams` from their ids; the spent streams are deleted in the same round trip."""
        if not self._spent:
            return await self.client.xread(streams, count=BATCH) if streams else None
        pipe = self.client.pipeline(transaction=False)
        pipe.unlink(*self._spent)
        if streams:
            pipe.xread(streams, count=BATCH)
        replies = await pipe.execute()
        self._spent = []
        return replies[1] if streams else None

    async def _notified(self) -> set[str]:
        """Ids of requests with new output, from the notify stream (waits up to BLOCK_MS, less when
        a sweep is due)."""
        wait_ms = max(1, min(BLOCK_MS, int((self._swept + self.sweep_s - time.monotonic()) * 1000)))
        replies = await self.client.xread({self.notify_stream: self._notify_id}, count=NOTIFY_BATCH, block=wait_ms)
        ids: set[str] = set()
        for _, entries in replies or []:
            self._notify_id = _id(entries[-1][0])
            for _, fields in entries:
                try:
                    ids.update(json.loads(fields.get(b"ids", fields.get("ids", "[]"))))
                except (ValueError, TypeError):
                    log.error("output reader: malformed notification in %s", self.notify_stream)
        return ids

    def _dispatch(self, stream: str, entries: list) -> None:
        sub = self._subs.get(stream.removeprefix(out_stream("")))
        if sub is None:
            return
        for entry_id, fields in entries:
            sub.last_id = _id(entry_id)
            try:
                delta = OutputDelta.decode(fields)
            except (ValueError, TypeError, KeyError):
                log.error("output reader: malformed entry %s in %s", sub.last_id, stream)
                continue
            if delta.seq in sub.seen:
                continue
            sub.seen.add(delta.seq)
            sub.queue.put_nowait((sub.request_id, delta))
            if delta.final:
                sub.final = True
                self._spent.append(stream)


def _id(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
