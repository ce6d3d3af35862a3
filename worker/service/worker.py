"""The long-running worker: Redis requests in, engine steps, token deltas out.

Read top to bottom: start, install signal handlers, loop (take new work and cancels, step the
engine, publish), and always tear down (hand back what is unfinished, remove the heartbeat).
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import redis

from worker.contract import FinishReason, OutputDelta, RequestEvent, WorkerState, WorkerStats
from worker.engine.idle_compiles import idle_variants
from worker.engine.llm_engine import LLMEngine
from worker.engine.request_output import RequestOutput
from worker.engine.sampling_params import SamplingParams
from worker.heap import freeze_startup_heap
from worker.service.config import WorkerConfig
from worker.service.redis_io import Finished, Incoming, RedisIO
from worker.service.stream_interval import StreamInterval

log = logging.getLogger("redjax.worker")
STATS_WINDOW_S = 5.0
REPORT_INTERVAL_S = 0.25


@dataclass
class Active:
    """A request this worker is running."""

    incoming: Incoming
    params: SamplingParams
    next_seq: int
    started_at: float
    first_token_at: float | None = None
    completion_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: int = 0  # prompt tokens the prefix cache served


class Worker:
    def __init__(self, config: WorkerConfig, engine: LLMEngine, client: redis.Redis):
        self.config = config
        self.engine = engine
        # streams are running: a prompt whose step variant is not compiled waits for it (compiled in
        # the background) instead of every running sequence waiting (25-60 s on a GPU)
        engine.runner.prompts_wait = True
        self.io = RedisIO(config, client)
        self.stream = StreamInterval(config.stream_interval_ms / 1000.0)
        self.active: dict[str, Active] = {}
        self.state = WorkerState.STARTING
        self.started_at = time.time()
        self.finished_count = 0
        self._drain_deadline: float | None = None
        self._signal: int | None = None  # a signal the loop has not acted on yet
        self._window: collections.deque[_Counters] = collections.deque()
        self._stats_mark = self._counters(time.monotonic())  # where the last stats log line left off
        self._compiles_mark: tuple[int, float] | None = None  # the runner's compiles when the warm-up ended
        self._idle_compiling = False  # the idle queue's last variant is still compiling

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT, then drain; returns the process exit code."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        # in the fleet from now on, as "starting": the API queues requests for this worker instead of
        # failing them for want of one, and /ready waits. The capacity stays 0 until the loop below
        # sets it, so nothing is pulled or claimed during the warm-up's compiles.
        self._report()
        self.io.start()
        if self.config.warmup:
            t0 = time.perf_counter()
            n = self.engine.warmup()
            log.info("worker %s warmed up %d step variants in %.1f s", self.config.name, n, time.perf_counter() - t0)
            runner = self.engine.runner  # and those warm-up left out: compiled while idle
            runner.idle_queue = idle_variants((*runner.compiled, *runner.ready), self.engine.config.max_logprobs,
                                              self.engine.max_model_len)
        freeze_startup_heap()  # the model, tokenizer and compiled steps: out of the collector's walks
        if self.state is WorkerState.STARTING:  # not if a SIGTERM came during the warm-up (draining)
            self.state = WorkerState.SERVING
        self._compiles_mark = self.engine.runner.compiles.reading()  # what compiles from here on is counted
        log.info("worker %s serving %s (attention: %s, matmul: %s, quantization: %s, KV pages: %d of %s, greedy head: "
                 "%s, sampler: %s, fused decode steps: %d)", self.config.name, self.config.model_name,
                 self.engine.attention, self.engine.matmul, self.engine.quantization or "none",
                 self.engine.runner.kv.num_pages, self.engine.runner.kv.dtype, self.engine.greedy_head,
                 self.engine.sampler, self.engine.decode_steps)
        try:
            while not self._done():
                self._take_work()
                self.io.send()  # aborts and rejections: out before the step
                if self.engine.has_unfinished():
                    self._publish(self.engine.step())
                    self.io.send()  # the step's deltas and finished requests: one batch
                else:
                    self._compile_idle()
                    self.io.wakeup.wait(0.05)
                    self.io.wakeup.clear()
                self._report()
        finally:
            self._log_signal()  # a signal that ended the loop before a turn of it saw the signal
            self._hand_back_rest()
            self.io.stop()
        log.info("worker %s stopped", self.config.name)
        return 0

    def _compile_idle(self) -> None:
        """Nothing to run: the runner's idle queue goes on compiling in the background
        (idle_compiles.py); a line once it is done."""
        runner = self.engine.runner
        if self.state is not WorkerState.SERVING or not (runner.idle_queue or self._idle_compiling):
            return
        self._idle_compiling = runner.compile_idle() > 0
        if not self._idle_compiling:
            counts = runner.compiles
            # what tracing and lowering those variants left alive (~100k objects for the demo model)
            # would otherwise be walked by every full collection while serving: 90 ms with the GIL held
            frozen = freeze_startup_heap()
            log.info("worker %s compiled %d step variants for penalties, logit bias and prompt logprobs while idle (%.1f s of "
                     "compiles; %d objects now out of the collector's walks)",
                     self.config.name, counts.idle, counts.idle_s, frozen)

    def _on_signal(self, signum, frame) -> None:
        # assignments only: Python runs the handler on the main thread between two of its
        # steps, perhaps inside an Event's lock (each loop turn sets or clears the capacity's
        # `_room` and `wakeup`), and taking that lock here would never return: a worker was left
        # running after its `redjax serve` was killed. The loop logs it within a turn (`_drain`)
        if self._drain_deadline is None:
            self._signal = signum
            self.state = WorkerState.DRAINING
            self._drain_deadline = time.monotonic() + self.config.drain_timeout_s
            self.io.stop_pulling()

    def _done(self) -> bool:
        if self._drain_deadline is None:
            return False
        return not self.active or time.monotonic() >= self._drain_deadline

    # ---- work in ----

    def _take_work(self) -> None:
        while not self.io.cancels.empty():
            request_id = self.io.cancels.get_nowait()
            if request_id in self.active:
                self._publish(self.engine.abort(request_id))
        while not self.io.inbox.empty():
            self._start(self.io.inbox.get_nowait())
        if self._drain_deadline is None:
            self.io.set_capacity(self._capacity())
        else:
            self._drain()

    def _capacity(self) -> int:
        """Requests to pull now: the free sequence slots, and once every slot holds one, `backlog`
        more waiting in the engine (so a step that frees slots refills them itself); none while KV
        pages are nearly gone. Slots first: with several workers on one queue, a burst fills every
        worker's slots before any worker's backlog (session 44: one of two workers had pulled 80 of
        128 requests at once, the other 48, and the second then idled while the first ran its 16)."""
        engine = self.engine
        if engine.pages_used > 0.9 * engine.pages_total:
            return 0
        free = engine.config.max_num_seqs - len(self.active)
        return free if free > 0 else max(0, free + self.config.backlog)

    def _start(self, incoming: Incoming) -> None:
        message = incoming.message
        now = time.time()
        try:
            params = SamplingParams.from_dict(message.params)
            if message.model != self.config.model_name:
                raise ValueError(f"this worker serves {self.config.model_name!r}, not {message.model!r}")
        except (ValueError, TypeError) as exc:
            return self._reject(incoming, str(exc))
        if incoming.failed and not incoming.cancelled:
            return self._reject(incoming, incoming.failed)
        active = Active(incoming, params, incoming.next_seq, now)
        self.active[message.id] = active
        for index, tokens in incoming.emitted.items():
            active.completion_tokens[index] = len(tokens)
        if incoming.cancelled:
            return self._publish([self._aborted(message.id, i, params) for i in range(params.n)])
        try:
            if incoming.emitted or incoming.finished:
                self.engine.resume_request(message.id, message.prompt_token_ids, params, incoming.emitted,
                                           incoming.finished, message.enqueued_at, incoming.held)
            else:
                self.engine.add_request(message.id, message.prompt_token_ids, params, message.enqueued_at)
        except ValueError as exc:
            del self.active[message.id]
            self._reject(incoming, str(exc))

    def _reject(self, incoming: Incoming, reason: str) -> None:
        message = incoming.message
        delta = OutputDelta(seq=incoming.next_seq, finish_reason=FinishReason.ERROR.value, error=reason, done=True,
                            usage=_usage(len(message.prompt_token_ids), 0))
        self.io.publish(message.id, [delta])
        now = time.time()
        event = RequestEvent(message.id, self.config.name, message.model, FinishReason.ERROR.value,
                             len(message.prompt_token_ids), 0, message.enqueued_at, now - message.enqueued_at,
                             0.0, 0.0, now - message.enqueued_at, now)
        self.io.finish(Finished(message.id, delta.usage or {}, event))

    # ---- work out ----

    def _publish(self, outputs: list[RequestOutput]) -> None:
        outputs = self.stream.take(outputs, time.monotonic(), len(self.active) / self.engine.config.max_num_seqs)
        by_request: dict[str, list[OutputDelta]] = {}
        done: list[Active] = []
        now = time.time()
        for out in outputs:
            active = self.active.get(out.request_id)
            if active is None:
                continue
            if out.token_ids and active.first_token_at is None:
                active.first_token_at = now
            active.completion_tokens[out.index] = active.completion_tokens.get(out.index, 0) + len(out.token_ids)
            active.cached_tokens = out.num_cached_tokens
            by_request.setdefault(out.request_id, []).append(OutputDelta(
                seq=self._next_seq(active), index=out.index, text=out.text, token_ids=out.token_ids,
                logprobs=out.logprobs or None, prompt_logprobs=out.prompt_logprobs,
                finish_reason=_reason(out.finish_reason), stop_reason=out.stop_reason,
            ))
            if out.request_finished:
                done.append(active)
        for active in done:
            rid = active.incoming.message.id
            usage = _usage(len(active.incoming.message.prompt_token_ids), sum(active.completion_tokens.values()),
                           active.cached_tokens)
            deltas = by_request.setdefault(rid, [])
            if deltas and deltas[-1].finish_reason:  # the request's last choice ended here: its delta ends it all
                deltas[-1].done, deltas[-1].usage = True, usage
            else:
                deltas.append(OutputDelta(seq=self._next_seq(active), done=True, usage=usage))
        for rid, deltas in by_request.items():
            self.io.publish(rid, deltas)
        for active in done:
            self._close(active, outputs)

    def _close(self, active: Active, outputs: list[RequestOutput]) -> None:
        message = active.incoming.message
        del self.active[message.id]
        self.finished_count += 1
        now = time.time()
        reasons = [o.finish_reason for o in outputs if o.request_id == message.id and o.finish_reason]
        n_out = sum(active.completion_tokens.values())
        first = active.first_token_at or now
        tpot = (now - first) / max(1, n_out - active.params.n)
        event = RequestEvent(
            id=message.id, worker=self.config.name, model=message.model,
            finish_reason=_reason(reasons[-1] if reasons else FinishReason.STOP) or "stop",
            prompt_tokens=len(message.prompt_token_ids), output_tokens=n_out, enqueued_at=message.enqueued_at,
            queue_s=max(0.0, active.started_at - message.enqueued_at), ttft_s=max(0.0, first - message.enqueued_at),
            tpot_s=tpot, e2e_s=max(0.0, now - message.enqueued_at), finished_at=now,
        )
        usage = _usage(len(message.prompt_token_ids), n_out, active.cached_tokens)
        self.io.finish(Finished(message.id, usage, event))

    def _aborted(self, request_id: str, index: int, params: SamplingParams) -> RequestOutput:
        return RequestOutput(request_id, index, [], "", finish_reason=FinishReason.ABORT.value,
                             request_finished=index == params.n - 1)

    def _next_seq(self, active: Active) -> int:
        active.next_seq += 1
        return active.next_seq - 1

    def _drain(self) -> None:
        """Draining (the handler has stopped the pulls): what waits unstarted goes back."""
        self._log_signal()
        self._return_backlog()

    def _log_signal(self) -> None:
        """The line the signal handler leaves to the loop (logging takes locks), once."""
        if self._signal is not None:
            log.info("worker %s draining (signal %d)", self.config.name, self._signal)
            self._signal = None

    def _return_backlog(self) -> None:
        """Draining: requests held but not started (and any a last pull brought in) go back on the
        queue at once, for another worker to start now, instead of waiting here for the deadline."""
        for request_id, active in list(self.active.items()):
            if active.next_seq == active.incoming.next_seq and self.engine.not_started(request_id):
                self.engine.abort(request_id)
                self.io.hand_back(active.incoming.message)
                del self.active[request_id]
                log.info("handed back queued request %s", request_id)

    def _hand_back_rest(self) -> None:
        """Whatever is still unfinished goes back on the queue for another worker to resume."""
        for request_id, active in list(self.active.items()):
            self.engine.abort(request_id)
            self.stream.forget(request_id)  # outputs held back were never published: regenerated on resume
            self.io.hand_back(active.incoming.message)
            log.info("handed back request %s", request_id)
        self.active.clear()

    # ---- heartbeat ----

    def _report(self) -> None:
        """Refresh the stats the heartbeat publishes (a few times per heartbeat interval)."""
        engine, now = self.engine, time.monotonic()
        self._log_stats(now)
        if self._window and now - self._window[-1].at < REPORT_INTERVAL_S:
            return
        self._window.append(last := self._counters(now))
        while len(self._window) > 2 and now - self._window[0].at > STATS_WINDOW_S:
            self._window.popleft()
        first = self._window[0]
        span, steps, lookups = max(now - first.at, 1e-6), last.steps - first.steps, last.lookups - first.lookups
        drafts = last.drafts - first.drafts
        compiles, stall_s = self._compiles_since_warmup()
        self.io.set_stats(WorkerStats(
            name=self.config.name, model=self.config.model_name, state=self.state.value, pid=os.getpid(),
            started_at=self.started_at, updated_at=time.time(), pages_used=engine.pages_used,
            pages_total=engine.pages_total, running=engine.num_running, waiting=engine.num_waiting,
            tokens_per_s=round((last.generated - first.generated) / span, 2),
            prompt_tokens_per_s=round((last.prompt - first.prompt) / span, 2),
            preemptions=engine.scheduler.num_preemptions, requests_finished=self.finished_count,
            mean_batch_size=round((last.step_seqs - first.step_seqs) / steps, 2) if steps else 0.0,
            max_num_seqs=engine.config.max_num_seqs,
            prefix_cache_hit_rate=round((last.hits - first.hits) / lookups, 4) if lookups else 0.0,
            draft_acceptance_rate=round((last.stood - first.stood) / drafts, 4) if drafts else 0.0,
            draft_gate=" ".join(f"{n}:{kind}" for n, kind in engine.scheduler.gate.choices().items()),
            step_compiles=compiles, compile_stall_s=round(stall_s, 3),
            # (the idle queue counts until the worker has frozen what it left: _compile_idle)
            compiles_pending=max(len(engine.runner.idle_queue) + len(engine.runner.compiling), int(self._idle_compiling)),
        ))

    def _compiles_since_warmup(self) -> tuple[int, float]:
        """Step variants compiled since the warm-up ended, and the seconds the engine thread waited
        for them (variant_compiles.py); none while it is still warming up."""
        if self._compiles_mark is None:
            return 0, 0.0
        (n, stall_s), (n0, stall0_s) = self.engine.runner.compiles.reading(), self._compiles_mark
        return n - n0, stall_s - stall0_s

    def _counters(self, now: float) -> "_Counters":
        engine = self.engine
        return _Counters(now, engine.num_generated_tokens, engine.num_prompt_tokens, engine.num_steps,
                         engine.num_step_seqs, engine.scheduler.num_lookup_tokens, engine.scheduler.num_hit_tokens,
                         engine.num_draft_tokens, engine.num_accepted_tokens)

    def _log_stats(self, now: float) -> None:
        """One line every log_stats_interval_s while there is work (counts only, never text)."""
        interval, before = self.config.log_stats_interval_s, self._stats_mark
        if interval <= 0 or now - before.at < interval:
            return
        self._stats_mark = mark = self._counters(now)
        if (mark.prompt, mark.generated) == (before.prompt, before.generated) and not self.active:
            return  # idle: nothing to say
        engine, span = self.engine, now - before.at
        log.info("worker %s: prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV pages %.1f%% used, "
                 "prefix cache hits %.1f%% of prompt tokens", self.config.name, (mark.prompt - before.prompt) / span,
                 (mark.generated - before.generated) / span, engine.num_running, engine.num_waiting,
                 100.0 * engine.pages_used / max(1, engine.pages_total),
                 100.0 * (mark.hits - before.hits) / max(1, mark.lookups - before.lookups))
        if engine.config.speculative_tokens:
            drafts = mark.drafts - before.drafts
            chosen = ", ".join(f"{n}+ sequences {kind}" for n, kind in engine.scheduler.gate.choices().items())
            log.info("worker %s: speculation: %d draft tokens checked, %.1f%% stood (%.1f%% of generated tokens); "
                     "drafts or fused steps: %s", self.config.name, drafts,
                     100.0 * (mark.stood - before.stood) / max(1, drafts),
                     100.0 * (mark.stood - before.stood) / max(1, mark.generated - before.generated),
                     chosen or "not measured yet")


class _Counters(NamedTuple):
    """The engine's running totals at one moment (rates are differences of two)."""

    at: float  # time.monotonic()
    generated: int
    prompt: int
    steps: int
    step_seqs: int
    lookups: int  # prompt tokens looked up in the prefix cache
    hits: int  # of which it served
    drafts: int  # speculation: draft tokens checked
    stood: int  # of which the model's draws confirmed


def _usage(prompt: int, completion: int, cached: int = 0) -> dict:
    """OpenAI's usage object; `cached`: prompt tokens the prefix cache served."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _reason(reason) -> str | None:
    return None if reason is None else getattr(reason, "value", reason)
