"""A worker holds its free slots plus `backlog` requests; draining hands the unstarted ones back at once;
its Redis threads wait instead of polling, write output while a read waits, and outlast a Redis that
goes away or comes back empty.

The worker runs in this process against real Redis and the real engine on the tiny served model.
The first two tests drive its loop by hand (pull, step, drain); the others start its Redis threads.
"""

from __future__ import annotations

import dataclasses

import re
import threading
import time

import redis

from tests.conftest import free_port, redis_server
from tests.stack_support import wait_until
from tests.test_serving import model_dir  # noqa: F401 (fixture)
from worker import contract
from worker.contract import OutputDelta, RequestMessage
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.service.config import WorkerConfig
from worker.service.redis_io import PULL_BLOCK_S, Incoming, RedisIO
from worker.service.stream_interval import StreamInterval
from worker.service.worker import Worker

SEQS, BACKLOG = 4, 3


def _worker(model_dir, redis_url, stream_interval_ms: float = 50.0, log_stats_interval_s: float = 10.0,  # noqa: F811
            name: str = "w-backlog", warmup: bool = False) -> Worker:
    """A worker on the tiny served model, in this process, over a flushed Redis (its run() not started)."""
    engine_config = EngineConfig(max_num_seqs=SEQS, max_num_batched_tokens=64, page_size=8, num_pages=64)
    config = WorkerConfig(model_dir=str(model_dir), redis_url=redis_url, name=name, backlog=BACKLOG,
                          warmup=warmup, stream_interval_ms=stream_interval_ms, log_stats_interval_s=log_stats_interval_s,
                          engine=engine_config)
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    return Worker(config, LLMEngine.from_path(str(model_dir), engine_config), client)


def _message(i: int) -> RequestMessage:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, seed=i).to_dict()
    return RequestMessage(f"req-{i}", "tinyllama", [3 + i, 5, 7, 11, 13, 17, 19, 23, 29, 31], params)


def test_a_worker_holds_its_slots_plus_the_backlog_and_hands_unstarted_ones_back_when_draining(model_dir, redis_url):  # noqa: F811
    worker = _worker(model_dir, redis_url)
    engine, pages = worker.engine, worker.engine.allocator.num_free_pages
    assert worker._capacity() == SEQS  # the free slots first: a burst fills other workers' slots too
    for i in range(SEQS):
        worker._start(Incoming(f"0-{i + 1}", _message(i)))
    assert worker._capacity() == BACKLOG  # every slot taken: the backlog
    for i in range(SEQS, SEQS + BACKLOG):
        worker._start(Incoming(f"0-{i + 1}", _message(i)))
    assert worker._capacity() == 0  # holds SEQS + BACKLOG: pulls nothing more

    worker._publish(engine.step())  # 64 tokens of budget: at most 6 ten-token prompts start
    started = {rid for rid in worker.active if not engine.not_started(rid)}
    waiting = set(worker.active) - started
    assert 0 < len(started) <= SEQS and waiting  # the backlog waits in the engine

    worker._drain_deadline = float("inf")  # what SIGTERM sets
    worker._take_work()
    assert set(worker.active) == started  # the unstarted ones left at once...
    worker.io.send()
    worker.io._flush()
    client = redis.Redis.from_url(redis_url)
    requeued = [RequestMessage.decode(fields) for _, fields in client.xrange(contract.REQUESTS)]
    assert {m.id for m in requeued} == waiting and all(m.attempt == 1 for m in requeued)  # ...back on the queue
    assert not any(client.exists(contract.out_stream(rid)) for rid in waiting)  # having published nothing

    while engine.has_unfinished():  # the started ones still finish here
        worker._publish(engine.step())
    assert not worker.active and engine.allocator.num_free_pages == pages


def test_a_pull_admits_every_entry_with_its_cancel_state_and_drops_malformed_ones(model_dir, redis_url):  # noqa: F811
    worker = _worker(model_dir, redis_url)
    client = redis.Redis.from_url(redis_url)
    contract.ensure_group(client)
    for i in range(3):
        client.xadd(contract.REQUESTS, _message(i).encode())
    client.xadd(contract.REQUESTS, {"junk": "1"})  # not a RequestMessage
    client.set(contract.cancelled_key("req-1"), 1)  # cancelled while it waited in the queue
    worker.io.set_capacity(10)
    worker.io._pull()
    admitted = []
    while not worker.io.inbox.empty():
        admitted.append(worker.io.inbox.get_nowait())
    assert [(m.message.id, m.cancelled) for m in admitted] == [("req-0", False), ("req-1", True), ("req-2", False)]
    assert worker.io.wakeup.is_set()
    assert client.xlen(contract.REQUESTS) == 3  # the malformed entry is acknowledged and deleted


