"""ApiServices: what the routes share (config, model, Redis, queue, reader, fleet watch), on app.state."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

from redis.asyncio import BlockingConnectionPool, Redis
from redis.exceptions import RedisError

from api.config import ApiConfig
from api.errors import ApiError
from api.fleet import FleetWatch
from api.model_info import ModelInfo
from api.outputs import BLOCK_MS, OutputReader
from api.queue import RequestQueue
from worker.contract import api_alive_key, api_notify_stream

log = logging.getLogger("redjax.api")

REDIS_TIMEOUT_S = 5.0  # connect timeout, and how long a request waits for a free pooled connection
REDIS_COMMAND_TIMEOUT_S = 15.0  # a command unanswered this long means Redis is gone (a busy host is not)
REDIS_POOL_SIZE = 32  # connections of the ordinary client; a burst of requests queues for them
STOP_RETRY_S = 0.05  # stop(): how long to wait for cancelled tasks before cancelling them again
# RESP2 named explicitly: with the protocol left to its default, redis-py 8.1's asyncio pool turns
# on "maintenance notifications" over TCP, which skips the check that replaces a pooled connection
# the server closed. After a Redis restart every idle pooled connection failed its next command:
# 32 of the next 100 requests got a 503 while /ready said 200 (session 50; redis-py issue 4252).
REDIS_PROTOCOL = 2


@dataclass
class ApiServices:
    config: ApiConfig
    model: ModelInfo
    client: Redis  # short commands
    reader_client: Redis  # the output reader's blocking XREAD
    queue: RequestQueue
    reader: OutputReader
    fleet: FleetWatch
    tasks: list[asyncio.Task] = field(default_factory=list)

    @classmethod
    def create(cls, config: ApiConfig, model: ModelInfo) -> "ApiServices":
        """Build clients (no connection is made yet: Redis may come up after the API)."""
        pool = BlockingConnectionPool.from_url(
            config.redis_url, max_connections=REDIS_POOL_SIZE, timeout=REDIS_TIMEOUT_S,
            socket_timeout=REDIS_COMMAND_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S,
            protocol=REDIS_PROTOCOL, client_name="redjax-api",
        )
        client = Redis(connection_pool=pool)
        reader_client = Redis.from_url(
            config.redis_url, socket_timeout=REDIS_COMMAND_TIMEOUT_S + BLOCK_MS / 1000,
            socket_connect_timeout=REDIS_TIMEOUT_S, protocol=REDIS_PROTOCOL, client_name="redjax-api-reader",
        )
        notify = api_notify_stream(uuid.uuid4().hex)
        queue = RequestQueue(client, config.max_queue_len, notify)
        reader = OutputReader(reader_client, notify)

        async def fail_lost() -> None:
            if lost := await reader.fail_lost(client):
                log.warning("%d request(s) were lost with Redis's data: answered 503 request_lost", lost)

        return cls(
            config=config, model=model, client=client, reader_client=reader_client, queue=queue, reader=reader,
            fleet=FleetWatch(client, config.model_name, alive_key=api_alive_key(notify),
                             announce=lambda: queue.enqueued, on_data_loss=fail_lost),
        )  # fmt: skip

    async def start(self) -> None:
        self.tasks = [asyncio.create_task(self.reader.run(), name="output-reader"),
                      asyncio.create_task(self.reader.tick(lambda t: self.overdue(t) is not None),
                                          name="output-ticker"),
                      asyncio.create_task(self.fleet.run(), name="fleet-watch")]  # fmt: skip

    def overdue(self, started: float) -> ApiError | None:
        """The error that ends a run started at `started` (time.monotonic()) now, or None: 504 once it
        has run request_timeout_s, 503 once no live worker has served the model for no_worker_timeout_s
        of its time."""
        config = self.config
        if time.monotonic() - started >= config.request_timeout_s:
            return ApiError(504, f"the request did not finish within {config.request_timeout_s:g} s",
                            code="request_timeout")  # fmt: skip
        if self.fleet.missing_for(started) >= config.no_worker_timeout_s:
            message = (f"no worker serving {config.model_name} has been alive for "
                       f"{config.no_worker_timeout_s:g} s; the request was cancelled")  # fmt: skip
            return ApiError(503, message, code="no_worker")
        return None

    async def stop(self) -> None:
        """End the background tasks, then close the clients. One cancel is not always enough:
        redis-py 8 can swallow a cancellation that lands inside one of its calls (session 49: 70 of
        100 cancels of a task looping on SMEMBERS), and the task runs on. The fleet watch polls as
        soon as it starts, so when uvicorn could not bind its port and shut the app down at once,
        this waited on it for ever. Each task is cancelled again until it has ended."""
        self.reader.close()
        pending = set(self.tasks)
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=STOP_RETRY_S)
        try:  # workers drop whatever of ours is left at once instead of after API_ALIVE_TTL_S
            await self.client.delete(self.fleet.alive_key)
        except (RedisError, OSError):
            pass
        await self.client.aclose()
        await self.reader_client.aclose()
