"""Read the fleet's state from Redis in a few round trips: queue, workers, totals, server time.

Shared by the live page and /metrics. Only worker.contract is imported (never JAX).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from worker import contract
from worker.contract import WorkerStats

# Connection errors surface within about a second, so the page can say "Redis is down" promptly.
CONNECT_TIMEOUT_S = 1.0
COMMAND_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class QueueReading:
    waiting: int  # entries not yet delivered to any worker
    in_flight: int  # delivered to a worker, not yet acknowledged
    oldest_waiting_age_s: float | None  # age of the first undelivered entry; None when none waits


@dataclass(frozen=True)
class WorkerReading:
    name: str
    stats: WorkerStats | None  # None: in the WORKERS set but its heartbeat hash expired (gone)

    @property
    def alive(self) -> bool:
        return self.stats is not None


@dataclass(frozen=True)
class FleetReading:
    now: float  # Redis server time, seconds; every age is measured against it
    queue: QueueReading
    workers: list[WorkerReading]  # alive first, then by name
    totals: dict[str, float]  # the TOTALS hash, values as numbers

    def total(self, name: str) -> float:
        return self.totals.get(name, 0.0)

    def alive_stats(self) -> list[WorkerStats]:
        return [w.stats for w in self.workers if w.stats is not None]


class RedisClients:
    """One asyncio Redis client per event loop: a client's connections belong to the loop that made them."""

    def __init__(self, redis_url: str) -> None:
        self._redis_url = redis_url
        self._current: tuple[asyncio.AbstractEventLoop, aioredis.Redis] | None = None

    def get(self) -> aioredis.Redis:
        loop = asyncio.get_running_loop()
        if self._current is None or self._current[0] is not loop:
            client = aioredis.from_url(
                self._redis_url,
                decode_responses=True,
                socket_connect_timeout=CONNECT_TIMEOUT_S,
                socket_timeout=COMMAND_TIMEOUT_S,
                retry=Retry(NoBackoff(), 1),
            )
            self._current = (loop, client)
        return self._current[1]


UNREACHABLE = (RedisError, OSError, asyncio.TimeoutError)  # what "Redis is down" looks like


async def read_fleet(client: aioredis.Redis) -> FleetReading:
    """One consistent-enough reading of queue, workers and totals (three pipelined round trips)."""
    async with client.pipeline(transaction=False) as pipe:
        pipe.time()
        pipe.smembers(contract.WORKERS)
        pipe.hgetall(contract.TOTALS)
        (seconds, micros), names, totals = await pipe.execute()
    now = seconds + micros / 1e6
    names = sorted(names)
    async with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hgetall(contract.worker_key(name))
        hashes = await pipe.execute()
    workers = [WorkerReading(name, WorkerStats.decode(h) if h else None) for name, h in zip(names, hashes)]
    workers.sort(key=lambda w: (not w.alive, w.name))
    return FleetReading(
        now=now,
        queue=await read_queue(client, now),
        workers=workers,
        totals={k: _number(v) for k, v in totals.items()},
    )


async def read_queue(client: aioredis.Redis, now: float) -> QueueReading:
    """Waiting = undelivered entries of the group (its `lag`, else XLEN - pending); in flight = pending."""
    length = await client.xlen(contract.REQUESTS)
    try:
        groups = await client.xinfo_groups(contract.REQUESTS)
    except ResponseError:  # no stream yet
        groups = []
    group = next((g for g in groups if g.get("name") == contract.WORKERS_GROUP), None)
    if group is None:
        return QueueReading(waiting=length, in_flight=0, oldest_waiting_age_s=await _oldest_age(client, "-", now))
    in_flight = int(group.get("pending") or 0)
    lag = group.get("lag")  # Redis >= 7; None when XDEL makes it unknowable
    waiting = int(lag) if lag is not None else max(length - in_flight, 0)
    oldest = await _oldest_age(client, "(" + group["last-delivered-id"], now) if waiting else None
    return QueueReading(waiting=waiting, in_flight=in_flight, oldest_waiting_age_s=oldest)


async def _oldest_age(client: aioredis.Redis, start: str, now: float) -> float | None:
    entries = await client.xrange(contract.REQUESTS, min=start, max="+", count=1)
    if not entries:
        return None
    return max(now - entry_time(entries[0][0]), 0.0)


def entry_time(entry_id: str) -> float:
    """Seconds since the epoch at which Redis created a stream entry (its id's millisecond part)."""
    return int(entry_id.split("-", 1)[0]) / 1000.0


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return 0.0
