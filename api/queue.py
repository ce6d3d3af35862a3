"""The request queue as the API sees it: enqueue (or 429), withdraw (cancel), worker liveness."""

from __future__ import annotations

from redis.asyncio import Redis

from api.errors import ApiError
from worker import contract
from worker.contract import RequestMessage, WorkerState

# KEYS: requests stream, totals hash, this API's alive key. ARGV: group, max_queue_len, rejected
# field, enqueued field, alive TTL, then one encoded RequestMessage per request.
# Atomic, so concurrent enqueues cannot push the queue past its limit, and no request is queued
# without its API's alive key. Returns the entry ids, or an empty list when the queue is full.
_ENQUEUE = """
redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
local count = #ARGV - 5
if redis.call('XLEN', KEYS[1]) + count > tonumber(ARGV[2]) then
  redis.call('HINCRBY', KEYS[2], ARGV[3], count)
  return {}
end
redis.call('SET', KEYS[3], '1', 'EX', ARGV[5])
local ids = {}
for i = 6, #ARGV do ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'data', ARGV[i]) end
redis.call('HINCRBY', KEYS[2], ARGV[4], count)
return ids
"""

# KEYS: requests stream. ARGV: group, entry id. Deletes the entry when no worker has taken it
# (it is in no consumer's pending list). Returns 1 if deleted.
_REMOVE_UNDELIVERED = """
local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if type(pending) == 'table' and pending.err == nil and #pending > 0 then return 0 end
return redis.call('XDEL', KEYS[1], ARGV[2])
"""


class RequestQueue:
    def __init__(self, client: Redis, max_queue_len: int, notify_stream: str) -> None:
        self.client = client
        self.max_queue_len = max_queue_len
        self.notify_stream = notify_stream  # where workers announce these requests' outputs
        self._enqueue = client.register_script(_ENQUEUE)
        self._remove = client.register_script(_REMOVE_UNDELIVERED)
        self.enqueued = False  # whether a request was enqueued: from then on this API's alive key is kept

    async def enqueue(self, messages: list[RequestMessage]) -> list[str]:
        """XADD every message (all or none); their stream entry ids. 429 when the queue is full."""
        for m in messages:
            m.notify = self.notify_stream
        args = [contract.WORKERS_GROUP, self.max_queue_len, contract.TOTAL_REJECTED, contract.TOTAL_ENQUEUED,
                contract.API_ALIVE_TTL_S, *(m.encode()["data"] for m in messages)]  # fmt: skip
        keys = [contract.REQUESTS, contract.TOTALS, contract.api_alive_key(self.notify_stream)]
        ids = await self._enqueue(keys=keys, args=args)
        if not ids:
            raise ApiError(
                429, f"the server is busy ({self.max_queue_len} requests queued or running); retry later",
                code="queue_full", headers={"Retry-After": "1"},
            )  # fmt: skip
        self.enqueued = True
        return [i.decode() if isinstance(i, bytes) else str(i) for i in ids]

    async def withdraw(self, request_id: str, entry_id: str) -> bool:
        """Cancel a request: take it off the queue if no worker has it yet, and tell workers to drop it.

        Returns whether the entry was removed before any worker took it.
        """
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.set(contract.cancelled_key(request_id), "1", ex=contract.CANCEL_TTL_S)
            pipe.publish(contract.CANCEL_CHANNEL, request_id)
            await pipe.execute()
        removed = await self._remove(keys=[contract.REQUESTS], args=[contract.WORKERS_GROUP, entry_id])
        return bool(removed)


async def live_workers(client: Redis, model: str) -> dict[str, str]:
    """Workers whose heartbeat hash exists and that serve `model`: name -> state ("starting" while
    it compiles its step variants, then "serving", "draining" once stopping), sorted by name."""
    names = sorted(n.decode() if isinstance(n, bytes) else n for n in await client.smembers(contract.WORKERS))
    if not names:
        return {}
    async with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hmget(contract.worker_key(name), "model", "state")
        rows = await pipe.execute()
    serving = WorkerState.SERVING.value.encode()  # a hash without a state: written before states existed
    return {n: (state or serving).decode() for n, (m, state) in zip(names, rows)
            if m is not None and m.decode() == model}
