"""Run: one HTTP request's queued requests, from enqueue to their last delta (or their cancel).

Deltas of all of a run's requests arrive on one asyncio queue. While it waits, the run watches
two deadlines (ApiServices.overdue): the whole request (request_timeout_s -> 504) and the fleet
(no live worker for no_worker_timeout_s -> 503); the output reader puts TICK on its queue once
one has passed.
Whenever it ends unfinished, its requests are withdrawn: taken off the queue if no worker has
them yet, and a cancel is published for the rest.
"""

from __future__ import annotations

import asyncio
import logging
import time

import anyio
from redis.exceptions import RedisError

from api.errors import ApiError, redis_unavailable
from api.outputs import TICK, ReaderFailed, RequestLost
from api.protocol import ParsedRequest
from api.services import ApiServices
from worker.contract import OutputDelta

log = logging.getLogger("redjax.api")


class Run:
    def __init__(self, services: ApiServices, parsed: ParsedRequest) -> None:
        self.services = services
        self.ids = [m.id for m in parsed.requests]
        self.messages = parsed.requests
        self.index = {rid: i for i, rid in enumerate(self.ids)}
        self.unfinished = set(self.ids)
        self.entry_ids: dict[str, str] = {}
        self.queue: asyncio.Queue = asyncio.Queue()
        self.started = time.monotonic()

    @property
    def finished(self) -> bool:
        return not self.unfinished

    async def start(self, http_request_id: str = "") -> None:
        """Subscribe to the outputs, then enqueue (raises 429 / 503)."""
        subs = [self.services.reader.subscribe(rid, self.queue, self.started) for rid in self.ids]
        try:
            entry_ids = await self.services.queue.enqueue(self.messages)
        except BaseException as exc:
            self._unsubscribe()
            if isinstance(exc, (RedisError, OSError)):
                raise redis_unavailable() from None
            raise
        self.entry_ids = dict(zip(self.ids, entry_ids))
        for sub, entry_id in zip(subs, entry_ids):
            sub.entry_id = entry_id
        log.info("request %s enqueued as %s", http_request_id, ",".join(self.ids))

    async def next_event(self) -> tuple[int, OutputDelta]:
        """The next (request index, delta); raises ApiError when a deadline passes or Redis fails.
        The deadlines are checked before each wait and at the TICK the output reader sends once one
        has passed."""
        while True:
            if (error := self.services.overdue(self.started)) is not None:
                raise error
            rid, item = await self.queue.get()
            if item is not TICK:
                return self._accept(rid, item)

    def ready_event(self) -> tuple[int, OutputDelta] | None:
        """The next (request index, delta) if one has arrived already, else None (never waits)."""
        while not self.queue.empty():
            rid, item = self.queue.get_nowait()
            if item is not TICK:
                return self._accept(rid, item)
        return None

    def _accept(self, rid: str, item: OutputDelta | ReaderFailed) -> tuple[int, OutputDelta]:
        if isinstance(item, RequestLost):  # left unfinished: close() cancels it on a worker that holds it
            raise ApiError(503, "the request queue (Redis) restarted and lost this request; retry it",
                           code="request_lost")  # fmt: skip
        if isinstance(item, ReaderFailed):
            self.unfinished.discard(rid)
            raise redis_unavailable()
        if item.final:
            self.unfinished.discard(rid)
        return self.index[rid], item

    async def close(self) -> None:
        """Stop reading; withdraw what has not finished. Safe to call from a cancelled task."""
        self._unsubscribe()
        if not self.unfinished:
            return
        with anyio.CancelScope(shield=True):
            for rid in sorted(self.unfinished):
                try:
                    removed = await self.services.queue.withdraw(rid, self.entry_ids[rid])
                    log.info("cancelled %s (%s)", rid, "removed from queue" if removed else "cancel published")
                except (RedisError, OSError) as exc:
                    log.warning("could not cancel %s: %s", rid, type(exc).__name__)
        self.unfinished.clear()

    def _unsubscribe(self) -> None:
        for rid in self.ids:
            self.services.reader.unsubscribe(rid)


async def until_disconnected(receive) -> None:
    """Return when the client closes the connection (the request body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive, awaitable):
    """Await `awaitable`, or raise ApiError 499 as soon as the client goes away."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(until_disconnected(receive))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
    if not work.done() or work.cancelled():
        raise ApiError(499, "client closed the request", code="client_disconnected")
    return work.result()