def test_requests_of_an_api_process_that_is_gone_are_dropped_queued_or_held(model_dir, redis_url):  # noqa: F811
    """An API process keeps its alive key while it runs; a request whose API's key is gone (the
    process died: no client is left to read it) is admitted as cancelled when pulled, and one held
    already is cancelled once the key is missing at two checks in a row, once. Requests that name no API are served as before."""
    worker = _worker(model_dir, redis_url)
    client = redis.Redis.from_url(redis_url)
    contract.ensure_group(client)
    live, dead = contract.api_notify_stream("live"), contract.api_notify_stream("dead")
    client.set(contract.api_alive_key(live), 1, ex=contract.API_ALIVE_TTL_S)
    for i, notify in enumerate([live, dead, "", live]):
        message = _message(i)
        message.notify = notify
        client.xadd(contract.REQUESTS, message.encode())
    worker.io.set_capacity(10)
    worker.io._pull()
    admitted = []
    while not worker.io.inbox.empty():
        admitted.append(worker.io.inbox.get_nowait())
    assert [(m.message.id, m.cancelled) for m in admitted] == [
        ("req-0", False), ("req-1", True), ("req-2", False), ("req-3", False)]
    worker.io._drop_requests_of_gone_apis()
    assert worker.io.cancels.empty()  # the API of those held is alive (req-1 was admitted cancelled)
    client.delete(contract.api_alive_key(live))  # that API process is gone, or Redis restarted empty
    worker.io._drop_requests_of_gone_apis()
    assert worker.io.cancels.empty()  # missing once: a live API sets its key again within a second
    worker.io._drop_requests_of_gone_apis()
    worker.io._drop_requests_of_gone_apis()  # once each
    cancelled = []
    while not worker.io.cancels.empty():
        cancelled.append(worker.io.cancels.get_nowait())
    assert sorted(cancelled) == ["req-0", "req-3"]


def test_the_heartbeat_adds_the_engines_preemptions_to_the_fleet_counter(model_dir, redis_url):  # noqa: F811
    """/metrics' redjax:num_preemptions_total reads TOTALS; only heartbeats knew the count, so it
    stayed 0 through a run with 753 preemptions (session 50)."""
    worker = _worker(model_dir, redis_url)
    client = redis.Redis.from_url(redis_url)
    worker._report()
    stats = worker.io._stats
    for preemptions, total in [(0, None), (3, b"3"), (3, b"3"), (7, b"7")]:
        worker.io.set_stats(dataclasses.replace(stats, preemptions=preemptions))
        worker.io._heartbeat()
        assert client.hget(contract.TOTALS, contract.TOTAL_PREEMPTIONS) == total


def test_the_heartbeat_adds_the_compiles_since_the_warmup_to_the_fleet_counters(model_dir, redis_url):  # noqa: F811
    """A step variant compiled while serving stalls streams (or takes a core) with nothing in the
    log level a fleet watches; /metrics counts them. Warm-up's compiles are not counted."""
    worker = _worker(model_dir, redis_url)
    client = redis.Redis.from_url(redis_url)
    runner = worker.engine.runner
    runner.compiles.add(2.5, stalled=True, variants=40)  # the warm-up's
    worker._report()
    assert (worker.io._stats.step_compiles, worker.io._stats.compile_stall_s) == (0, 0.0)
    worker._compiles_mark = runner.compiles.reading()  # as run() takes it when the warm-up ends
    runner.compiles.add(0.75, stalled=True)  # a batch nothing covered: compiled on the engine thread
    runner.compiles.add(1.5, stalled=False)  # in the background: a core, not the streams
    worker._window.clear()  # a fresh report now, not a quarter second later
    worker._report()
    assert (worker.io._stats.step_compiles, worker.io._stats.compile_stall_s) == (2, 0.75)
    worker.io._heartbeat()
    worker.io._heartbeat()  # counted once
    assert client.hget(contract.TOTALS, contract.TOTAL_STEP_COMPILES) == b"2"
    assert float(client.hget(contract.TOTALS, contract.TOTAL_COMPILE_STALL_S)) == 0.75


def _reads(client: redis.Redis) -> int:
    """XREADGROUP calls the server has answered so far."""
    return int(client.info("commandstats").get("cmdstat_xreadgroup", {}).get("calls", 0))


