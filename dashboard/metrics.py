"""GET /metrics: Prometheus text built per scrape from Redis (vLLM-style names, prefix `redjax:`).

Each scrape reads the fleet once and hands the reading to a fresh collector in a fresh registry;
nothing global is registered or mutated. When Redis is unreachable the scrape still answers,
with `redjax:redis_up 0` and nothing else, so Prometheus records the outage instead of a failure.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from dashboard.auth import Gate, unauthorized
from dashboard.config import DashboardConfig
from dashboard.fleet import UNREACHABLE, FleetReading, RedisClients, read_fleet
from worker import contract
from worker.contract import WorkerState

P = "redjax:"

# TOTALS histogram name -> (metric name, help)
HISTOGRAMS = {
    "ttft_s": ("time_to_first_token_seconds", "Time from enqueue to the first output token."),
    "tpot_s": ("time_per_output_token_seconds", "Mean time per output token after the first, per request."),
    "e2e_s": ("e2e_request_latency_seconds", "Time from enqueue to the request's end."),
    "queue_s": ("request_queue_time_seconds", "Time from enqueue to the request's first scheduling."),
}

# TOTALS counter field -> (metric name without _total, help)
COUNTERS = {
    contract.TOTAL_PROMPT_TOKENS: ("prompt_tokens", "Prompt tokens processed."),
    contract.TOTAL_CACHED_PROMPT_TOKENS: ("prompt_tokens_cached", "Prompt tokens served from the prefix cache (not computed)."),
    contract.TOTAL_GENERATION_TOKENS: ("generation_tokens", "Output tokens generated."),
    contract.TOTAL_PREEMPTIONS: ("num_preemptions", "Sequences preempted (their KV pages freed, recomputed later)."),
    contract.TOTAL_STEP_COMPILES: ("step_compiles", "Step variants workers compiled while serving, after their warm-up "
                                   "(each takes a core for 0.1 s to minutes)."),
    contract.TOTAL_COMPILE_STALL_S: ("step_compile_stall_seconds", "Seconds workers' engine threads waited for those "
                                     "compiles (their running streams with them)."),
    contract.TOTAL_REJECTED: ("requests_rejected", "Requests refused with HTTP 429 by the API."),
    contract.TOTAL_ENQUEUED: ("requests_enqueued", "Requests put on the queue by the API."),
}


class FleetCollector:
    """Turns one FleetReading into metric families (a prometheus_client custom collector)."""

    def __init__(self, reading: FleetReading | None) -> None:
        self._reading = reading  # None: Redis was unreachable

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(P + "redis_up", "1 when the exporter could read Redis, else 0.")
        up.add_metric([], 0.0 if self._reading is None else 1.0)
        yield up
        if self._reading is None:
            return
        yield from self._queue(self._reading)
        yield from self._workers(self._reading)
        yield from self._counters(self._reading)
        yield from self._histograms(self._reading)

    def _queue(self, r: FleetReading) -> Iterator[Metric]:
        gauges = {
            "queue_requests_waiting": ("Requests on the queue not yet delivered to a worker.", r.queue.waiting),
            "queue_requests_in_flight": ("Requests delivered to a worker and not yet finished.", r.queue.in_flight),
            "queue_oldest_waiting_age_seconds": (
                "Age of the oldest undelivered request (0 when none waits).",
                r.queue.oldest_waiting_age_s or 0.0,
            ),
        }
        for name, (help_text, value) in gauges.items():
            yield GaugeMetricFamily(P + name, help_text, value=value)

    def _workers(self, r: FleetReading) -> Iterator[Metric]:
        labels = ["worker", "model_name"]
        up = GaugeMetricFamily(P + "worker_up", "1 while a known worker's heartbeat is fresh, 0 once it expired.", labels=["worker"])
        alive = GaugeMetricFamily(P + "workers_alive", "Workers with a fresh heartbeat.", value=len(r.alive_stats()))
        serving = GaugeMetricFamily(P + "workers_serving", "Workers with a fresh heartbeat that take requests (not "
                                    "starting: loading the model or compiling; not draining).",
                                    value=sum(s.state == WorkerState.SERVING.value for s in r.alive_stats()))
        running = GaugeMetricFamily(P + "num_requests_running", "Sequences in a worker's running batch.", labels=labels)
        waiting = GaugeMetricFamily(P + "num_requests_waiting", "Sequences admitted by a worker, not yet running.", labels=labels)
        kv = GaugeMetricFamily(P + "kv_cache_usage_perc", "KV-cache pages in use, as a fraction (1 = full).", labels=labels)
        pages = GaugeMetricFamily(P + "kv_cache_pages_total", "KV-cache pages of a worker.", labels=labels)
        tps = GaugeMetricFamily(P + "generation_tokens_per_second", "A worker's recent output token rate.", labels=labels)
        age = GaugeMetricFamily(P + "worker_heartbeat_age_seconds", "Seconds since a live worker's last heartbeat.", labels=labels)
        hits = GaugeMetricFamily(P + "prefix_cache_hit_rate", "Share of a worker's recently admitted prompt tokens the "
                                 "prefix cache served.", labels=labels)
        drafts = GaugeMetricFamily(P + "spec_decode_draft_acceptance_rate", "Share of a worker's recently checked "
                                   "draft tokens (--speculative-tokens) that stood.", labels=labels)
        pending = GaugeMetricFamily(P + "step_compiles_pending", "Step variants a worker is compiling in the background "
                                    "or has queued to compile while idle (variants warm-up left out).", labels=labels)
        gate = GaugeMetricFamily(P + "spec_decode_drafts_chosen", "1 where a worker's batches of min_batch_size up to "
                                 "twice that take drafts, having measured them faster than fused steps; 0 where fused "
                                 "steps won.", labels=[*labels, "min_batch_size"])
        for w in r.workers:
            up.add_metric([w.name], 1.0 if w.alive else 0.0)
            if w.stats is None:
                continue
            s, values = w.stats, [w.name, w.stats.model]
            running.add_metric(values, s.running)
            waiting.add_metric(values, s.waiting)
            kv.add_metric(values, s.pages_used / s.pages_total if s.pages_total else 0.0)
            pages.add_metric(values, s.pages_total)
            tps.add_metric(values, s.tokens_per_s)
            age.add_metric(values, max(r.now - s.updated_at, 0.0))
            hits.add_metric(values, s.prefix_cache_hit_rate)
            drafts.add_metric(values, s.draft_acceptance_rate)
            pending.add_metric(values, s.compiles_pending)
            for choice in s.draft_gate.split():
                size, kind = choice.split(":")
                gate.add_metric([*values, size], 1.0 if kind == "drafts" else 0.0)
        yield from (up, alive, serving, running, waiting, kv, pages, tps, age, hits, drafts, pending, gate)

    def _counters(self, r: FleetReading) -> Iterator[Metric]:
        for field, (name, help_text) in COUNTERS.items():
            yield CounterMetricFamily(P + name, help_text, value=r.total(field))
        success = CounterMetricFamily(P + "request_success", "Finished requests, by finish reason.", labels=["finished_reason"])
        reasons = {reason.value for reason in contract.FinishReason}
        reasons |= {k.split(":", 1)[1] for k in r.totals if k.startswith("finished:")}
        for reason in sorted(reasons):
            success.add_metric([reason], r.total(f"finished:{reason}"))
        yield success

    def _histograms(self, r: FleetReading) -> Iterator[Metric]:
        for source, (name, help_text) in HISTOGRAMS.items():
            buckets, below = [], 0.0  # cumulative, from the per-bucket counts workers keep
            for bound in contract.LATENCY_BUCKETS_S:
                below += r.total(contract.bucket_field(source, bound))
                buckets.append((contract.bound_label(bound), below))
            yield HistogramMetricFamily(P + name, help_text, buckets=buckets, sum_value=r.total(f"{source}:sum"))


def render(reading: FleetReading | None) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(reading))
    return generate_latest(registry)


class MetricsEndpoint:
    """The /metrics handler: auth (Bearer key or dashboard cookie), one Redis reading, the text."""

    def __init__(self, config: DashboardConfig, clients: RedisClients | None = None) -> None:
        self._gate = Gate(config.api_key)
        self._clients = clients or RedisClients(config.redis_url)

    async def __call__(self, request: Request) -> Response:
        if not self._gate.allows(request):
            return unauthorized()
        try:
            reading = await read_fleet(self._clients.get())
        except UNREACHABLE:
            reading = None
        return Response(render(reading), media_type=CONTENT_TYPE_LATEST, headers={"Cache-Control": "no-store"})


def metrics_route(config: DashboardConfig, clients: RedisClients | None = None) -> Route:
    """`Route("/metrics")` for any Starlette app (the API adds it so `redjax serve` has top-level /metrics)."""
    endpoint = MetricsEndpoint(config, clients)

    async def metrics(request: Request) -> Response:
        return await endpoint(request)

    return Route("/metrics", metrics, methods=["GET"], name="metrics")
