"""How `redjax serve --workers N` shares one machine: each worker its own run of cores, and its
share of the memory the KV caches are sized from.

A CPU engine spreads every kernel call over the cores it may use, and its threads meet at the end
of each call. When other processes share those cores (the API, Redis, another worker), a thread
taken off its core holds its partners at that meeting, so a core-second taken from the engine
costs it about two (benchmark-log.md, session 24). Workers pinned to disjoint cores meet only
among their own threads, and what another process takes delays one worker alone. Measured on the
2-core AMD host (session 44), the demo model at saturation: two workers of one core each served
12.2-14.1k output tok/s against 11.0-11.9k for one worker over both cores; the engine alone, two
processes of one core each against one over both: 17.7-18.1k against 14.7-15.2k (llama-100m:
1128 against 1040).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

from worker.engine.config import EngineConfig


def split_cores(cores: Sequence[int], workers: int) -> list[tuple[int, ...]] | None:
    """`workers` disjoint runs of consecutive `cores`, as even as possible (the first ones one core
    larger); None when there is nothing to split: one worker, or more workers than cores."""
    if workers < 2 or workers > len(cores):
        return None
    ordered = sorted(cores)
    size, extra = divmod(len(ordered), workers)
    runs, start = [], 0
    for i in range(workers):
        end = start + size + (i < extra)
        runs.append(tuple(ordered[start:end]))
        start = end
    return runs


def kv_share(overrides: dict, workers: int, engine: EngineConfig) -> dict:
    """Engine overrides for each of `workers` workers on one machine, `engine` being what flags and
    REDJAX_* variables configure: every worker sizes its KV cache from the same free memory, so
    each takes 1/workers of the configured fraction. Pages given outright stay as given."""
    if workers < 2 or engine.num_pages is not None:
        return overrides
    return {**overrides, "kv_cache_memory_fraction": engine.kv_cache_memory_fraction / workers}


@contextlib.contextmanager
def children_on(cores: Sequence[int] | None) -> Iterator[None]:
    """Processes started by this thread inside the block run on `cores` (all of this thread's when
    None): the thread takes the mask for the moment, and a child inherits its starter's. No hook in
    the child, so a parent with threads (JAX's) can start it without a fork of its own."""
    if not cores:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
