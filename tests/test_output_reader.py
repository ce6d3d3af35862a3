"""The API's output reader against real Redis: it reads only the out_streams a notification names,
and every subscribed stream once per sweep (outputs written without a notification still arrive)."""

from __future__ import annotations

import asyncio

import redis
from redis.asyncio import Redis

from api.outputs import OutputReader, ReaderFailed, RequestLost
from worker import contract
from worker.contract import OutputDelta, out_stream

NOTIFY = contract.api_notify_stream("test-reader")


async def stop(reader: OutputReader, task: asyncio.Task, client: Redis) -> None:
    reader.close()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await client.aclose()


def test_reads_only_notified_streams_and_sweeps_the_rest(redis_client, redis_url):
    async def scenario():
        client = Redis.from_url(redis_url)
        reader = OutputReader(client, NOTIFY)
        reads: list[set[str]] = []  # the streams of every XREAD other than the notify stream's
        xread = client.xread

        async def spy(streams, **kwargs):
            # recorded once the read has returned: a read still in flight when the test writes
            # would pick up the write (the first sweep, seen too early, delivered "a" in one CI run)
            replies = await xread(streams, **kwargs)
            if NOTIFY not in streams:
                reads.append({k.decode() if isinstance(k, bytes) else k for k in streams})
            return replies

        client.xread = spy
        queues = {rid: asyncio.Queue() for rid in ["a", "b", *(f"idle-{i}" for i in range(40))]}
        for rid, queue in queues.items():
            reader.subscribe(rid, queue)
        reader.sweep_s = 60.0  # the first pass sweeps; no other sweep in the first part
        task = asyncio.create_task(reader.run())
        try:
            while not reads:
                await asyncio.sleep(0.01)
            assert len(reads[0]) == 42  # the first pass reads every subscription

            sync = redis.Redis.from_url(redis_url)
            sync.xadd(out_stream("a"), OutputDelta(seq=0, text="x", token_ids=[7]).encode())
            contract.notify_outputs(sync, NOTIFY, ["a", "not-subscribed"])
            rid, delta = await asyncio.wait_for(queues["a"].get(), 10)
            assert (rid, delta.text) == ("a", "x")
            assert reads[-1] == {out_stream("a")}  # only the stream named (and subscribed)

            sync.xadd(out_stream("b"), OutputDelta(seq=0, text="y", token_ids=[8]).encode())  # no notification
            since = len(reads)
            reader.sweep_s = 0.1
            rid, delta = await asyncio.wait_for(queues["b"].get(), 10)
            assert (rid, delta.text) == ("b", "y")
            assert len(reads[since]) == 42  # found by the next read, a sweep
            assert queues["a"].empty()  # a's entry is not delivered twice
        finally:
            await stop(reader, task, client)

    asyncio.run(scenario())


def test_a_stream_read_to_its_final_entry_is_deleted(redis_client, redis_url):
    """Once the reader has read a request's final entry its out_stream is deleted, also when that
    request was the reader's last subscription; a stream still running stays (before: every
    stream stayed in Redis for the worker's TTL of 600 s, ~4.4 KB a request)."""
    async def scenario():
        client = Redis.from_url(redis_url)
        reader = OutputReader(client, NOTIFY)
        done, running = asyncio.Queue(), asyncio.Queue()
        reader.subscribe("done", done)
        reader.subscribe("running", running)
        task = asyncio.create_task(reader.run())
        sync = redis.Redis.from_url(redis_url)
        try:
            sync.xadd(out_stream("done"), OutputDelta(seq=0, text="a", token_ids=[5]).encode())
            sync.xadd(out_stream("done"), OutputDelta(seq=1, finish_reason="length", done=True).encode())
            sync.xadd(out_stream("running"), OutputDelta(seq=0, text="b", token_ids=[6]).encode())
            contract.notify_outputs(sync, NOTIFY, ["done", "running"])
            for queue, last in ((done, 1), (running, 0)):
                while (await asyncio.wait_for(queue.get(), 10))[1].seq != last:
                    pass
            reader.unsubscribe("done")
            for _ in range(200):
                if not sync.exists(out_stream("done")):
                    break
                await asyncio.sleep(0.01)
            assert not sync.exists(out_stream("done"))
            assert sync.xlen(out_stream("running")) == 1

            sync.xadd(out_stream("running"), OutputDelta(seq=1, error="out of pages", done=True).encode())
            contract.notify_outputs(sync, NOTIFY, ["running"])
            assert (await asyncio.wait_for(running.get(), 10))[1].final
            reader.unsubscribe("running")  # the last subscription: the reader still deletes it
            for _ in range(200):
                if not sync.exists(out_stream("running")):
                    break
                await asyncio.sleep(0.01)
            assert not sync.exists(out_stream("running"))
        finally:
            await stop(reader, task, client)

    asyncio.run(scenario())


