"""The API's output reader against real Redis: it reads only the out_streams a notification names,
and every subscribed stream once per sweep (outputs written without a notification still arrive)."""

from __future__ import annotations

import asyncio

import redis
from redis.asyncio import Redis

from api.outputs import OutputReader
from worker import contract
from worker.contract import OutputDelta, out_stream

NOTIFY = contract.api_notify_stream("test-reader")


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
            reader.close()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.aclose()

    asyncio.run(scenario())
