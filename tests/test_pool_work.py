"""worker/engine/cpu_kernels/pool_work.h: a kernel's helper thread that starts on its caller's core
moves to another allowed core, and leaves its allowed cores as they were."""

import ctypes
import os
import shutil
import threading

import pytest

from worker.engine import cpu_build

SOURCE = r"""
#include <sched.h>
#include "pool_work.h"

// Puts the calling thread on core `caller` (with every core of its mask allowed again unless
// keep_one), calls leave_core as a helper of a caller there would, and reports where it ran next.
extern "C" int redjax_test_leave_core(int caller, int keep_one, int* mask_kept) {
  cpu_set_t before, one, after;
  sched_getaffinity(0, sizeof before, &before);
  CPU_ZERO(&one);
  CPU_SET(caller, &one);
  sched_setaffinity(0, sizeof one, &one);  // runs on `caller` from here
  if (!keep_one) sched_setaffinity(0, sizeof before, &before);  // still on `caller`
  redjax::leave_core(caller, 0);
  const int cpu = sched_getcpu();
  sched_getaffinity(0, sizeof after, &after);
  *mask_kept = CPU_EQUAL(&after, keep_one ? &one : &before);
  sched_setaffinity(0, sizeof before, &before);
  return cpu;
}
"""


@pytest.fixture(scope="module")
def leave_core(tmp_path_factory):
    """The test function above, built against the shipped header."""
    src = tmp_path_factory.mktemp("src")
    shutil.copy(cpu_build.KERNELS / "pool_work.h", src)
    (src / "leave_core.cc").write_text(SOURCE)
    with pytest.MonkeyPatch.context() as patch:  # a cache of its own, for this build only
        patch.setenv("REDJAX_KERNEL_DIR", str(tmp_path_factory.mktemp("cache")))
        library = cpu_build.build(src / "leave_core.cc")
    assert library is not None, "the test's kernel did not build"
    fn = ctypes.CDLL(str(library)).redjax_test_leave_core

    def call(caller: int, keep_one: bool) -> tuple[int, bool]:
        out, kept = [], ctypes.c_int(0)
        # on a thread of its own: the test's thread keeps its cores whatever happens
        thread = threading.Thread(target=lambda: out.append(fn(caller, int(keep_one), ctypes.byref(kept))))
        thread.start()
        thread.join()
        return out[0], bool(kept.value)

    return call


def test_a_helper_on_its_callers_core_moves_to_another_and_keeps_its_mask(leave_core):
    cores = sorted(os.sched_getaffinity(0))
    caller = cores[0]
    cpu, kept = leave_core(caller, keep_one=False)
    assert kept  # every core it was allowed before is allowed again
    if len(cores) >= 2:
        assert cpu != caller and cpu in cores
    else:  # one core: nowhere to go
        assert cpu == caller


def test_a_helper_allowed_only_its_callers_core_stays(leave_core):
    caller = sorted(os.sched_getaffinity(0))[-1]
    cpu, kept = leave_core(caller, keep_one=True)
    assert cpu == caller and kept
