"""The dashboard in a real headless Chromium, fed by simulated traffic, plus helpers other tests reuse.

Reusable from other test modules:
    from tests.test_dashboard_live import assert_dashboard_live, serve_app, SimulatedTraffic, seed_*
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
import uvicorn

from dashboard import DashboardConfig, create_dashboard
from tests.conftest import free_port, redis_server
from worker import contract
from worker.contract import RequestEvent, RequestMessage, WorkerStats

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


# ---------------------------------------------------------------- seeding Redis through the contract


def seed_worker(client: redis.Redis, name: str, **overrides) -> WorkerStats:
    """Write a fresh heartbeat hash (with the contract's TTL) and register the worker."""
    now = time.time()
    values = dict(
        name=name, model="tiny-llama", state=contract.WorkerState.SERVING.value, pid=4242,
        started_at=now - 120, updated_at=now, pages_used=300, pages_total=1000, running=6, waiting=2,
        tokens_per_s=512.5, prompt_tokens_per_s=2048.0, preemptions=3, requests_finished=77,
        mean_batch_size=5.5, max_num_seqs=64,
    )
    values.update(overrides)
    stats = WorkerStats(**values)
    contract.write_heartbeat(client, stats)
    return stats


def seed_gone_worker(client: redis.Redis, name: str) -> None:
    """A worker that registered once but whose heartbeat hash has expired."""
    client.sadd(contract.WORKERS, name)
    client.delete(contract.worker_key(name))


def make_event(request_id: str, *, ttft_s: float = 0.2, tpot_s: float = 0.02, output_tokens: int = 50,
               prompt_tokens: int = 100, finish_reason: str = "stop", worker: str = "w1",
               finished_at: float | None = None) -> RequestEvent:
    finished_at = time.time() if finished_at is None else finished_at
    e2e_s = ttft_s + tpot_s * max(output_tokens - 1, 0)
    return RequestEvent(
        id=request_id, worker=worker, model="tiny-llama", finish_reason=finish_reason,
        prompt_tokens=prompt_tokens, output_tokens=output_tokens, enqueued_at=finished_at - e2e_s,
        queue_s=ttft_s / 2, ttft_s=ttft_s, tpot_s=tpot_s, e2e_s=e2e_s, finished_at=finished_at,
    )


def seed_events(client: redis.Redis, events: list[RequestEvent]) -> None:
    """Record finished requests exactly as a worker does (event + counters + histograms, the
    counters summed over the batch)."""
    pipe = client.pipeline()
    totals = contract.TotalsDelta()
    for event in events:
        contract.record_finished(pipe, event, totals)
        totals.count(contract.TOTAL_PROMPT_TOKENS, event.prompt_tokens)
        totals.count(contract.TOTAL_GENERATION_TOKENS, event.output_tokens)
    totals.write(pipe)
    pipe.execute()


def seed_queue(client: redis.Redis, total: int, delivered: int, first_age_s: float = 0.0) -> list[str]:
    """Enqueue `total` requests (the first one `first_age_s` old) and deliver `delivered` to a consumer."""
    contract.ensure_group(client)
    ids = []
    start_ms = int((time.time() - first_age_s) * 1000)
    for i in range(total):
        message = RequestMessage(id=f"req-{i}", model="tiny-llama", prompt_token_ids=[1, 2, 3], params={"seed": i})
        entry_id = f"{start_ms + i}-0" if first_age_s else "*"
        ids.append(client.xadd(contract.REQUESTS, message.encode(), id=entry_id).decode())
        client.hincrby(contract.TOTALS, contract.TOTAL_ENQUEUED, 1)
    if delivered:
        client.xreadgroup(contract.WORKERS_GROUP, "consumer-1", {contract.REQUESTS: ">"}, count=delivered)
    return ids


# ---------------------------------------------------------------- serving and simulating


@contextmanager
def serve_app(app, port: int | None = None) -> Iterator[str]:
    """Run an ASGI app under uvicorn in a thread; yields its base URL."""
    port = port or free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


class SimulatedTraffic:
    """A background thread that behaves like a small fleet: heartbeats, queue movement, finished requests."""

    def __init__(self, redis_url: str, workers: tuple[str, ...] = ("sim-worker-a", "sim-worker-b"),
                 gone: tuple[str, ...] = ("sim-worker-retired",), tick_s: float = 0.1, seed: int = 0,
                 backfill_s: float = 0.0) -> None:
        self.workers = workers
        self._backfill_s = backfill_s
        self._gone = gone
        self._client = redis.Redis.from_url(redis_url)
        self._tick_s = tick_s
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._count = 0
        self._in_flight: deque[tuple[int, bytes]] = deque()  # (tick delivered, entry id)

    def __enter__(self) -> "SimulatedTraffic":
        contract.ensure_group(self._client)
        for name in self._gone:
            seed_gone_worker(self._client, name)
        self._heartbeats()
        self._backfill()
        self._thread.start()
        return self

    def _backfill(self) -> None:
        """Requests that finished over the last `backfill_s` seconds, so the charts have history."""
        now, rng, events = time.time(), self._rng, []
        t = now - self._backfill_s
        while t < now - 1:
            load = 1.0 + 0.6 * math.sin((now - t) / 90)
            events.append(make_event(
                f"past-{len(events)}", ttft_s=rng.uniform(0.05, 0.3) * load, tpot_s=rng.uniform(0.01, 0.02) * load,
                output_tokens=rng.randint(50, 300), prompt_tokens=rng.randint(20, 600),
                worker=rng.choice(self.workers), finished_at=t,
            ))
            t += rng.expovariate(3.0 * load)
        seed_events(self._client, events)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._client.close()

    def _run(self) -> None:
        last_beat = 0.0
        while not self._stop.wait(self._tick_s):
            try:
                self._tick()
                if time.monotonic() - last_beat >= contract.HEARTBEAT_INTERVAL_S / 2:
                    self._heartbeats()
                    last_beat = time.monotonic()
            except redis.ConnectionError:
                pass  # a test may stop Redis on purpose; keep trying

    def _heartbeats(self) -> None:
        t = time.time()
        for k, name in enumerate(self.workers):
            wave = 0.5 + 0.4 * ((t / 7 + k) % 1.0)
            seed_worker(self._client, name, model="llama-3.2-1b", pages_used=int(4096 * wave), pages_total=4096,
                        running=int(20 * wave), waiting=self._rng.randint(0, 4),
                        tokens_per_s=800 + 400 * wave + self._rng.random() * 50,
                        preemptions=self._count // 40, requests_finished=self._count // len(self.workers),
                        step_compiles=k + 1, compile_stall_s=0.5 * k,  # the first worker's were all in the background
                        compiles_pending=4 if k == 0 else 0)  # and it has its idle queue to go

    def _tick(self) -> None:
        """One new request per tick; about one delivered per tick; each finishes ~8 ticks after delivery."""
        rng = self._rng
        self._count += 1
        message = RequestMessage(id=f"sim-{self._count}", model="llama-3.2-1b", prompt_token_ids=[1] * 8, params={})
        pipe = self._client.pipeline()
        pipe.xadd(contract.REQUESTS, message.encode())
        pipe.hincrby(contract.TOTALS, contract.TOTAL_ENQUEUED, 1)
        if rng.random() < 0.05:
            pipe.hincrby(contract.TOTALS, contract.TOTAL_REJECTED, 1)
        pipe.execute()
        backlog = self._client.xlen(contract.REQUESTS) - len(self._in_flight)
        count = 2 if backlog > 6 else rng.choice([0, 1, 1])
        if count:
            delivered = self._client.xreadgroup(contract.WORKERS_GROUP, "sim", {contract.REQUESTS: ">"}, count=count)
            for _, entries in delivered or []:
                self._in_flight.extend((self._count, entry_id) for entry_id, _ in entries)
        while self._in_flight and self._in_flight[0][0] <= self._count - 8:
            self._finish(self._in_flight.popleft()[1], rng)

    def _finish(self, entry_id: bytes, rng: random.Random) -> None:
        output = rng.randint(16, 400)
        event = make_event(
            f"sim-{entry_id.decode()}", ttft_s=rng.uniform(0.05, 0.6), tpot_s=rng.uniform(0.008, 0.03),
            output_tokens=output, prompt_tokens=rng.randint(20, 900), worker=rng.choice(self.workers),
            finish_reason=rng.choices(["stop", "length", "abort"], weights=[8, 2, 1])[0],
        )
        seed_events(self._client, [event])
        pipe = self._client.pipeline()
        pipe.xack(contract.REQUESTS, contract.WORKERS_GROUP, entry_id)
        pipe.xdel(contract.REQUESTS, entry_id)
        pipe.execute()


# ---------------------------------------------------------------- the browser check


def wait_for_js(page, function: str, arg=None, timeout_ms: float = 30_000) -> None:
    """Poll a JS function through page.evaluate until it returns true.

    Not page.wait_for_function: its polling compiles the predicate with eval inside the page, which
    the dashboard's Content-Security-Policy (script-src 'self', no 'unsafe-eval') rightly blocks
    whenever the first check is not already true."""
    deadline = time.monotonic() + timeout_ms / 1000
    while not page.evaluate(function, arg):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting in the page for: {function}")
        page.wait_for_timeout(100)


def launch_chromium(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


def assert_dashboard_live(page_url: str, screenshot_path: str | Path, *, worker_name: str | None = None,
                          api_key: str | None = None, timeout_s: float = 20.0) -> dict:
    """Open the dashboard in headless Chromium and check that it is alive.

    Logs in first when `api_key` is given. Checks: the live indicator, `worker_name` in the
    workers table, a non-zero queue or throughput figure, a throughput chart that changes
    between two readings, and no script or content-policy errors. Saves a full-page screenshot.
    Returns the figures it read.
    """
    from playwright.sync_api import sync_playwright

    timeout_ms = timeout_s * 1000
    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.goto(page_url, timeout=timeout_ms)
            if api_key is not None:
                page.wait_for_selector("input[name=api_key]", timeout=timeout_ms)
                login_shot = Path(screenshot_path).with_name(Path(screenshot_path).stem + "-login.png")
                login_shot.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(login_shot))
                page.fill("input[name=api_key]", api_key)
                page.click("button[type=submit]")
            wait_for_js(page, "() => document.getElementById('live-text')?.textContent === 'Live'", timeout_ms=timeout_ms)
            if worker_name is not None:
                page.wait_for_selector(f'#workers tr[data-worker="{worker_name}"]', timeout=timeout_ms)
            wait_for_js(
                page,
                """() => ['queue-waiting', 'queue-in-flight', 'fleet-tokens', 'fleet-requests'].some((id) => {
                       const v = parseFloat(document.getElementById(id).textContent.replace(/[^0-9.]/g, ''));
                       return v > 0; })""",
                timeout_ms=timeout_ms,
            )
            first = page.get_attribute("#chart-tokens path.line", "d", timeout=timeout_ms)
            wait_for_js(page, "(d) => document.querySelector('#chart-tokens path.line')?.getAttribute('d') !== d",
                        arg=first, timeout_ms=timeout_ms)
            page.wait_for_timeout(300)
            figures = {
                key: page.text_content(f"#{key}")
                for key in ("queue-waiting", "queue-in-flight", "fleet-tokens", "fleet-requests", "fleet-workers",
                            "fleet-prefix")
            }
            if worker_name is not None:
                cells = page.query_selector_all(f'#workers tr[data-worker="{worker_name}"] td')
                headers = page.query_selector_all("#workers thead th")
                figures["worker"] = {h.text_content(): c.text_content() for h, c in zip(headers, cells)}
                figures["worker_titles"] = {h.text_content(): c.get_attribute("title") for h, c in zip(headers, cells)}
            Path(screenshot_path).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot_path), full_page=True)
            assert page.is_hidden("#banner"), page.text_content("#banner")
            assert not errors, errors
            return figures
        finally:
            browser.close()




