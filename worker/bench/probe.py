"""Host-side timing of `LLMEngine.step()` pieces, measured from outside the engine.

Thin wrappers are installed on one engine instance (never on the classes or modules), so the
engine's behaviour is unchanged: `scheduler.schedule`, `runner.dispatch` (batch building plus
the asynchronous jit launch, `runner._run`, timed on its own) and `_postprocess`, whose wrapper
first waits for the device (what `_postprocess` would do first anyway) so that wait is not
counted as host work. Each phase keeps the four parts' sums as well as their total, so a host
share that is too large says where it goes (session 29's H200 spent ~12 ms of host time a call).

With async overlap, call k schedules batch k and reads back batch k-1, so each call is
attributed to the batch it reads back (the first call, reading nothing, to the one it schedules).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import jax

from worker.engine.runner import landed


@dataclass
class PhaseTimes:
    """Sums over the step() calls attributed to one kind of batch."""

    calls: int = 0
    wall_s: float = 0.0
    host_s: float = 0.0  # schedule + dispatch + postprocess (device wait excluded); of which:
    schedule_s: float = 0.0  # the scheduler's decisions
    build_s: float = 0.0  # the device batch's inputs (dispatch less its launch)
    launch_s: float = 0.0  # the jitted step's call (argument handling, the asynchronous launch)
    launch_thread_s: float = 0.0  # the same on the engine's launch thread (launch_thread): not in host_s
    postprocess_s: float = 0.0  # tokens read back, detokenized, stop checks, outputs
    wait_s: float = 0.0  # blocked on the device
    decode_steps: int = 0  # fused steps count each
    prefill_tokens: int = 0
    batch_rows: int = 0  # sum of sequences over decode steps (mean batch = batch_rows / decode_steps)
    context_tokens: float = 0.0  # sum over decode rows (prefill: prompt tokens computed) of the context read
    shared_tokens: float = 0.0  # of which in pages an earlier row of the same step reads too (prefix cache)

    def as_dict(self) -> dict:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in vars(self).items()}


@dataclass
class StepProbe:
    decode: PhaseTimes = field(default_factory=PhaseTimes)
    prefill: PhaseTimes = field(default_factory=PhaseTimes)  # any batch with a prefill chunk
    page_size: int = 0  # the engine's, set by install
    _repeated: dict = field(default_factory=dict)  # id(batch) -> its repeated pages, taken when scheduled
    _parts: dict = field(default_factory=dict)  # this step's host seconds by part
    _wait: float = 0.0
    _scheduled: object = None
    _read_back: object = None
    _stepping: int | None = None  # the thread running step()
    _off_thread: list = field(default_factory=list)  # seconds of launches on the launch thread, not yet counted

    def install(self, engine) -> "StepProbe":
        schedule, dispatch, postprocess = engine.scheduler.schedule, engine.runner.dispatch, engine._postprocess
        launch = engine.runner._run
        self.page_size = engine.config.page_size

        def timed_schedule(*args, **kwargs):
            t0 = time.perf_counter()
            batch = schedule(*args, **kwargs)
            self._count("schedule", time.perf_counter() - t0)
            self._scheduled = batch
            if batch is not None and batch.is_pure_decode:  # while the tables are whole: a finished sequence's are emptied
                self._repeated[id(batch)] = _repeated_pages(batch)
            return batch

        def timed_dispatch(batch):
            t0 = time.perf_counter()
            flight = dispatch(batch)
            self._count("build", time.perf_counter() - t0)  # less the launch, counted apart below
            return flight

        def timed_launch(*args):
            t0 = time.perf_counter()
            out = launch(*args)
            seconds = time.perf_counter() - t0
            if threading.get_ident() != self._stepping:  # the launch thread: counted once read back
                self._off_thread.append(seconds)
                return out
            self._count("launch", seconds)
            self._count("build", -seconds)
            return out

        def timed_postprocess(flight):
            t0 = time.perf_counter()
            jax.block_until_ready(landed(flight.out))  # with a launch thread, its call has returned
            while self._off_thread:
                self._count("launch_thread", self._off_thread.pop(0))
            t1 = time.perf_counter()
            out = postprocess(flight)
            self._wait += t1 - t0
            self._count("postprocess", time.perf_counter() - t1)
            self._read_back = flight.batch
            return out

        engine.scheduler.schedule = timed_schedule
        engine.runner.dispatch = timed_dispatch
        engine.runner._run = timed_launch
        engine._postprocess = timed_postprocess
        return self

    @property
    def last_scheduled(self):
        """The batch the last `step()` scheduled (and launched), or None."""
        return self._scheduled

    def _count(self, part: str, seconds: float) -> None:
        self._parts[part] = self._parts.get(part, 0.0) + seconds

    def step(self, engine) -> list:
        """One engine.step(), timed and attributed."""
        self._parts, self._wait = {}, 0.0
        self._scheduled = self._read_back = None
        self._stepping = threading.get_ident()
        t0 = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - t0
        batch = self._read_back or self._scheduled
        if batch is not None and batch.chunks:
            self._add(batch, wall, counted=self._read_back is not None)
        return outputs

    def _add(self, batch, wall: float, counted: bool) -> None:
        phase = self.decode if batch.is_pure_decode else self.prefill
        phase.calls += 1
        phase.wall_s += wall
        for part, seconds in self._parts.items():
            setattr(phase, f"{part}_s", getattr(phase, f"{part}_s") + seconds)
            phase.host_s += 0.0 if part == "launch_thread" else seconds  # the engine thread's time only
        phase.wait_s += self._wait
        if not counted:  # the same batch is counted when it is read back
            return
        if batch.is_pure_decode:
            phase.decode_steps += batch.num_steps
            phase.batch_rows += sum(c.num_steps for c in batch.chunks)
            phase.context_tokens += sum(c.num_steps * (c.start + 1) + c.num_steps * (c.num_steps - 1) / 2
                                        for c in batch.chunks)
            phase.shared_tokens += batch.num_steps * self._repeated.pop(id(batch), 0) * self.page_size
        else:
            chunks = [c for c in batch.chunks if c.num_tokens > 1]
            phase.prefill_tokens += sum(c.num_tokens for c in chunks)
            # causal: the i-th token of a chunk from `start` sees start + i + 1 keys
            phase.context_tokens += sum(c.num_tokens * c.start + c.num_tokens * (c.num_tokens + 1) / 2 for c in chunks)


def _repeated_pages(batch) -> int:
    """Pages the rows' page tables hold beyond their first holder: full prompt pages the prefix
    cache gave several sequences, read from memory once a step by an ideal kernel."""
    tables = [c.seq.page_table for c in batch.chunks]
    return sum(map(len, tables)) - len(set().union(*tables))
