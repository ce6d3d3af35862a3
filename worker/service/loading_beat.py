"""LoadingBeat: the worker's heartbeat while its model loads, before there is an engine to report on.

A worker is in the fleet as "starting" from the moment its process has its configuration, so the
API queues requests for it (instead of failing them once no worker has been alive for its
no-worker limit) while the weights load, and `/ready` waits. The worker's own Redis threads take
the heartbeat over when it starts them; a load that fails removes it at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import redis

from worker import contract
from worker.contract import WorkerState, WorkerStats
from worker.service.config import WorkerConfig

log = logging.getLogger("redjax.worker")


class LoadingBeat:
    """`with LoadingBeat(config, client): engine = load()`: heartbeats every HEARTBEAT_INTERVAL_S."""

    def __init__(self, config: WorkerConfig, client: redis.Redis) -> None:
        self.config = config
        self.client = client
        self.started_at = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="loading-beat", daemon=True)

    def __enter__(self) -> "LoadingBeat":
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if exc_type is not None:  # the load failed: out of the fleet now, not when the hash expires
            try:
                self.client.delete(contract.worker_key(self.config.name))
            except redis.RedisError:
                pass

    def _beat(self) -> None:
        while True:
            stats = WorkerStats(
                name=self.config.name, model=self.config.model_name, state=WorkerState.STARTING.value,
                pid=os.getpid(), started_at=self.started_at, updated_at=time.time(), pages_used=0, pages_total=0,
                running=0, waiting=0, tokens_per_s=0.0, prompt_tokens_per_s=0.0, preemptions=0,
                requests_finished=0, mean_batch_size=0.0, max_num_seqs=self.config.engine.max_num_seqs,
            )  # fmt: skip
            try:
                contract.write_heartbeat(self.client, stats)
            except redis.RedisError as exc:  # Redis away: the worker's own threads will retry
                log.warning("redis error in the loading heartbeat: %s", type(exc).__name__)
            if self._stop.wait(contract.HEARTBEAT_INTERVAL_S):
                return
