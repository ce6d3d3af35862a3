"""The startup heap of a long-running process, and the cyclic garbage collector.

A serving process allocates many short-lived containers per streamed token (dicts, tasks,
deltas); every so often the collector's oldest generation walks everything alive, and in a
process holding a tokenizer, model metadata and compiled steps that walk is the expensive part:
it took about a quarter of the API's CPU time in a 256-request streaming run. Freezing the heap
once startup is done moves all of it out of the collector's reach; collections then traverse only
what serving allocated since. Frozen objects are never freed, which is what startup state is for.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then freeze everything alive now. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
