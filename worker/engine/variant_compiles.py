"""Step-variant compiles: how many a runner made, how long its engine thread waited on them, and
the log line each one gets.

A compile takes a core for 0.1 s to minutes (a GPU step: 25-60 s). One made on the engine thread
(a batch whose variant nothing compiled covers, or the warm-up's) stops every stream of the
worker meanwhile; one made in the background (runner._compile_in_background) only takes the core.
A worker publishes what it compiled after its warm-up (WorkerStats.step_compiles,
compile_stall_s), so a recompile under load shows on /metrics instead of as an unexplained stall.
What it compiles from its idle queue (ModelRunner.compile_idle: variants for requests warm-up
left out) is counted apart: the worker chose those, no request asked for them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("worker.engine.runner")  # the lines keep the runner's logger name


@dataclass
class CompileCounts:
    """Totals since the runner was built; background compile threads add to them too."""

    variants: int = 0  # step variants compiled: on the engine thread, ahead, in the background
    stall_s: float = 0.0  # seconds of those the engine thread spent waiting for them
    idle: int = 0  # variants compiled from the idle queue (not in `variants`)
    idle_s: float = 0.0  # seconds those took, each on a core of its own
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, seconds: float, *, stalled: bool, variants: int = 1) -> None:
        with self._lock:
            self.variants += variants
            self.stall_s += seconds if stalled else 0.0

    def add_idle(self, seconds: float) -> None:
        with self._lock:
            self.idle += 1
            self.idle_s += seconds

    def reading(self) -> tuple[int, float]:
        """(variants, stall_s), read together."""
        with self._lock:
            return self.variants, self.stall_s


def timed_compile(lowered) -> tuple[Any, float]:
    t0 = time.perf_counter()
    return lowered.compile(), time.perf_counter() - t0


def log_variant(what: str, shape, flags, seconds: float | None = None, level: int = logging.INFO) -> None:
    """One line naming a step variant (a StepShape and its SamplerFlags): rows, pages, sampler. Variants
    compiled by plan (ahead, or while idle) log at DEBUG, their counts at INFO: a worker plans ~100."""
    prefill = (f"{shape.num_prefill} packed in {shape.prefill_tokens} tokens" if shape.packed
               else f"{shape.num_prefill} x {shape.prefill_len}")
    took = "" if seconds is None else f" in {seconds:.1f} s"
    out_ids, prompt_ids, bias = flags.widths
    parts = {"top-k/top-p": flags.needs_cut, "top-p": flags.top_p, "min-p": flags.min_p, "rows apart": flags.apart,
             f"logprobs {flags.num_logprobs}": flags.logprobs,
             f"penalties {out_ids}x{prompt_ids}": flags.penalties, f"logit bias {bias}": flags.bias,
             "grammar mask": flags.mask_words}
    sampler = ["greedy" if flags.all_greedy else "sampled"] + [name for name, on in parts.items() if on]
    prefill += f", prompt logprobs {flags.num_logprobs} over {shape.scored} tokens" if shape.prompt_logprobs else ""
    prefill += ", drafts" if shape.drafts else ""
    log.log(level, "%s step variant: decode rows %d, prefill rows %s, pages %d, fused %d, sampler %s%s", what,
             shape.num_decode, prefill, shape.pages, shape.decode_steps, ", ".join(sampler), took)