def test_an_idle_worker_waits_in_redis_instead_of_polling_it(model_dir, redis_url):  # noqa: F811
    worker = _worker(model_dir, redis_url)
    client = redis.Redis.from_url(redis_url)
    pulls = []
    pull = worker.io._pull
    worker.io._pull = lambda: pulls.append(1) or pull()  # counts the reader thread's turns
    worker.io.start()
    try:
        before, t0 = _reads(client), time.monotonic()
        time.sleep(0.5)  # no room: the reader sleeps on the capacity, and reads nothing
        assert _reads(client) == before
        assert len(pulls) <= (time.monotonic() - t0) / PULL_BLOCK_S + 2  # a 4 ms poll turned ~125 times

        worker.io.set_capacity(SEQS)
        before, t0 = _reads(client), time.monotonic()
        time.sleep(1.0)  # room, nothing queued: each read blocks in Redis
        assert 1 <= _reads(client) - before <= (time.monotonic() - t0) / PULL_BLOCK_S + 2

        client.xadd(contract.REQUESTS, _message(0).encode())  # arrives during a blocked read
        assert worker.io.wakeup.wait(10)
        assert worker.io.inbox.get_nowait().message.id == "req-0"
    finally:
        worker.io.stop()
    assert not client.exists(contract.worker_key(worker.config.name))  # the heartbeat is gone


def test_output_is_written_while_the_reader_waits_for_requests(model_dir, redis_url):  # noqa: F811
    worker = _worker(model_dir, redis_url)
    client = redis.Redis.from_url(redis_url)
    release = threading.Event()
    pull = worker.io._pull
    worker.io._pull = lambda: release.wait() and pull()  # a read that lasts until the test lets it go
    worker.io.start()
    try:
        worker.io.publish("req-9", [OutputDelta(seq=0, text="hi", token_ids=[5])])
        worker.io.send()
        wait_until(lambda: client.xlen(contract.out_stream("req-9")) == 1, 10)  # raises on timeout
    finally:
        release.set()
        worker.io.stop()


def test_a_worker_makes_the_request_group_again_when_redis_lost_it(model_dir, redis_url):  # noqa: F811
    worker = _worker(model_dir, redis_url)
    client = redis.Redis.from_url(redis_url)
    worker.io.set_capacity(SEQS)
    worker.io.start()
    try:
        client.flushdb()  # what a Redis restarted without persistence holds: no stream, no group
        client.xadd(contract.REQUESTS, _message(0).encode())  # an API enqueues as before
        assert worker.io.wakeup.wait(20)
        assert worker.io.inbox.get_nowait().message.id == "req-0"
    finally:
        worker.io.stop()


def test_output_made_while_redis_is_away_is_written_when_it_is_back(model_dir, tmp_path):  # noqa: F811
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    with redis_server(port, tmp_path):
        worker = _worker(model_dir, url)
        worker.io.start()
    # Redis has stopped: the writer fails, and tries again
    worker.io.publish("req-7", [OutputDelta(seq=0, text="late", token_ids=[9])])
    worker.io.send()
    with redis_server(port, tmp_path):  # back, at the same address
        try:
            client = redis.Redis.from_url(url)
            wait_until(lambda: client.xlen(contract.out_stream("req-7")) == 1, 30)  # raises on timeout
            assert OutputDelta.decode(client.xrange(contract.out_stream("req-7"))[0][1]).text == "late"
        finally:
            worker.io.stop()


def test_stream_interval_merges_a_streams_middle_deltas_and_keeps_its_tokens(model_dir, redis_url):  # noqa: F811
    """The same greedy request through a worker publishing every step and one holding tokens back
    for longer than the request runs: the second publishes its first text at once, then only the
    finish, with the same tokens and text in the same order."""
    def deltas(interval_ms: float) -> list[OutputDelta]:
        worker = _worker(model_dir, redis_url, stream_interval_ms=interval_ms)
        worker._start(Incoming("0-1", _message(0)))
        while worker.engine.has_unfinished():
            worker._publish(worker.engine.step())
        return [d for item in worker.io._pending if isinstance(item, tuple) for d in item[1]]

    every_step, held = deltas(0.0), deltas(60_000.0)
    tokens = lambda ds: [t for d in ds for t in d.token_ids]  # noqa: E731
    assert tokens(held) == tokens(every_step) and len(tokens(held)) == 40
    assert "".join(d.text for d in held) == "".join(d.text for d in every_step)
    assert len(every_step) > 5  # one per step (fused decode steps run several tokens at once)
    assert every_step[-1].finish_reason == "length" and every_step[-1].done  # no separate done marker
    first_text = next(i for i, d in enumerate(held) if d.text)
    assert len(held) == first_text + 2  # the first text at once, then the rest with the finish
    assert held[-1].finish_reason == "length" and held[-1].done and held[-1].usage["completion_tokens"] == 40