def test_a_connection_killed_under_the_reader_costs_a_retry_not_the_requests(redis_client, redis_url):
    """A Redis restart leaves the reader's pooled connection dead; its next read fails once. The
    reader retries on a new connection before it gives up on its requests (before: the first
    request after a restart got a 503 while /ready already said 200). Redis truly down still
    fails them: the next test."""
    async def scenario():
        client = Redis.from_url(redis_url, client_name="reader-under-test")
        reader = OutputReader(client, NOTIFY)
        queue: asyncio.Queue = asyncio.Queue()
        reader.subscribe("k", queue)
        task = asyncio.create_task(reader.run())
        sync = redis.Redis.from_url(redis_url)
        try:
            await asyncio.sleep(0.2)  # the reader is blocked on the notify stream
            killed = 0
            for info in sync.client_list():
                if info.get("name") == "reader-under-test":
                    sync.client_kill_filter(_id=info["id"])
                    killed += 1
            assert killed >= 1
            await asyncio.sleep(0.1)
            sync.xadd(out_stream("k"), OutputDelta(seq=0, text="z", token_ids=[9]).encode())
            contract.notify_outputs(sync, NOTIFY, ["k"])
            rid, delta = await asyncio.wait_for(queue.get(), 10)
            assert rid == "k" and isinstance(delta, OutputDelta) and delta.text == "z"
        finally:
            await stop(reader, task, client)

    asyncio.run(scenario())


def test_redis_down_for_the_outage_time_fails_the_requests(monkeypatch):
    """A Redis that stays down fails the reader's requests (ReaderFailed: a 503 to the client) once
    it has failed for OUTAGE_S; one back within that time is waited for (test_worker_lifecycle)."""
    import api.outputs

    monkeypatch.setattr(api.outputs, "OUTAGE_S", 0.3)
    monkeypatch.setattr(api.outputs, "RETRY_S", 0.05)

    async def scenario():
        client = Redis.from_url("redis://127.0.0.1:1/0")  # nothing listens there
        reader = OutputReader(client, NOTIFY)
        queue: asyncio.Queue = asyncio.Queue()
        reader.subscribe("r", queue)
        task = asyncio.create_task(reader.run())
        try:
            rid, failure = await asyncio.wait_for(queue.get(), 10)
            assert rid == "r" and isinstance(failure, ReaderFailed)
            assert reader.active == 0
        finally:
            await stop(reader, task, client)

    asyncio.run(scenario())


def test_after_a_data_loss_only_requests_redis_no_longer_holds_fail(redis_client, redis_url):
    """fail_lost fails a request with neither a queue entry nor an output stream (lost with Redis's
    data), and none that is queued, has output, has had its final entry, or is still enqueuing."""
    async def scenario():
        client = Redis.from_url(redis_url)
        reader = OutputReader(client, NOTIFY)
        queues = {rid: asyncio.Queue() for rid in ("queued", "running", "lost", "done", "enqueuing")}
        subs = {rid: reader.subscribe(rid, queue) for rid, queue in queues.items()}
        try:
            subs["queued"].entry_id = redis_client.xadd(contract.REQUESTS, {"data": "{}"}).decode()
            redis_client.xadd(out_stream("running"), OutputDelta(seq=0, text="a", token_ids=[5]).encode())
            for rid in ("running", "lost", "done"):
                subs[rid].entry_id = "1-1"  # an entry of the Redis that was lost
            subs["done"].final = True
            assert await reader.fail_lost(client) == 1
            rid, failure = queues["lost"].get_nowait()
            assert rid == "lost" and isinstance(failure, RequestLost)
            assert all(queues[rid].empty() for rid in ("queued", "running", "done", "enqueuing"))
            assert reader.active == 4
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_tick_wakes_only_the_runs_past_a_deadline(monkeypatch):
    """TICK goes to the queues of subscriptions `overdue` names, once per queue, and to no other:
    a run with nothing to do is not woken (with 1024 streams open, waking all cost the API ~8 % of
    its CPU, session 48)."""
    import api.outputs

    monkeypatch.setattr(api.outputs, "TICK_S", 0.01)

    async def scenario():
        reader = OutputReader(None, NOTIFY)  # tick() never touches Redis
        late, shared, fresh = asyncio.Queue(), asyncio.Queue(), asyncio.Queue()
        reader.subscribe("late", late, started=1.0)
        reader.subscribe("multi-0", shared, started=2.0)  # one run of two prompts: one queue
        reader.subscribe("multi-1", shared, started=2.0)
        reader.subscribe("fresh", fresh, started=100.0)
        asked: list[float] = []

        def overdue(started: float) -> bool:
            asked.append(started)
            return started < 50.0

        task = asyncio.create_task(reader.tick(overdue))
        try:
            assert await asyncio.wait_for(late.get(), 5) == (None, api.outputs.TICK)
            assert await asyncio.wait_for(shared.get(), 5) == (None, api.outputs.TICK)
            await asyncio.sleep(0.05)
            assert fresh.empty() and {1.0, 2.0, 100.0} <= set(asked)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert shared.qsize() == late.qsize()  # one TICK a tick for the shared queue, not one per prompt
        finally:
            task.cancel()

    asyncio.run(scenario())