def test_dashboard_live_in_chromium(redis_client, redis_url, output_dir):
    app = create_dashboard(DashboardConfig(redis_url=redis_url))
    with SimulatedTraffic(redis_url, backfill_s=600) as traffic, serve_app(app) as base:
        time.sleep(2.5)  # let a few throughput buckets fill
        figures = assert_dashboard_live(base + "/", output_dir / "dashboard.png", worker_name=traffic.workers[0])
    assert figures["fleet-workers"] == "2 alive"
    assert figures["worker"]["Compiles"] == "1" and figures["worker"]["Worker"] == traffic.workers[0]
    assert figures["worker_titles"]["Compiles"] == "0.0 s of stalled streams; 4 more compiling or queued"


def test_dashboard_mounted_with_login_in_chromium(redis_client, redis_url, output_dir):
    from starlette.applications import Starlette
    from starlette.routing import Mount

    from dashboard import metrics_route

    config = DashboardConfig(redis_url=redis_url, api_key="s3cret-key")
    api = Starlette(routes=[Mount("/dashboard", create_dashboard(config)), metrics_route(config)])
    with SimulatedTraffic(redis_url, workers=("gpu-0",), gone=()), serve_app(api) as base:
        assert_dashboard_live(base + "/dashboard/", output_dir / "dashboard-mounted.png", worker_name="gpu-0",
                              api_key="s3cret-key")


def test_banner_when_redis_goes_down_and_recovery(output_dir):
    from playwright.sync_api import sync_playwright

    port = free_port()
    config = DashboardConfig(redis_url=f"redis://127.0.0.1:{port}/0")
    with serve_app(create_dashboard(config)) as base, sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            with redis_server(port):
                seed_worker(redis.Redis(port=port), "phoenix")
                page.goto(base + "/")
                page.wait_for_selector('#workers tr[data-worker="phoenix"]')
                assert page.is_hidden("#banner")
            # Redis is stopped: the page says so and keeps the last data on screen.
            page.wait_for_selector("#banner:not([hidden])", timeout=10_000)
            assert "Redis unreachable" in page.text_content("#banner")
            assert page.text_content("#live-text") == "Redis down"
            assert page.is_visible('#workers tr[data-worker="phoenix"]')
            page.screenshot(path=str(output_dir / "redis-down.png"), full_page=True)
            with redis_server(port):
                seed_worker(redis.Redis(port=port), "phoenix")
                page.wait_for_selector("#banner", state="hidden", timeout=10_000)
                wait_for_js(page, "() => document.getElementById('live-text').textContent === 'Live'")
        finally:
            browser.close()
