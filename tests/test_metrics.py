"""GET /metrics: Prometheus text from Redis, parsed with prometheus_client's own parser."""

from __future__ import annotations

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from dashboard import DashboardConfig, create_dashboard
from tests.conftest import free_port
from tests.test_dashboard_live import make_event, seed_events, seed_gone_worker, seed_queue, seed_worker
from worker import contract


def scrape(redis_url: str) -> dict:
    """name -> {sample name + sorted labels: value}."""
    with TestClient(create_dashboard(DashboardConfig(redis_url=redis_url))) as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {}
    for family in text_string_to_metric_families(response.text):
        families[family.name] = {
            (s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples
        }
        families[family.name]["type"] = family.type
    return families


def value(families: dict, name: str, sample: str | None = None, **labels) -> float:
    return families[name][(sample or name, tuple(sorted(labels.items())))]


def test_metrics_report_fleet_state(redis_client, redis_url):
    seed_worker(redis_client, "gpu-0", running=5, waiting=2, pages_used=400, pages_total=1000, prefix_cache_hit_rate=0.625,
                draft_acceptance_rate=0.375, draft_gate="1:drafts 8:fused", compiles_pending=6)
    seed_gone_worker(redis_client, "gpu-9")
    seed_worker(redis_client, "gpu-1", state=contract.WorkerState.STARTING.value)  # loading or compiling
    seed_queue(redis_client, total=4, delivered=1)
    redis_client.hincrby(contract.TOTALS, contract.TOTAL_REJECTED, 2)
    redis_client.hincrby(contract.TOTALS, contract.TOTAL_STEP_COMPILES, 3)  # as workers' heartbeats add them
    redis_client.hincrbyfloat(contract.TOTALS, contract.TOTAL_COMPILE_STALL_S, 1.25)
    seed_events(redis_client, [
        make_event("a", ttft_s=0.03, output_tokens=10, prompt_tokens=7),
        make_event("b", ttft_s=0.3, output_tokens=1, prompt_tokens=5, finish_reason="length"),
    ])

    m = scrape(redis_url)
    assert value(m, "redjax:redis_up") == 1
    assert value(m, "redjax:num_requests_running", worker="gpu-0", model_name="tiny-llama") == 5
    assert value(m, "redjax:num_requests_waiting", worker="gpu-0", model_name="tiny-llama") == 2
    assert value(m, "redjax:kv_cache_usage_perc", worker="gpu-0", model_name="tiny-llama") == pytest.approx(0.4)
    assert value(m, "redjax:prefix_cache_hit_rate", worker="gpu-0", model_name="tiny-llama") == 0.625
    assert value(m, "redjax:spec_decode_draft_acceptance_rate", worker="gpu-0", model_name="tiny-llama") == 0.375
    chosen = {size: value(m, "redjax:spec_decode_drafts_chosen", worker="gpu-0", model_name="tiny-llama",
                          min_batch_size=size) for size in ("1", "8")}
    assert chosen == {"1": 1.0, "8": 0.0}
    assert value(m, "redjax:step_compiles_pending", worker="gpu-0", model_name="tiny-llama") == 6
    assert value(m, "redjax:worker_up", worker="gpu-0") == 1
    assert value(m, "redjax:worker_up", worker="gpu-9") == 0
    assert value(m, "redjax:workers_alive") == 2
    assert value(m, "redjax:workers_serving") == 1  # the starting one takes no requests yet
    assert value(m, "redjax:queue_requests_waiting") == 3
    assert value(m, "redjax:queue_requests_in_flight") == 1
    assert value(m, "redjax:queue_oldest_waiting_age_seconds") >= 0

    assert m["redjax:prompt_tokens"]["type"] == "counter"
    assert value(m, "redjax:prompt_tokens", "redjax:prompt_tokens_total") == 12
    assert value(m, "redjax:generation_tokens", "redjax:generation_tokens_total") == 11
    assert value(m, "redjax:requests_rejected", "redjax:requests_rejected_total") == 2
    assert value(m, "redjax:num_preemptions", "redjax:num_preemptions_total") == 0
    assert value(m, "redjax:step_compiles", "redjax:step_compiles_total") == 3
    stall = "redjax:step_compile_stall_seconds"
    assert m[stall]["type"] == "counter" and value(m, stall, stall + "_total") == 1.25
    success = "redjax:request_success_total"
    assert value(m, "redjax:request_success", success, finished_reason="stop") == 1
    assert value(m, "redjax:request_success", success, finished_reason="length") == 1
    assert value(m, "redjax:request_success", success, finished_reason="abort") == 0

    ttft = "redjax:time_to_first_token_seconds"
    assert m[ttft]["type"] == "histogram"
    assert value(m, ttft, ttft + "_bucket", le="0.025") == 0
    assert value(m, ttft, ttft + "_bucket", le="0.05") == 1
    assert value(m, ttft, ttft + "_bucket", le="0.5") == 2
    assert value(m, ttft, ttft + "_bucket", le="+Inf") == 2
    assert value(m, ttft, ttft + "_count") == 2
    assert value(m, ttft, ttft + "_sum") == pytest.approx(0.33)
    tpot = "redjax:time_per_output_token_seconds"
    assert value(m, tpot, tpot + "_count") == 1  # a one-token request has no time per output token
    assert value(m, "redjax:e2e_request_latency_seconds", "redjax:e2e_request_latency_seconds_count") == 2


def test_counters_move_when_requests_finish(redis_client, redis_url):
    seed_events(redis_client, [make_event("a", output_tokens=20)])
    before = scrape(redis_url)
    seed_events(redis_client, [make_event("b", output_tokens=30), make_event("c", output_tokens=5, finish_reason="abort")])
    after = scrape(redis_url)
    gen = ("redjax:generation_tokens", "redjax:generation_tokens_total")
    assert value(after, *gen) - value(before, *gen) == 35
    success = ("redjax:request_success", "redjax:request_success_total")
    assert value(after, *success, finished_reason="stop") == value(before, *success, finished_reason="stop") + 1
    assert value(after, *success, finished_reason="abort") == 1
    e2e = "redjax:e2e_request_latency_seconds"
    assert value(after, e2e, e2e + "_count") == value(before, e2e, e2e + "_count") + 2


def test_redis_down_is_reported_not_raised():
    m = scrape(f"redis://127.0.0.1:{free_port()}/0")
    assert value(m, "redjax:redis_up") == 0
    assert set(m) == {"redjax:redis_up"}


def test_scrapes_leave_the_global_registry_alone(redis_client, redis_url):
    before = set(prometheus_client.REGISTRY._names_to_collectors)
    scrape(redis_url)
    scrape(redis_url)
    assert set(prometheus_client.REGISTRY._names_to_collectors) == before


def test_counters_summed_over_a_batch_equal_one_increment_per_request(redis_client):
    """A worker writes the counters of a batch of finished requests as one increment per field;
    TOTALS must end up exactly as with every request's increments written one by one."""
    events = [make_event(f"r{i}", ttft_s=0.01 * (i % 7) + 0.002, tpot_s=0.003 * i, output_tokens=1 + i % 3,
                         finish_reason="stop" if i % 4 else "length") for i in range(40)]
    pipe = redis_client.pipeline()
    for event in events:
        contract.record_finished(pipe, event)
    pipe.execute()
    one_by_one = redis_client.hgetall(contract.TOTALS)
    redis_client.delete(contract.TOTALS)

    totals = contract.TotalsDelta()
    pipe = redis_client.pipeline()
    for event in events:
        contract.record_finished(pipe, event, totals)
    totals.write(pipe)
    commands = len(pipe.command_stack)
    pipe.execute()
    batched = redis_client.hgetall(contract.TOTALS)

    assert batched.keys() == one_by_one.keys()
    for field in one_by_one:
        assert float(batched[field]) == pytest.approx(float(one_by_one[field])), field
    assert commands < 40 + 40  # the events, then far fewer than 14 counter increments per request
