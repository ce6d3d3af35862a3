"""The dashboard's data against a real Redis: queue, workers, latency, recent requests, SSE, mounting."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient
from tests.conftest import free_port, redis_server
from tests.test_dashboard_live import (
    make_event,
    seed_events,
    seed_gone_worker,
    seed_queue,
    seed_worker,
    serve_app,
)

from dashboard import DashboardConfig, create_dashboard, metrics_route
from dashboard.history import percentile
from worker import contract


def snapshot_of(app) -> dict:
    with TestClient(app) as client:
        response = client.get("/api/snapshot")
    assert response.status_code == 200
    return response.json()


def test_snapshot_reports_queue_workers_latency_and_recent(redis_client, redis_url):
    seed_worker(redis_client, "gpu-0", pages_used=250, pages_total=1000, running=7, waiting=3, tokens_per_s=900.0,
                prefix_cache_hit_rate=0.5, step_compiles=2, compile_stall_s=1.5)
    seed_worker(redis_client, "gpu-1", pages_used=750, pages_total=1000, running=1, waiting=0, tokens_per_s=100.0,
                state=contract.WorkerState.STARTING.value)
    seed_gone_worker(redis_client, "gpu-old")
    seed_queue(redis_client, total=5, delivered=2, first_age_s=30.0)
    redis_client.hincrby(contract.TOTALS, contract.TOTAL_REJECTED, 4)
    ttfts = [0.1 * (i + 1) for i in range(10)]  # 0.1 .. 1.0
    seed_events(redis_client, [make_event(f"r{i}", ttft_s=t, tpot_s=0.02, output_tokens=10) for i, t in enumerate(ttfts)])
    redis_client.hset(contract.TOTALS, mapping={contract.TOTAL_PROMPT_TOKENS: 400, contract.TOTAL_CACHED_PROMPT_TOKENS: 100})

    snap = snapshot_of(create_dashboard(DashboardConfig(redis_url=redis_url)))

    assert snap["ok"] is True
    queue = snap["queue"]
    assert (queue["waiting"], queue["in_flight"], queue["rejected"], queue["enqueued"]) == (3, 2, 4, 5)
    # The first undelivered entry is the third one, enqueued 30 s ago (+2 ms).
    assert 29.0 < queue["oldest_waiting_age_s"] < 40.0

    workers = {w["name"]: w for w in snap["workers"]}
    assert [w["name"] for w in snap["workers"]] == ["gpu-0", "gpu-1", "gpu-old"]  # alive first
    assert workers["gpu-old"] == {"name": "gpu-old", "alive": False}
    gpu0 = workers["gpu-0"]
    assert gpu0["alive"] and gpu0["model"] == "tiny-llama" and gpu0["state"] == "serving"
    assert (gpu0["pages_used"], gpu0["pages_total"], gpu0["kv_usage"]) == (250, 1000, 0.25)
    assert (gpu0["running"], gpu0["waiting"], gpu0["preemptions"]) == (7, 3, 3)
    assert (gpu0["step_compiles"], gpu0["compile_stall_s"]) == (2, 1.5)
    assert gpu0["prefix_cache_hit_rate"] == 0.5
    assert 0.0 <= gpu0["heartbeat_age_s"] < 5.0

    fleet = snap["fleet"]
    assert (fleet["workers_alive"], fleet["workers_gone"], fleet["tokens_per_s"]) == (2, 1, 1000.0)
    assert fleet["workers_starting"] == 1 and workers["gpu-1"]["state"] == "starting"
    assert fleet["kv_usage"] == pytest.approx(0.5)
    assert fleet["prefix_cache_hit_rate"] == pytest.approx(0.25)

    latency = snap["latency"]
    assert latency["count"] == 10
    assert latency["ttft_s"]["p50"] == pytest.approx(0.5)
    assert latency["ttft_s"]["p90"] == pytest.approx(0.9)
    assert latency["ttft_s"]["p99"] == pytest.approx(1.0)
    assert latency["tpot_s"]["p50"] == pytest.approx(0.02)

    recent = snap["recent"]
    assert [r["id"] for r in recent[:3]] == ["r9", "r8", "r7"]  # newest first
    assert set(recent[0]) == {"id", "worker", "model", "finish_reason", "prompt_tokens", "output_tokens",
                              "ttft_s", "tpot_s", "e2e_s", "finished_at"}  # counts and times, never text


def test_throughput_spreads_output_tokens_over_decode_time(redis_client, redis_url):
    now = time.time()
    # 100 tokens decoded over the 20 s before `now - 30`: 5 tokens/s across those buckets.
    event = make_event("long", ttft_s=0.5, tpot_s=20.0 / 99, output_tokens=100, finished_at=now - 30)
    seed_events(redis_client, [event])
    series = snapshot_of(create_dashboard(DashboardConfig(redis_url=redis_url)))["throughput"]
    tokens = series["tokens_per_s"]
    assert len(tokens) == 600 / series["bucket_s"]
    assert sum(tokens) * series["bucket_s"] == pytest.approx(100, rel=1e-3)
    assert max(tokens) == pytest.approx(5.0, rel=0.05)
    assert sum(series["requests_per_s"]) * series["bucket_s"] == pytest.approx(1)
    assert sum(series["prompt_tokens_per_s"]) * series["bucket_s"] == pytest.approx(100)


def test_waiting_counts_undelivered_entries_only(redis_client, redis_url):
    def queue_now() -> dict:  # a fresh app each time: one app reuses a snapshot for half a refresh interval
        return snapshot_of(create_dashboard(DashboardConfig(redis_url=redis_url)))["queue"]

    assert queue_now() == {"waiting": 0, "in_flight": 0, "oldest_waiting_age_s": None,
                                         "rejected": 0, "enqueued": 0}
    ids = seed_queue(redis_client, total=3, delivered=3)
    queue = queue_now()
    assert (queue["waiting"], queue["in_flight"], queue["oldest_waiting_age_s"]) == (0, 3, None)
    redis_client.xack(contract.REQUESTS, contract.WORKERS_GROUP, ids[0])
    redis_client.xdel(contract.REQUESTS, ids[0])
    assert queue_now()["in_flight"] == 2


def test_percentile_is_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2
    assert percentile(list(range(1, 101)), 99) == 99


def test_redis_down_banner_then_recovery(redis_url):
    port = free_port()
    app = create_dashboard(DashboardConfig(redis_url=f"redis://:hunter2@127.0.0.1:{port}/0"))
    with TestClient(app) as client:
        down = client.get("/api/snapshot").json()
        assert down["ok"] is False and "Redis unreachable" in down["error"]
        assert "hunter2" not in json.dumps(down)  # credentials are never shown
        page = client.get("/")
        assert page.status_code == 200
        assert '<div id="banner" class="banner" role="alert" >Redis unreachable' in page.text
        assert "Traceback" not in page.text and "hunter2" not in page.text
        with redis_server(port, password="hunter2"):
            time.sleep(0.6)  # past the snapshot cache
            assert client.get("/api/snapshot").json()["ok"] is True
            assert 'role="alert" hidden' in client.get("/").text


def test_mounted_under_a_prefix_uses_its_own_urls(redis_client, redis_url):
    config = DashboardConfig(redis_url=redis_url)
    api = Starlette(routes=[Mount("/dashboard", create_dashboard(config)), metrics_route(config)])
    with TestClient(api) as client:
        page = client.get("/dashboard/")
        assert page.status_code == 200
        for path in ("/dashboard/static/dashboard.js", "/dashboard/static/charts.js", "/dashboard/static/dashboard.css"):
            assert f'"{path}"' in page.text
            assert client.get(path).status_code == 200
        assert 'data-base="/dashboard"' in page.text
        assert "http://" not in page.text.split("<body", 1)[1].split("initial-snapshot")[0]  # no absolute or CDN URLs
        assert client.get("/dashboard", follow_redirects=False).headers["location"].endswith("/dashboard/")
        assert client.get("/dashboard/api/snapshot").json()["ok"] is True
        assert client.get("/metrics").status_code == 200
        assert client.get("/dashboard/metrics").status_code == 200


def test_page_loads_nothing_from_elsewhere(redis_client, redis_url):
    with TestClient(create_dashboard(DashboardConfig(redis_url=redis_url))) as client:
        page = client.get("/")
        links = re.findall(r'(?:src|href|action)="([^"]*)"', page.text)
        assert links and all(link.startswith("/") and not link.startswith("//") for link in links), links
        for link in links:
            if link.startswith("/static/"):
                body = client.get(link).text
                assert not re.search(r"(?:url\(|import |fetch\(|src=)['\"]?(?:https?:)?//", body), link
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp


def test_sse_pushes_a_snapshot_every_interval(redis_client, redis_url):
    seed_worker(redis_client, "gpu-0")
    app = create_dashboard(DashboardConfig(redis_url=redis_url, refresh_s=0.5))
    snapshots = []
    with serve_app(app) as base, httpx.Client(timeout=10) as http:
        with http.stream("GET", base + "/api/stream") as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            event = None
            for line in response.iter_lines():
                if line.startswith("event:"):
                    event = line.split(":", 1)[1].strip()
                elif line.startswith("data:") and event == "snapshot":
                    snapshots.append(json.loads(line.split(":", 1)[1]))
                    if len(snapshots) == 3:
                        break
    assert [s["workers"][0]["name"] for s in snapshots] == ["gpu-0"] * 3
    assert snapshots[0]["time"] < snapshots[1]["time"] < snapshots[2]["time"]  # fresh reads, not replays


def test_importing_the_dashboard_never_imports_jax():
    import subprocess
    import sys

    code = "import sys, dashboard, dashboard.app, dashboard.metrics; print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'numpy')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
