"""FleetWatch: one background task that knows since when no live worker serves our model, and
keeps this API's alive key (contract.api_alive_key) while the process runs."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from api.queue import live_workers
from worker.contract import API_ALIVE_TTL_S, HEARTBEAT_INTERVAL_S

log = logging.getLogger("redjax.api")

DATA_LOSS_WAIT_S = 3.0  # after Redis lost its data, how long workers get to write output again


class FleetWatch:
    def __init__(self, client: Redis, model: str, interval_s: float = HEARTBEAT_INTERVAL_S,
                 alive_key: str | None = None, announce: Callable[[], bool] = lambda: True,
                 on_data_loss: Callable[[], Awaitable[None]] | None = None) -> None:  # fmt: skip
        self.client = client
        self.model = model
        # set again at each poll once announce() holds (requests were enqueued): SET, not EXPIRE, so a
        # Redis that restarted empty has it again within a poll, before workers take its absence
        # for this process's death and drop the requests they run for it
        self.alive_key = alive_key
        self.announce = announce
        # awaited DATA_LOSS_WAIT_S after the key was found missing (Redis lost its data), in a task
        self.on_data_loss = on_data_loss
        self._tasks: set[asyncio.Task] = set()
        self.interval_s = interval_s
        self.dead_since: float | None = None  # time.monotonic() when workers were first seen missing
        self.workers: dict[str, str] = {}  # live worker name -> state; a starting one counts: requests wait for it

    def missing_for(self, since: float) -> float:
        """Seconds without a live worker, counted from `since` (a time.monotonic() value) at the earliest."""
        if self.dead_since is None:
            return 0.0
        return time.monotonic() - max(self.dead_since, since)

    async def poll(self) -> None:
        if self.alive_key is not None and self.announce():  # an API that never enqueued writes nothing
            had = await self.client.set(self.alive_key, 1, ex=API_ALIVE_TTL_S, get=True)
            if had is None and self.on_data_loss is not None:  # the enqueue script had set it
                log.warning("Redis lost this API's alive key: it restarted without its data")
                task = asyncio.create_task(self._after_data_loss())
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        self.workers = await live_workers(self.client, self.model)
        if self.workers:
            self.dead_since = None
        elif self.dead_since is None:
            self.dead_since = time.monotonic()
            log.warning("no live worker serves %s", self.model)

    async def _after_data_loss(self) -> None:
        """Give workers DATA_LOSS_WAIT_S to reconnect and write their running requests' output."""
        await asyncio.sleep(DATA_LOSS_WAIT_S)
        try:
            await self.on_data_loss()
        except (RedisError, OSError) as exc:
            log.warning("fleet watch: redis error %s after a data loss", type(exc).__name__)

    async def run(self) -> None:
        """Poll until cancelled; Redis errors leave the last known state (requests see them directly)."""
        try:
            while True:
                try:
                    await self.poll()
                except (RedisError, OSError) as exc:
                    log.debug("fleet watch: redis error %s", type(exc).__name__)
                await asyncio.sleep(self.interval_s)
        finally:
            for task in self._tasks:
                task.cancel()
