"""Keep freed host memory inside the process (glibc malloc) instead of handing it back to the OS.

On the CPU backend XLA allocates each step's temporaries (gathered KV pages, activations) with
malloc and frees them when the step ends. glibc serves blocks that large with fresh `mmap`s and
returns them on free, so every step page-faults all of that memory in again: on a 2-core VM the
faults cost more than the attention arithmetic. With mmap off, no trimming and one arena, freed
blocks are reused by the next step and the process stays at its peak size, which is what a
long-running worker wants anyway (vLLM and JetStream preallocate for the same reason).

It must run before JAX starts its thread pools (threads that already own a malloc arena keep
it), so the CLI calls it before importing JAX. `REDJAX_RETAIN_HOST_MEMORY=0` turns it off.

Loading a model frees far more than a step does (float weights once quantized or packed, copies
of the head): kept, that would be the process's size for good (llama3-8b with int4 projections:
11.5 GB held for 6.8 GB of arrays), and reused piecemeal it fragments the heap until an 8B model
that needs 17 GB is killed at 24. So the engine's builders load inside `loading()`: large blocks
are mapped and unmapped as they come and go, what the load left free is handed back, and then
freed memory is kept again.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Iterator

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
MMAP_MAX_DEFAULT = 65536  # glibc's M_MMAP_MAX when nothing set it


class Settings:
    """Whether this process keeps freed memory (`retain_freed_memory` succeeded): a record of the C
    library's settings, which are process-wide themselves."""

    retaining = False


def retain_freed_memory() -> bool:
    """Configure glibc malloc to keep freed memory; False where that is off or not glibc."""
    if os.environ.get("REDJAX_RETAIN_HOST_MEMORY", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl): leave the allocator alone
        return False
    settings = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1), (M_ARENA_MAX, 1))
    Settings.retaining = all(mallopt(option, value) == 1 for option, value in settings)
    return Settings.retaining


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Around a model's load and the engine's making: where this process keeps freed memory, large
    blocks are mapped while it runs (so each goes back to the OS as it is freed); after it, what
    it left free is handed back and freed memory is kept again."""
    mapping = Settings.retaining and ctypes.CDLL("libc.so.6").mallopt(M_MMAP_MAX, MMAP_MAX_DEFAULT) == 1
    try:
        yield
    finally:
        if mapping:
            ctypes.CDLL("libc.so.6").mallopt(M_MMAP_MAX, 0)
        hand_back_freed_memory()


def hand_back_freed_memory() -> bool:
    """Return the heap's free memory to the OS (glibc's malloc_trim: the free top of the heap and
    the free pages inside it); False where the C library is not glibc."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True
