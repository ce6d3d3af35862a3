"""Host memory for the CPU backend: freed memory kept inside the process (glibc malloc) instead of
handed back to the OS, and the long-lived arrays (KV pages, weights) on 2 MiB pages.

On the CPU backend XLA allocates each step's temporaries (gathered KV pages, activations) with
malloc and frees them when the step ends. glibc serves blocks that large with fresh `mmap`s and
returns them on free, so every step page-faults all of that memory in again: on a 2-core VM the
faults cost more than the attention arithmetic. With mmap off, no trimming and one arena, freed
blocks are reused by the next step and the process stays at its peak size, which is what a
long-running worker wants anyway (vLLM and JetStream preallocate for the same reason).

It must run before JAX starts its thread pools (threads that already own a malloc arena keep
it), so the CLI calls it before importing JAX. `REDJAX_RETAIN_HOST_MEMORY=0` turns it off.

A decode step reads every running sequence's KV pages, scattered over the pool, and every weight.
On 4 KiB pages that is a TLB miss every 4 KiB, and the hardware prefetchers stop at each page
boundary. `huge_pages` asks Linux to back those arrays with transparent huge pages
(`MADV_HUGEPAGE`) and to do it now (`MADV_COLLAPSE`, Linux 6.1 and later) rather than whenever
khugepaged gets there. Many systems only give huge pages to memory that asks for them
(`/sys/kernel/mm/transparent_hugepage/enabled` = madvise, as on this project's VMs; with `always`
a large allocation gets them only where its faults happen to fill whole aligned 2 MiB). On the 2-core Intel VM (session 39) the
demo's decode attention over its four layers' pages took 1.12-1.23x as long on 4 KiB pages, in
one process alternating between two pools. `REDJAX_HUGE_PAGES=0` turns it off.
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Iterable

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20
COLLAPSE_TRIES = 3  # MADV_COLLAPSE fails with EAGAIN on a transient state of a page (written meanwhile)


def retain_freed_memory() -> bool:
    """Configure glibc malloc to keep freed memory; False where that is off or not glibc."""
    if _off("REDJAX_RETAIN_HOST_MEMORY"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl): leave the allocator alone
        return False
    settings = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1), (M_ARENA_MAX, 1))
    return all(mallopt(option, value) == 1 for option, value in settings)


def huge_pages(arrays: Iterable) -> int:
    """Back the host memory of `arrays` (CPU jax arrays) with 2 MiB pages; -> bytes advised and
    collapsed. Buffers less than a huge page apart are taken as one span (what lies between them is
    the process's own heap), so neighbouring arrays smaller than 2 MiB share its pages; only whole
    2 MiB pages inside a span are touched, and the data stay as they are. 0 where it is off,
    not Linux, or the kernel refuses (then the memory stays on 4 KiB pages, as before)."""
    if _off("REDJAX_HUGE_PAGES"):
        return 0
    try:
        madvise = ctypes.CDLL("libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for lo, hi in huge_spans(_buffers(arrays)):
        if madvise(lo, hi - lo, MADV_HUGEPAGE) != 0:
            continue
        for _ in range(COLLAPSE_TRIES):
            if madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
                done += hi - lo
                break
            if ctypes.get_errno() != errno.EAGAIN:
                break
    return done


def huge_spans(buffers: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(address, bytes) of buffers -> the [start, end) ranges of whole huge pages inside them, buffers
    closer than a huge page apart taken as one."""
    spans: list[list[int]] = []
    for start, size in sorted(buffers):
        if spans and start - spans[-1][1] < HUGE_PAGE:
            spans[-1][1] = max(spans[-1][1], start + size)
        else:
            spans.append([start, start + size])
    aligned = ((-(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE) for start, end in spans)
    return [(lo, hi) for lo, hi in aligned if hi > lo]


def _buffers(arrays: Iterable) -> Iterable[tuple[int, int]]:
    """(address, bytes) of each CPU buffer of `arrays`, once it holds its data (a buffer still being
    written, or not yet there, fails MADV_COLLAPSE)."""
    for array in arrays:
        array.block_until_ready()
        for shard in array.addressable_shards:
            if shard.device.platform == "cpu":
                yield shard.data.unsafe_buffer_pointer(), shard.data.nbytes


def _off(variable: str) -> bool:
    return os.environ.get(variable, "1").strip().lower() in ("0", "false", "no", "off")
