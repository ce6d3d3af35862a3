"""`redjax serve --workers N` on one machine: each worker its own run of cores (worker/service/cores.py)
and its share of the KV memory fraction."""

from __future__ import annotations

import pytest

from worker.engine.config import EngineConfig
from worker.service.cores import kv_share, split_cores


@pytest.mark.parametrize("cores,workers,runs", [
    ([0, 1], 2, [(0,), (1,)]),
    ([3, 1, 2, 0], 2, [(0, 1), (2, 3)]),  # sorted, consecutive
    (range(16), 3, [(0, 1, 2, 3, 4, 5), (6, 7, 8, 9, 10), (11, 12, 13, 14, 15)]),  # the first one core larger
    ([4, 5, 6], 3, [(4,), (5,), (6,)]),
    ([0, 1], 1, None),  # one worker: all of them
    ([0, 1], 3, None),  # more workers than cores: nothing to split
])  # fmt: skip
def test_split_cores_gives_each_worker_a_disjoint_run(cores, workers, runs):
    got = split_cores(list(cores), workers)
    assert got == runs
    if got:
        flat = [c for run in got for c in run]
        assert sorted(flat) == sorted(cores) and len(set(flat)) == len(flat)


def test_each_worker_takes_its_share_of_the_kv_memory_fraction():
    engine = EngineConfig()
    assert kv_share({"max_num_seqs": 8}, 2, engine) == {"max_num_seqs": 8, "kv_cache_memory_fraction": 0.25}
    configured = EngineConfig(kv_cache_memory_fraction=0.6)  # by a flag or REDJAX_KV_CACHE_MEMORY_FRACTION
    assert kv_share({}, 3, configured) == {"kv_cache_memory_fraction": pytest.approx(0.2)}
    assert kv_share({"num_pages": 64}, 2, EngineConfig(num_pages=64)) == {"num_pages": 64}  # pages given outright
    assert kv_share({}, 1, engine) == {}


def test_children_started_in_the_block_run_on_its_cores():
    import os
    import subprocess
    import sys

    from worker.service.cores import children_on

    mine = os.sched_getaffinity(0)
    first = min(mine)
    with children_on((first,)):
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str([first]) and os.sched_getaffinity(0) == mine  # this thread as before
    with children_on(None):
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(sorted(mine))
