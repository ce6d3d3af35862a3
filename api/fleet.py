"""FleetWatch: one background task that knows since when no live worker serves our model, and
keeps this API's alive key (contract.api_alive_key) from expiring while the process runs."""

from __future__ import annotations

import asyncio
import logging
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from api.queue import live_workers
from worker.contract import API_ALIVE_TTL_S, HEARTBEAT_INTERVAL_S

log = logging.getLogger("redjax.api")


class FleetWatch:
    def __init__(self, client: Redis, model: str, interval_s: float = HEARTBEAT_INTERVAL_S,
                 alive_key: str | None = None) -> None:
        self.client = client
        self.model = model
        self.alive_key = alive_key  # refreshed at each poll while it exists (requests were enqueued)
        self.interval_s = interval_s
        self.dead_since: float | None = None  # time.monotonic() when workers were first seen missing
        self.workers: dict[str, str] = {}  # live worker name -> state; a starting one counts: requests wait for it

    def missing_for(self, since: float) -> float:
        """Seconds without a live worker, counted from `since` (a time.monotonic() value) at the earliest."""
        if self.dead_since is None:
            return 0.0
        return time.monotonic() - max(self.dead_since, since)

    async def poll(self) -> None:
        if self.alive_key is not None:  # only once the enqueue script made it: an idle API writes nothing
            await self.client.expire(self.alive_key, API_ALIVE_TTL_S)
        self.workers = await live_workers(self.client, self.model)
        if self.workers:
            self.dead_since = None
        elif self.dead_since is None:
            self.dead_since = time.monotonic()
            log.warning("no live worker serves %s", self.model)

    async def run(self) -> None:
        """Poll until cancelled; Redis errors leave the last known state (requests see them directly)."""
        while True:
            try:
                await self.poll()
            except (RedisError, OSError) as exc:
                log.debug("fleet watch: redis error %s", type(exc).__name__)
            await asyncio.sleep(self.interval_s)
