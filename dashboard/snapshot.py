"""The page's data: one JSON-ready snapshot of the fleet, shared by every browser of one app.

A snapshot is rebuilt at most once per half refresh interval however many browsers watch, so
the load on Redis does not grow with the audience. When Redis cannot be reached the snapshot
says so (`ok: false`) instead of raising; the next one recovers on its own.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from dashboard.config import DashboardConfig
from dashboard.fleet import UNREACHABLE, FleetReading, RedisClients, WorkerReading, read_fleet
from dashboard.history import EventWindow
from worker import contract
from worker.contract import RequestEvent

RECENT_REQUESTS = 15


class SnapshotSource:
    def __init__(self, config: DashboardConfig, clients: RedisClients) -> None:
        self._config = config
        self._clients = clients
        self._window = EventWindow()
        self._lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._cached: tuple[float, dict[str, Any]] | None = None

    async def snapshot(self) -> dict[str, Any]:
        async with self._loop_lock():
            fresh_for = self._config.refresh_s / 2
            if self._cached is None or time.monotonic() - self._cached[0] >= fresh_for:
                self._cached = (time.monotonic(), await self._build())
            return self._cached[1]

    def _loop_lock(self) -> asyncio.Lock:
        """One lock per event loop (an asyncio.Lock must not be shared between loops)."""
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock[0] is not loop:
            self._lock = (loop, asyncio.Lock())
        return self._lock[1]

    async def _build(self) -> dict[str, Any]:
        client = self._clients.get()
        try:
            reading = await read_fleet(client)
            await self._window.refresh(client, reading.now)
            recent = await client.xrevrange(contract.EVENTS, max="+", min="-", count=RECENT_REQUESTS)
            latency = self._window.latency(reading.now)
        except UNREACHABLE as exc:
            return {
                "ok": False,
                "time": time.time(),
                "redis": self._config.redis_display,
                "error": f"Redis unreachable at {self._config.redis_display} ({type(exc).__name__})",
            }
        return {
            "ok": True,
            "time": reading.now,
            "redis": self._config.redis_display,
            "queue": _queue(reading),
            "fleet": _fleet(reading, latency["requests_per_s"]),
            "workers": [_worker(w, reading.now) for w in reading.workers],
            "throughput": self._window.throughput(reading.now),
            "latency": latency,
            "latency_series": self._window.latency_series(reading.now),
            "recent": [_recent(fields) for _, fields in recent if "id" in fields],
        }


def _queue(reading: FleetReading) -> dict[str, Any]:
    return {
        "waiting": reading.queue.waiting,
        "in_flight": reading.queue.in_flight,
        "oldest_waiting_age_s": reading.queue.oldest_waiting_age_s,
        "rejected": int(reading.total(contract.TOTAL_REJECTED)),
        "enqueued": int(reading.total(contract.TOTAL_ENQUEUED)),
    }


def _fleet(reading: FleetReading, requests_per_s: float) -> dict[str, Any]:
    alive = reading.alive_stats()
    pages_total = sum(s.pages_total for s in alive)
    prompt = reading.total(contract.TOTAL_PROMPT_TOKENS)
    return {
        "workers_alive": len(alive),
        "workers_gone": len(reading.workers) - len(alive),
        "workers_starting": sum(s.state == contract.WorkerState.STARTING.value for s in alive),  # loading, compiling
        "tokens_per_s": round(sum(s.tokens_per_s for s in alive), 3),
        "prompt_tokens_per_s": round(sum(s.prompt_tokens_per_s for s in alive), 3),
        "requests_per_s": requests_per_s,
        "running": sum(s.running for s in alive),
        "kv_usage": sum(s.pages_used for s in alive) / pages_total if pages_total else None,
        # share of all prompt tokens so far that the prefix cache served instead of computing
        "prefix_cache_hit_rate": reading.total(contract.TOTAL_CACHED_PROMPT_TOKENS) / prompt if prompt else None,
    }


def _worker(worker: WorkerReading, now: float) -> dict[str, Any]:
    s = worker.stats
    if s is None:
        return {"name": worker.name, "alive": False}
    return {
        "name": s.name or worker.name,
        "alive": True,
        "state": s.state,
        "model": s.model,
        "pages_used": s.pages_used,
        "pages_total": s.pages_total,
        "kv_usage": s.pages_used / s.pages_total if s.pages_total else None,
        "running": s.running,
        "waiting": s.waiting,
        "max_num_seqs": s.max_num_seqs,
        "tokens_per_s": round(s.tokens_per_s, 3),
        "prompt_tokens_per_s": round(s.prompt_tokens_per_s, 3),
        "mean_batch_size": round(s.mean_batch_size, 3),
        "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
        "preemptions": s.preemptions,
        "step_compiles": s.step_compiles,  # since its warm-up: a recompile under load
        "compile_stall_s": s.compile_stall_s,
        "compiles_pending": s.compiles_pending,  # compiling in the background, or queued to while idle
        "requests_finished": s.requests_finished,
        "heartbeat_age_s": max(now - s.updated_at, 0.0),
        "uptime_s": max(now - s.started_at, 0.0),
    }


def _recent(fields: dict[str, str]) -> dict[str, Any]:
    """One finished request for the table: counts and times only, never text."""
    try:
        event = RequestEvent.decode(fields)
    except (KeyError, ValueError):
        return {"id": fields.get("id", "?"), "finish_reason": "malformed"}
    return {
        "id": event.id,
        "worker": event.worker,
        "model": event.model,
        "finish_reason": event.finish_reason,
        "prompt_tokens": event.prompt_tokens,
        "output_tokens": event.output_tokens,
        "ttft_s": event.ttft_s,
        "tpot_s": event.tpot_s if event.output_tokens > 1 else None,
        "e2e_s": event.e2e_s,
        "finished_at": event.finished_at,
    }