def test_a_request_resumed_after_any_published_delta_ends_with_the_same_text(model_dir, redis_url):  # noqa: F811
    """Deltas merged by the stream interval (a step every 10 ms, deltas 50 ms apart), the worker
    gone after each of them in turn: another worker resumes from what Redis holds, and the text
    the client got before plus the resumed text is the text of an uninterrupted run. The tiny model
    emits many tokens that end inside a character, whose text must not be counted as sent."""
    engine_config = EngineConfig(max_num_seqs=SEQS, max_num_batched_tokens=64, page_size=8, num_pages=64,
                                 decode_steps=1)
    engine = LLMEngine.from_path(str(model_dir), engine_config)
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True, seed=1)
    # "the answer is forty two": greedy, its text comes with some tokens and not with others
    message = RequestMessage("req-resume", "tinyllama", [307, 275, 305, 264, 273, 276, 306, 258, 310], params.to_dict())
    stream = StreamInterval(0.05)
    published: list[OutputDelta] = []
    engine.add_request(message.id, message.prompt_token_ids, params)
    clock = 0.0
    while engine.has_unfinished():
        clock += 0.01
        for out in stream.take(engine.step(), clock):
            published.append(OutputDelta(seq=len(published), token_ids=out.token_ids, text=out.text,
                                         finish_reason=out.finish_reason))
    full = "".join(d.text for d in published)
    sent = [[t for d in published[:cut] for t in d.token_ids] for cut in range(1, len(published))]
    # the worker is gone inside a character after some of them: that text must not count as sent
    assert sum(engine.tokenizer.decode(ids).endswith("\ufffd") for ids in sent) > 0

    client = redis.Redis.from_url(redis_url)
    io = RedisIO(WorkerConfig(model_dir=str(model_dir), redis_url=redis_url, warmup=False), client)
    for cut in range(1, len(published) - 1):
        client.flushdb()
        for delta in published[:cut]:
            client.xadd(contract.out_stream(message.id), delta.encode())
        incoming = Incoming("0-1", message)
        io._read_emitted(incoming)
        resumed = LLMEngine.from_path(str(model_dir), engine_config) if cut == 1 else resumed  # noqa: F821
        resumed.resume_request(message.id, message.prompt_token_ids, params, incoming.emitted,
                               incoming.finished, held=incoming.held)
        text = "".join(d.text for d in published[:cut])
        while resumed.has_unfinished():
            text += "".join(o.text for o in resumed.step())
        assert text == full, cut


def test_a_busy_worker_logs_its_stats_and_an_idle_one_stays_quiet(model_dir, redis_url, caplog):  # noqa: F811
    """A line every log_stats_interval_s while it works: throughput, queue, KV pages and the prefix
    cache's share of prompt tokens (two of the three prompts hit the first one's full page)."""
    worker = _worker(model_dir, redis_url, log_stats_interval_s=1e-9)
    first = _message(0)
    worker._start(Incoming("0-1", first))
    worker._publish(worker.engine.step())  # its 10 prompt tokens computed: the first page of 8 is cached
    for i in (1, 2):
        worker._start(Incoming(f"0-{i + 1}", RequestMessage(f"again-{i}", "tinyllama", first.prompt_token_ids,
                                                            _message(i).params)))
    with caplog.at_level("INFO", logger="redjax.worker"):
        for _ in range(2):
            worker._publish(worker.engine.step())
        worker._report()
    [line] = [r.getMessage() for r in caplog.records if "tok/s" in r.getMessage()]
    assert re.fullmatch(r"worker w-backlog: prompt [0-9.]+ tok/s, generation [0-9.]+ tok/s, running 3, waiting 0, "
                        r"KV pages [0-9.]+% used, prefix cache hits 53.3% of prompt tokens", line), line  # 16 of 30
    for rid in list(worker.active):
        worker._publish(worker.engine.abort(rid))
    caplog.clear()
    with caplog.at_level("INFO", logger="redjax.worker"):
        worker._report()  # nothing ran since the last line, nothing is active
    assert not [r for r in caplog.records if "tok/s" in r.getMessage()]
