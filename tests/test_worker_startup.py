"""A worker joins the fleet as "starting" while its model loads and its warm-up compiles, and pulls
nothing until they are done; then it serves what was queued meanwhile.

The worker runs in this process against real Redis and the real engine on the tiny served model;
its warm-up is wrapped to look at Redis while it runs.
"""

from __future__ import annotations

import signal
import threading

import pytest
import redis

from tests.stack_support import run_worker_while, wait_until
from tests.test_serving import model_dir  # noqa: F401 (fixture)
from tests.test_worker_backlog import _message, _worker
from worker import contract
from worker.contract import OutputDelta, WorkerStats
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.service.config import WorkerConfig
from worker.service.loading_beat import LoadingBeat
from worker.service.worker import Worker


def _finished(client: redis.Redis, request_id: str) -> bool:
    entries = client.xrange(contract.out_stream(request_id))
    return any(OutputDelta.decode(fields).done for _, fields in entries)


def test_a_warming_worker_heartbeats_as_starting_and_serves_what_queued_meanwhile(model_dir, redis_url):  # noqa: F811
    worker = _worker(model_dir, redis_url, name="w-startup", warmup=True)
    config, client = worker.config, redis.Redis.from_url(redis_url)
    contract.ensure_group(client)
    client.xadd(contract.REQUESTS, _message(0).encode())  # queued before the worker is warm
    seen: dict[str, object] = {}
    warmup = worker.engine.warmup

    def watched_warmup() -> int:
        key = contract.worker_key(config.name)
        wait_until(lambda: client.exists(key), 10)  # the heartbeat thread runs during the compiles
        seen["state"] = WorkerStats.decode(client.hgetall(key)).state
        n = warmup()
        seen["pending"] = client.xpending(contract.REQUESTS, contract.WORKERS_GROUP)["pending"]
        return n

    worker.engine.warmup = watched_warmup
    def served() -> None:
        wait_until(lambda: _finished(client, "req-0"), 120)
        key = contract.worker_key(config.name)  # the heartbeat thread refreshes the hash once a second
        wait_until(lambda: WorkerStats.decode(client.hgetall(key)).state == "serving", 10)
        seen["serving"] = True

    run_worker_while(worker, served)
    assert seen["state"] == "starting"
    assert seen["pending"] == 0  # nothing pulled (nor claimed) while compiling
    assert seen["serving"]
    assert _finished(client, "req-0") and client.xlen(contract.REQUESTS) == 0
    assert not client.exists(contract.worker_key(config.name))  # gone after the drain


def test_a_loading_worker_heartbeats_as_starting_and_leaves_at_once_when_the_load_fails(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    config = WorkerConfig(model_dir="/models/tinyllama", redis_url=redis_url, name="w-loading",
                          engine=EngineConfig(max_num_seqs=6))
    key = contract.worker_key(config.name)
    with LoadingBeat(config, client):
        wait_until(lambda: client.exists(key), 10)
        stats = WorkerStats.decode(client.hgetall(key))
        assert (stats.state, stats.model, stats.max_num_seqs) == ("starting", "tinyllama", 6)
        assert 0 < client.ttl(key) <= contract.HEARTBEAT_TTL_S
        first = stats.updated_at
        wait_until(lambda: WorkerStats.decode(client.hgetall(key)).updated_at > first, 10)  # refreshed
    assert client.exists(key)  # loaded: the worker's own threads take the heartbeat over
    with pytest.raises(OSError), LoadingBeat(config, client):
        wait_until(lambda: client.exists(key), 10)
        raise OSError("no such model")
    assert not client.exists(key)  # a failed load is out of the fleet at once, not after the TTL


def test_the_signal_handler_takes_no_lock_the_main_thread_may_hold(model_dir, redis_url):  # noqa: F811
    """Python runs a signal handler on the main thread between two of its steps, perhaps while it
    holds an Event's lock (every loop turn sets or clears the capacity's `_room` and `wakeup`) or
    RedisIO's; a handler that took one of those would wait for itself forever, and the worker would
    never stop. Here the locks are held by another thread: a handler that needs one blocks."""
    engine_config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, num_pages=64)
    config = WorkerConfig(model_dir=str(model_dir), redis_url=redis_url, name="w-signal", engine=engine_config)
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    worker = Worker(config, LLMEngine.from_path(str(model_dir), engine_config), client)
    contract.ensure_group(client)
    worker.io.set_capacity(4)  # a serving worker with room
    held, release = threading.Event(), threading.Event()

    def hold_the_locks() -> None:
        with worker.io._lock, worker.io.wakeup._cond, worker.io._room._cond:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold_the_locks, daemon=True)
    holder.start()
    held.wait(10)
    handler = threading.Thread(target=worker._on_signal, args=(signal.SIGTERM, None), daemon=True)
    handler.start()
    handler.join(10)
    returned = not handler.is_alive()
    release.set()
    holder.join(10)
    assert returned, "the signal handler blocked on a lock"
    assert worker.state.value == "draining" and worker._done()  # nothing active: the loop ends at its next turn
    client.xadd(contract.REQUESTS, _message(0).encode())
    worker.io._pull()  # what redis-in does next: from the signal on, it pulls nothing, room or not
    assert worker.io.inbox.empty() and client.xpending(contract.REQUESTS, contract.WORKERS_GROUP)["pending"] == 0
