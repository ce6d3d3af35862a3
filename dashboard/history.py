"""The last ten minutes of finished requests (the EVENTS stream), and the series drawn from them.

Everything is derived from EVENTS, so several dashboard processes draw the same charts and a
restarted dashboard shows the history at once. Each refresh reads only entries it has not seen.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import redis.asyncio as aioredis

from dashboard.fleet import entry_time
from worker import contract
from worker.contract import RequestEvent

SPAN_S = 600.0  # the charts' window
THROUGHPUT_BUCKET_S = 5.0
LATENCY_BUCKET_S = 30.0
PERCENTILE_WINDOW_S = 60.0
READ_BATCH = 1000


@dataclass(frozen=True)
class Finished:
    """What the charts need of one RequestEvent."""

    logged_at: float  # stream entry time (Redis clock): orders and prunes the window; charts use event times
    first_token_at: float
    finished_at: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float | None  # None when the request produced at most one token
    e2e_s: float

    @classmethod
    def from_event(cls, logged_at: float, event: RequestEvent) -> "Finished":
        return cls(
            logged_at=logged_at,
            first_token_at=event.enqueued_at + event.ttft_s,
            finished_at=event.finished_at,
            prompt_tokens=event.prompt_tokens,
            output_tokens=event.output_tokens,
            ttft_s=event.ttft_s,
            tpot_s=event.tpot_s if event.output_tokens > 1 else None,
            e2e_s=event.e2e_s,
        )


class EventWindow:
    """Finished requests of the last SPAN_S seconds, read incrementally from EVENTS."""

    def __init__(self, span_s: float = SPAN_S) -> None:
        self.span_s = span_s
        self._items: deque[Finished] = deque()
        self._last_id: str | None = None

    async def refresh(self, client: aioredis.Redis, now: float) -> None:
        start = f"({self._last_id}" if self._last_id else f"{int((now - self.span_s) * 1000)}-0"
        while True:
            entries = await client.xrange(contract.EVENTS, min=start, max="+", count=READ_BATCH)
            for entry_id, fields in entries:
                try:
                    self._items.append(Finished.from_event(entry_time(entry_id), RequestEvent.decode(fields)))
                except (KeyError, ValueError):
                    pass  # a malformed record is skipped, not fatal
            if entries:
                self._last_id = entries[-1][0]
                start = f"({self._last_id}"
            if len(entries) < READ_BATCH:
                break
        while self._items and self._items[0].logged_at < now - self.span_s:
            self._items.popleft()

    def throughput(self, now: float, bucket_s: float = THROUGHPUT_BUCKET_S) -> dict:
        """Tokens/s and requests/s per complete bucket, oldest first, ending at the last bucket edge.

        A request's output tokens are spread evenly over its decoding time (first token to
        finish); its prompt tokens count when its first token came; the request when it finished.
        """
        end = math.floor(now / bucket_s) * bucket_s
        count = int(self.span_s / bucket_s)
        start = end - count * bucket_s
        tokens = [0.0] * count
        prompt = [0.0] * count
        requests = [0.0] * count

        def index(t: float) -> int | None:
            i = math.floor((t - start) / bucket_s)
            return i if 0 <= i < count else None

        for item in self._items:
            if (i := index(item.finished_at)) is not None:
                requests[i] += 1
            if (i := index(item.first_token_at)) is not None:
                prompt[i] += item.prompt_tokens
            _spread(tokens, start, bucket_s, item.first_token_at, item.finished_at, item.output_tokens)
        scale = 1.0 / bucket_s
        return {
            "bucket_s": bucket_s,
            "end": end,
            "tokens_per_s": [round(v * scale, 3) for v in tokens],
            "prompt_tokens_per_s": [round(v * scale, 3) for v in prompt],
            "requests_per_s": [round(v * scale, 3) for v in requests],
        }

    def latency(self, now: float, window_s: float = PERCENTILE_WINDOW_S) -> dict:
        """p50/p90/p99 of TTFT, time per output token and end-to-end time over the last window_s."""
        recent = [item for item in self._items if item.finished_at >= now - window_s]
        columns = {
            "ttft_s": [item.ttft_s for item in recent],
            "tpot_s": [item.tpot_s for item in recent if item.tpot_s is not None],
            "e2e_s": [item.e2e_s for item in recent],
        }
        out: dict = {"window_s": window_s, "count": len(recent)}
        for name, values in columns.items():
            out[name] = {f"p{q}": percentile(values, q) for q in (50, 90, 99)}
        out["requests_per_s"] = round(len(recent) / window_s, 3)
        return out

    def latency_series(self, now: float, bucket_s: float = LATENCY_BUCKET_S) -> dict:
        """p50 and p99 of TTFT and time per output token per bucket of finish time (None where empty).

        The last bucket is the current one, still filling.
        """
        end = math.ceil(now / bucket_s) * bucket_s
        count = int(self.span_s / bucket_s)
        start = end - count * bucket_s
        ttft: list[list[float]] = [[] for _ in range(count)]
        tpot: list[list[float]] = [[] for _ in range(count)]
        for item in self._items:
            i = math.floor((item.finished_at - start) / bucket_s)
            if 0 <= i < count:
                ttft[i].append(item.ttft_s)
                if item.tpot_s is not None:
                    tpot[i].append(item.tpot_s)
        return {
            "bucket_s": bucket_s,
            "end": end,
            "ttft_p50": [percentile(v, 50) for v in ttft],
            "ttft_p99": [percentile(v, 99) for v in ttft],
            "tpot_p50": [percentile(v, 50) for v in tpot],
            "tpot_p99": [percentile(v, 99) for v in tpot],
        }


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)) - 1, 0)]


def _spread(buckets: list[float], start: float, bucket_s: float, t0: float, t1: float, amount: float) -> None:
    """Add `amount` to buckets in proportion to how much of [t0, t1] each covers (all of it at t1 if t1 <= t0)."""
    if amount <= 0:
        return
    count = len(buckets)
    if t1 <= t0:
        i = math.floor((t1 - start) / bucket_s)
        if 0 <= i < count:
            buckets[i] += amount
        return
    rate = amount / (t1 - t0)
    first = max(math.floor((t0 - start) / bucket_s), 0)
    last = min(math.floor((t1 - start) / bucket_s), count - 1)
    for i in range(first, last + 1):
        lo = max(t0, start + i * bucket_s)
        hi = min(t1, start + (i + 1) * bucket_s)
        if hi > lo:
            buckets[i] += rate * (hi - lo)
