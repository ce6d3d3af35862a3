"""The meeting points of a data-parallel `bench offline` run (worker/bench/barrier.py): real
processes, each arriving in its own time."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.stack_support import REPO
from worker.bench.barrier import Barrier

MEET = "import sys, time; from worker.bench.barrier import Barrier; time.sleep(float(sys.argv[2])); " \
       "came = time.monotonic(); print(*Barrier(sys.argv[1], 2).meet('start'), came, time.monotonic())"


def test_the_parties_go_on_together_once_all_have_arrived(tmp_path):
    # one arrives a second after the other: the first waits for it, and both leave knowing both pids
    procs = [subprocess.Popen([sys.executable, "-c", MEET, str(tmp_path), delay], cwd=REPO, stdout=subprocess.PIPE,
                              text=True) for delay in ("0", "1.0")]
    outs = [p.communicate(timeout=60)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    pids = sorted(p.pid for p in procs)
    assert [sorted(map(int, out[:2])) for out in outs] == [pids, pids]
    came, left = [float(out[2]) for out in outs], [float(out[3]) for out in outs]
    assert came[0] < came[1] and min(left) >= max(came)  # the early one left once the late one came, not before


def test_a_party_that_never_comes_is_an_error_not_a_hang(tmp_path):
    with pytest.raises(TimeoutError, match="1 of 2 processes reached 'start'"):
        Barrier(str(tmp_path), 2).meet("start", timeout_s=0.05)


@pytest.mark.parametrize("text", ["dir", "dir:0", "dir:x", ":2"])
def test_barrier_text_is_dir_and_a_count(text):
    with pytest.raises(ValueError):
        Barrier.parse(text)
    assert Barrier.parse("/tmp/a:b:3") == Barrier("/tmp/a:b", 3)
