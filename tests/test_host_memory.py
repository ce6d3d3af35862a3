"""worker/host_memory.py: the long-lived arrays of a CPU engine on 2 MiB pages, checked in the
kernel's own accounting (/proc/self/smaps), with their data unchanged."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from worker import host_memory as hm

MIB = 1 << 20
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_bytes_in(start: int, end: int) -> int:
    """AnonHugePages of the mappings overlapping [start, end), from /proc/self/smaps."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "lo-hi perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and hi > start
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


def test_spans_merge_neighbours_and_keep_whole_huge_pages_only():
    h = hm.HUGE_PAGE
    buffers = [
        (10 * h + 100, h),  # ends at 11 h + 100
        (11 * h + 100 + h // 2, 2 * h),  # half a huge page after it: the same span, to 13 h + 100 + h / 2
        (20 * h + 1, h),  # alone and smaller than an aligned huge page: nothing
        (30 * h, 3 * h),  # aligned: all of it
    ]
    assert hm.huge_spans(reversed(buffers)) == [(11 * h, 13 * h), (30 * h, 33 * h)]


def test_an_arrays_memory_moves_to_huge_pages_with_its_data(monkeypatch):
    monkeypatch.delenv("REDJAX_HUGE_PAGES", raising=False)
    values = np.random.default_rng(0).standard_normal(16 * MIB // 4, dtype=np.float32)
    x = jnp.asarray(values)  # 16 MiB on the CPU device
    start = x.unsafe_buffer_pointer()
    before = huge_bytes_in(start, start + x.nbytes)
    done = hm.huge_pages([x])
    if "[never]" in THP.read_text():  # the kernel gives no process huge pages: nothing is claimed
        assert done == 0
        return
    assert done >= 14 * MIB  # every aligned 2 MiB page inside the 16 MiB
    assert huge_bytes_in(start, start + x.nbytes) - before >= done
    np.testing.assert_array_equal(np.asarray(x), values)
    assert x.unsafe_buffer_pointer() == start  # the same buffer, now on other pages


def test_switched_off_it_leaves_memory_alone(monkeypatch):
    monkeypatch.setenv("REDJAX_HUGE_PAGES", "0")
    x = jnp.ones(64 * MIB // 4, jnp.float32)  # larger than anything freed before: mostly fresh pages
    start = x.unsafe_buffer_pointer()
    before = huge_bytes_in(start, start + x.nbytes)
    assert before < x.nbytes - 8 * MIB  # room for a collapse to show
    assert hm.huge_pages([x]) == 0
    assert huge_bytes_in(start, start + x.nbytes) == before
