"""One background task reads the output streams of every active request of this API process.

It blocks in a single XREAD over all of them (plus this process's wake stream, which every
enqueue touches so a new request's stream joins at once) and hands each decoded OutputDelta to
the request's own asyncio queue, dropping `seq`s already seen (delivery is at least once).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError

from worker.contract import OutputDelta, out_stream

log = logging.getLogger("redjax.api")

BLOCK_MS = 1000  # longest XREAD wait; new subscriptions wake it earlier through the wake stream
TICK_S = 0.5  # how often every subscriber's queue gets TICK (waiting runs look at their deadlines)
TICK = object()  # put on subscriber queues as (None, TICK): no output, only a moment to check deadlines
BATCH = 256  # entries per stream per XREAD
RETRY_S = 0.5  # pause after a Redis error


class ReaderFailed(Exception):
    """Put on a subscriber's queue when Redis failed; the request cannot learn its outcome."""


@dataclass
class Subscription:
    request_id: str
    queue: asyncio.Queue  # receives (request_id, OutputDelta | ReaderFailed), and (None, TICK)
    last_id: str = "0"  # last stream entry id read
    seen: set[int] = field(default_factory=set)  # seq numbers delivered


class OutputReader:
    def __init__(self, client: Redis, wake_stream: str) -> None:
        self.client = client  # a connection of its own: it spends its life blocked in XREAD
        self.wake_stream = wake_stream
        self._subs: dict[str, Subscription] = {}
        self._changed = asyncio.Event()
        self._wake_id = "0"

    def subscribe(self, request_id: str, queue: asyncio.Queue) -> Subscription:
        """Deliver request_id's deltas to `queue` as (request_id, delta); several requests may share one."""
        sub = Subscription(request_id, queue)
        self._subs[request_id] = sub
        self._changed.set()
        return sub

    def unsubscribe(self, request_id: str) -> None:
        self._subs.pop(request_id, None)

    @property
    def active(self) -> int:
        return len(self._subs)

    async def tick(self) -> None:
        """Put TICK on every subscriber's queue each TICK_S, until cancelled: a run then waits on its
        queue alone (one timer here instead of a timeout per awaited delta)."""
        while True:
            await asyncio.sleep(TICK_S)
            for queue in {id(s.queue): s.queue for s in self._subs.values()}.values():
                queue.put_nowait((None, TICK))

    async def run(self) -> None:
        """Read until cancelled."""
        while True:
            if not self._subs:
                self._changed.clear()
                await self._changed.wait()
                continue
            streams = {out_stream(rid): sub.last_id for rid, sub in self._subs.items()}
            streams[self.wake_stream] = self._wake_id
            try:
                replies = await self.client.xread(streams, count=BATCH, block=BLOCK_MS)
            except (RedisError, OSError) as exc:
                log.warning("output reader: redis error %s; failing %d requests", type(exc).__name__, self.active)
                for sub in list(self._subs.values()):
                    sub.queue.put_nowait((sub.request_id, ReaderFailed(str(exc))))
                self._subs.clear()
                await asyncio.sleep(RETRY_S)
                continue
            for name, entries in replies or []:
                self._dispatch(name.decode() if isinstance(name, bytes) else name, entries)

    def _dispatch(self, stream: str, entries: list) -> None:
        if stream == self.wake_stream:
            self._wake_id = _id(entries[-1][0])
            return
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


def _id(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
