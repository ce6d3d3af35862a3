"""ModelRunner: turns a ScheduledBatch into padded device arrays and runs the jitted step.

Layout of one step's flattened tokens `i32[T]`: decode tokens first (one per sequence, Sd rows
padded), then prefill chunks split into Sp rows of Qp tokens: T = Sd + Sp * Qp. Sd, Sp, Qp and
the page-table width P come from short ladders (P is fixed at the widest when the attention
reads only each row's own context), so the compiled variants are bounded by the product of
those ladders and the sampler flags; a batch of an uncompiled shape can also borrow a compiled
one it fits in (`_choose_shape`).

A decode token whose id is still on device (async overlap) is read from the previous step's
sampled tokens through `src`; the host never waits for it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from functools import lru_cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from worker.engine import head_choice
from worker.engine.batch import (MIN_DECODE_ROWS, DeviceBatch, StepShape, build_batch, empty_batch, fits,
                                 needs_arrays, pack, predicts_prompt, step_cost, unpack)
from worker.engine.kv_cache import KVCache
from worker.engine.paged_attention import JNP, AttentionOps
from worker.engine.sampler import SamplerFlags, SamplingKernels, SamplingTensors, has_penalties, log_probs, token_ranks
from worker.engine.scheduler import ScheduledBatch, ScheduledChunk
from worker.engine.variant_compiles import CompileCounts, log_variant, timed_compile
from worker.engine.variant_serves import serves, wider

log = logging.getLogger(__name__)

COMPILE_AFTER = 3  # an uncompiled shape that a compiled one covers is compiled (in the background)
# the third time a batch needs it...
BORROW_TOLERANCE = 1.3  # ...unless the cheapest covering variant costs at most this much more: a
# compile takes a core for seconds, a tenth of a step's padding is cheaper (2-core machines)
# variants compiled at once by compile_planned: half the host's cores, at most 8. One XLA CPU
# compile already keeps two cores busy: on the 2-core VM two at a time took a worker's warm-up
# from 30-33 s to 37.5 s, so there it is one at a time; a GPU host's 16 cores take 8
COMPILE_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))


class PromptsWait(Exception):
    """Raised through build_batch by _choose_shape: nothing compiled covers this batch, so some of
    its chunks wait while their variant compiles in the background and the others run without them
    (dispatch returns None; the engine dispatches the chunks `Runner.waits` lets through). `held`
    says which: "sampler" (the chunks of requests with penalties or logit bias), "prompt logprobs"
    (chunks with prompt tokens to score, `batch.predicts_prompt`) or "prompts" (a mixed batch's
    prompt chunks)."""

    def __init__(self, key: tuple, held: str = "prompts"):
        super().__init__("chunks wait for their step variant")
        self.key, self.held = key, held


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepOutput:
    tokens: jax.Array  # i32[K, MAXR]: sampled token per row for each of K fused steps
    logprobs: jax.Array  # f32[K, MAXR]
    top_ids: jax.Array  # i32[K, MAXR, N]
    top_logprobs: jax.Array  # f32[K, MAXR, N]
    prompt_logprobs: jax.Array  # f32[S] (or [0]): logprob of the next prompt token after each scored token
    prompt_top_ids: jax.Array  # i32[S, N]
    prompt_top_logprobs: jax.Array  # f32[S, N]
    prompt_ranks: jax.Array  # i32[S]: the next prompt token's rank among the vocabulary (1: the likeliest)


@dataclass
class InFlight:
    """A dispatched step whose results have not been read back."""

    batch: ScheduledBatch
    rows: list  # ScheduledChunk per sampled row, in row order
    starts: list[int]  # index in S (the scored tokens' outputs) of the first token of each row's chunk, if it scores
    shape: StepShape
    out: StepOutput | Future  # a Future with a launch thread (`landed` waits for its call to return)
    launched_at: float = field(default_factory=time.perf_counter)

    @property
    def penalised(self) -> bool:
        """A fused call holding a request with penalties: read back before the next batch is built,
        whose penalties count each earlier token (only the newest comes from the device: `pending`)."""
        return self.shape.decode_steps > 1 and any(c is not None and has_penalties(c.seq.params) for c in self.rows)

    @property
    def constrained(self) -> bool:
        """A call holding a sequence that follows a grammar: read back before the next batch is
        built, whose mask for it follows the token this call draws (grammar.py)."""
        return any(c is not None and c.seq.grammar is not None for c in self.rows)


class ModelRunner:
    def __init__(self, model, kv: KVCache, page_size: int, max_rows: int, max_logprobs: int, fused_steps: int = 1,
                 attention: AttentionOps = JNP, fixed_pages: int | None = None,
                 sampling_kernels: SamplingKernels | None = None, launch_thread: bool = False,
                 min_decode_rows: int = MIN_DECODE_ROWS):
        self.graphdef, state = nnx.split(model)
        # a flat tuple of arrays: jit flattens an nnx.State through Python callbacks on every call
        # (~0.3 ms for 110 leaves), a tuple in C++
        leaves, self.param_def = jax.tree_util.tree_flatten(state)
        self.params = tuple(leaves)
        self.cfg = model.cfg
        self.split = getattr(model, "greedy_head", None) is not None  # rows needing logits drawn apart (head_choice.py)
        self.kv = kv
        self.page_size = page_size
        self.max_rows = max_rows  # sampled rows of any step fit here (fixed: no recompiles)
        self.min_decode_rows = min_decode_rows  # a decode step's smallest rung (EngineConfig.min_decode_rows)
        self.max_logprobs = max_logprobs
        self.fused_steps = fused_steps  # steps of every fused decode call (LLMEngine.decode_steps)
        # last sampled token per row; committed like the pages (and like every step's outputs), so
        # warm-up traces each variant with the arguments serving calls it with
        self.prev_tokens = jax.device_put(jnp.zeros((max_rows,), jnp.int32), _replicated(kv.keys[0].sharding))
        self.prev_rows: dict[int, int] = {}  # seq_id -> row of the last dispatched step
        self.compiled: set[tuple] = set()  # (shape, flags) variants run through jit
        self.ready: dict[tuple, Any] = {}  # (shape, flags) -> executable compiled in the background
        self.compiling: set[tuple] = set()  # background compiles under way
        self.idle_queue: list[tuple] = []  # (shape, flags) to compile while the worker is idle (compile_idle)
        self.compiles = CompileCounts()  # every variant compiled, and the engine thread's wait for them
        # at most this many at once (EngineConfig.compile_threads): each takes a core from the steps
        self.background_compiles = COMPILE_THREADS
        self.wanted: dict[tuple, int] = {}  # uncompiled exact variants -> times a batch asked for them
        self.compile_after = COMPILE_AFTER  # 1: always compile the exact shape at once (benchmarks)
        # a serving worker sets this: a prompt whose mixed variant nothing covers waits for it to
        # compile in the background while the decode rows go on (PromptsWait). Off, such a batch
        # compiles its variant at once, and batches do not depend on how long compiles take
        self.prompts_wait = False
        self.wait_held = "prompts"  # what the last PromptsWait held back (`waits`)
        self._compile_next: tuple | None = None  # set by _choose_shape: compile this exact variant
        # while planning (LLMEngine.compile_ahead): the variants dispatches and precompiles asked
        # for, each with a batch of its shape; nothing runs on the device meanwhile
        self.planned: dict[tuple, DeviceBatch] | None = None
        self.attention = attention  # jnp or the compiled CPU kernel (same contract)
        self.fixed_pages = fixed_pages  # page-table width of every step (None: bucketed to the batch)
        # the graph definition is bound once: hashing it as a static argument on every call costs ms
        self._step = _jitted_step(self.graphdef, self.param_def, attention, sampling_kernels)
        # EngineConfig.launch_thread: each step's call runs on this one thread, in dispatch order, while
        # the engine thread reads back the step before and schedules the next
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="redjax-launch") if launch_thread else None

    def model(self):
        """The model module over the runner's weights (shared arrays, no copy)."""
        return nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self.param_def, self.params))

    def dispatch(self, batch: ScheduledBatch) -> InFlight | None:
        """Build the device batch and launch the step; returns without waiting for it. While
        planning, only record its variant: the step's outputs are zeros on the host. None: the
        batch's prompt chunks must wait for their variant, which is compiling in the background
        (`PromptsWait`; its compile starts once fewer than `background_compiles` run); dispatch its
        other chunks alone."""
        build = partial(build_batch, batch, self.prev_rows, self.page_size, self.max_rows, self.max_logprobs,
                        self.fused_steps, self.fixed_pages, self.attention.ragged is not None, self.split,
                        min_rows=self.min_decode_rows)
        try:
            db, shape, flags, rows, starts = build(self._choose_shape)
        except PromptsWait as wait:
            self.wait_held = wait.held
            if wait.key not in self.compiling and len(self.compiling) < self.background_compiles:
                log.info("%s wait for their step variant, compiling in the background; the others go on",
                         {"sampler": "penalty and logit-bias requests", "prompt logprobs": "prompt-logprob chunks",
                          "prompts": "prompt chunks"}[wait.held])
                self._compile_in_background(wait.key, build()[0])
            return None
        key = (shape, flags)
        if self.planned is not None:
            self._compile_next = None
            self.planned.setdefault(key, db)
            out = planned_output(shape, flags)
        else:
            if self._compile_next is not None:  # this batch borrowed a variant; compile its own meanwhile
                wanted, self._compile_next = self._compile_next, None
                self._compile_in_background(wanted, build()[0])
            out = self._launch(key, db)
        self.prev_rows = {c.seq.seq_id: r for r, c in enumerate(rows) if c is not None and c.samples}
        return InFlight(batch, rows, starts, shape, out)

    def waits(self, chunk: ScheduledChunk) -> bool:
        """Whether `chunk` is one the last `PromptsWait` held back."""
        if self.wait_held == "sampler":
            return needs_arrays(chunk.seq.params)
        return predicts_prompt(chunk) if self.wait_held == "prompt logprobs" else chunk.num_tokens > 1

    def _launch(self, key: tuple, db: DeviceBatch) -> StepOutput | Future:
        """The step's call; with a launch thread, its future there: the calls run one after another
        in dispatch order, each taking the pages and tokens the one before left."""
        if self._launcher is None:
            return self._run(key, db)
        return self._launcher.submit(lambda: self._run(key, db))  # `_run` as wrapped by then (bench probes)

    def _run(self, key: tuple, db: DeviceBatch) -> StepOutput:
        ready = self.ready.get(key)
        if ready is not None:
            self.kv, out, self.prev_tokens = ready(self.params, self.kv, pack(db), self.prev_tokens)
            return out
        shape, flags = key
        first = key not in self.compiled
        if first:
            self.compiled.add(key)
            log_variant("compiling", shape, flags)
        t0 = time.perf_counter()
        self.kv, out, self.prev_tokens = self._step(self.params, self.kv, pack(db), self.prev_tokens, shape=shape,
                                                    flags=flags)
        if first:  # the call returns once the variant is compiled and the step launched
            self.compiles.add(seconds := time.perf_counter() - t0, stalled=True)
            log.info("step variant compiled and launched in %.1f s", seconds)
        return out

    def _choose_shape(self, exact: StepShape, flags: SamplerFlags, num_decode: int, lengths: list[int],
                      pages: int, plain: int = 0, scored: int = 0) -> tuple[StepShape, SamplerFlags]:
        """The exact variant if compiled; else the cheapest compiled one the batch fits in: a shape
        at least as large, with sampler flags that do at least what the batch needs (`serves`: a
        request with top-p or logprobs runs in a variant warm-up compiled with them, instead of
        stopping every stream on the worker while its own compiles). A stall of seconds to compile
        a shape that arrival timing produced once costs more than padding a step. The exact variant
        is asked for (compiled in the background) once it has come up `compile_after` times, if
        the borrowed one pads more than BORROW_TOLERANCE or does sampler work the batch does not
        need; with nothing to borrow, the exact variant is compiled now, unless `prompts_wait` is on
        and some chunks can run without the rest: then requests with penalties or logit bias (only a
        variant with such arrays, as wide, serves them), else the `scored` chunks with prompt
        tokens to score (only a variant computing their logits serves them), else a mixed
        batch's prompt chunks, wait for their variant (`PromptsWait`)."""
        key = (exact, flags)
        planned = self.planned or {}
        if key in self.compiled or key in self.ready or key in planned:
            return key
        covering = [(s, f) for s, f in (*self.compiled, *self.ready, *planned) if serves(f, flags)
                    and s.decode_steps == exact.decode_steps and s.prompt_logprobs == exact.prompt_logprobs
                    and s.scored >= exact.scored
                    and s.drafts >= exact.drafts and fits(s, num_decode, lengths, pages)]
        if flags.penalties or flags.bias or flags.mask_words:  # only a variant with such arrays, as wide, serves these
            held, others = "sampler", plain  # (others: chunks that could run without the waiting ones)
        elif exact.prompt_logprobs:
            held, others = "prompt logprobs", num_decode + len(lengths) - scored
        else:
            held, others = "prompts", lengths and num_decode
        if not covering and self.prompts_wait and self.planned is None and others:
            # running sequences would stop for the compile (on a GPU 25-60 s for a 32-layer model): the
            # requests with penalties or logit bias, else those scoring their prompt, else the prompt
            # chunks, wait instead, and the rest run
            raise PromptsWait(key, held)
        if not covering or self.compile_after <= 1:
            return key
        # the batch's own flags first: padding costs at most the envelope ladder's step, while a
        # sampler that does more (top-k/top-p over the vocabulary) can cost more than the step
        # (wider penalty or bias arrays than the batch's count as its own flags: no compile for those)
        best = min(covering, key=lambda v: (not wider(v[1], flags), step_cost(v[0]), v[1].widths))
        if wider(best[1], flags) and step_cost(best[0]) <= BORROW_TOLERANCE * step_cost(exact):
            return best
        self.wanted[key] = self.wanted.get(key, 0) + 1
        if (self.wanted[key] >= self.compile_after and key not in self.compiling
                and len(self.compiling) < self.background_compiles):
            self._compile_next = key
        return best

    def precompile(self, shape: StepShape, flags: SamplerFlags) -> bool:
        """Compile variant (shape, flags) now, ahead of any batch that needs it (warm-up of shapes a
        real batch only borrows; while planning, add it to the plan); false if it was already there."""
        key = (shape, flags)
        if key in self.compiled or key in self.ready or key in (self.planned or {}):
            return False
        if self.planned is not None:
            self.planned[key] = empty_batch(shape, flags)
            return True
        self.ready[key], seconds = timed_compile(self._lower(key, empty_batch(shape, flags), self._specs()))
        self.compiles.add(seconds, stalled=True)
        log_variant("precompiled", shape, flags, seconds)
        return True

    def compile_planned(self, threads: int = COMPILE_THREADS) -> int:
        """End planning: compile each planned variant not compiled yet, lowered on this thread one
        after another and compiled on up to `threads` threads at once. Returns how many were
        compiled; one that fails is logged and left to jit, which compiles it when a batch needs it."""
        planned, self.planned = self.planned or {}, None
        todo = {key: db for key, db in planned.items() if key not in self.compiled and key not in self.ready}
        if not todo:
            return 0
        specs = self._specs()
        t0 = time.perf_counter()
        compiled = 0
        with ThreadPoolExecutor(min(threads, len(todo)), thread_name_prefix="redjax-compile") as pool:
            jobs = {pool.submit(timed_compile, self._lower(key, db, specs)): key for key, db in todo.items()}
            for job in as_completed(jobs):
                key = jobs[job]
                try:
                    self.ready[key], seconds = job.result()
                except Exception:  # noqa: BLE001
                    log.exception("compiling a planned step variant failed")
                    continue
                compiled += 1
                log_variant("compiled ahead", *key, seconds, level=logging.DEBUG)
        self.compiles.add(time.perf_counter() - t0, stalled=True, variants=compiled)  # waited for together
        log.info("%d planned step variants compiled in %.1f s (%d at a time)", compiled, time.perf_counter() - t0,
                 min(threads, len(todo)))
        return compiled

    def _specs(self) -> tuple:
        """Shapes, dtypes and shardings of (params, kv, prev_tokens): what a compile needs of them
        (taken on the stepping thread; the kv arrays themselves are donated by the next step)."""
        spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        return jax.tree.map(spec, (self.params, self.kv, self.prev_tokens))

    def _lower(self, key: tuple, db: DeviceBatch, specs: tuple):
        shape, flags = key
        return self._step.lower(*specs[:2], pack(db), specs[2], shape=shape, flags=flags)

    def compile_idle(self) -> int:
        """Called while the engine has nothing to run: start compiling the idle queue's next
        variants in the background, as many at once as `background_compiles` allows (the 2-core
        VM: one, so a request that comes meanwhile finds the other core free). Returns how many
        are queued or compiling."""
        while self.idle_queue and len(self.compiling) < self.background_compiles:
            key = self.idle_queue.pop(0)
            if key not in self.compiled and key not in self.ready and key not in self.compiling:
                self._compile_in_background(key, empty_batch(*key), idle=True)
        return len(self.idle_queue) + len(self.compiling)

    def _compile_in_background(self, key: tuple, db: DeviceBatch, idle: bool = False) -> None:
        """Compile variant `key` on a thread (the step keeps running borrowed variants meanwhile);
        the executable is used from the first dispatch after it is ready. `idle`: from the idle
        queue, counted apart (CompileCounts.idle)."""
        specs = self._specs()
        self.compiling.add(key)

        def work():
            try:
                self.ready[key], seconds = timed_compile(self._lower(key, db, specs))
                if idle:
                    self.compiles.add_idle(seconds)
                else:
                    self.compiles.add(seconds, stalled=False)
                log_variant("compiled while idle" if idle else "compiled in the background", *key, seconds,
                            level=logging.DEBUG if idle else logging.INFO)
            except Exception:  # the step still runs through jit when this shape comes up again
                log.exception("background compile of a step variant failed")
            finally:
                self.compiling.discard(key)

        # not a daemon: the interpreter waits for it at exit. A daemon thread inside XLA's compiler
        # when the process exits (a worker stopped mid-compile) is unwound through C++ frames that
        # do not allow it, and the process aborts ("FATAL: exception not rethrown", exit status 134)
        threading.Thread(target=work, name="redjax-compile").start()


def _replicated(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """A whole copy on every device of `sharding` (itself for one device)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return sharding


def planned_output(shape: StepShape, flags: SamplerFlags) -> StepOutput:
    """Host zeros shaped like a step's outputs: what a planned step, never run, reads back."""
    k, r, n = shape.decode_steps, shape.max_rows, flags.num_logprobs
    t = shape.scored if shape.prompt_logprobs else 0
    i32, f32 = (lambda *dims: np.zeros(dims, np.int32)), (lambda *dims: np.zeros(dims, np.float32))  # noqa: E731
    return StepOutput(i32(k, r), f32(k, r), i32(k, r, n), f32(k, r, n), f32(t), i32(t, n), f32(t, n), i32(t))


@lru_cache(maxsize=8)
def _jitted_step(graphdef, param_def, attention: AttentionOps, sampling_kernels):
    """The jitted step of one model structure, shared by every runner of it (so are its compiled
    variants: a new engine on the same model compiles nothing again)."""
    return jax.jit(partial(_step, graphdef, param_def, attention, sampling_kernels),
                   static_argnames=("shape", "flags"), donate_argnames=("kv",))


def _step(graphdef, param_def, attention: AttentionOps, sampling_kernels, params: tuple, kv: KVCache, host,
          prev_tokens, shape: StepShape, flags: SamplerFlags):
    db = unpack(host, shape, flags)  # host: i32[N], the batch's arrays end to end (`pack`)
    model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(param_def, params))
    cfg = model.cfg
    tokens = jnp.where(db.src >= 0, prev_tokens[jnp.maximum(db.src, 0)], db.tokens)  # i32[T]

    def forward(kv: KVCache, tokens, positions, slots, context_lens, prompt_lp: bool):
        # a step with prefill rows needs the last layer's outputs only at each row's sampled token
        # (its last): the trunk then runs that layer's queries and MLP on those rows alone, and
        # their attention is a decode-shaped call (one query per row at its last position)
        out_rows = db.sample_rows if shape.num_prefill and not prompt_lp else None
        last = cfg.num_layers - 1

        def attend(layer, q, k, v, cache):  # q [T, H, D] (or [R, H, D] for out_rows), k/v [T, KV, D]
            keys, values = cache
            if attention.write_decode is not None and not shape.num_prefill and not shape.drafts:  # one call
                out, kp, vp = attention.write_decode(q, k, v, slots, keys[layer], values[layer], db.page_tables,
                                                     positions, context_lens, cfg.window(layer))
            else:
                kp, vp = attention.write(keys[layer], values[layer], k, v, slots)
                out = attend_rows(layer, q, kp, vp)
            return out, (keys[:layer] + (kp,) + keys[layer + 1 :], values[:layer] + (vp,) + values[layer + 1 :])

        def attend_rows(layer, q, kp, vp):  # the step's rows over pages that hold this step's tokens
            if out_rows is not None and layer == last:
                return attention.decode(q, kp, vp, db.page_tables, positions[out_rows], context_lens, cfg.window(layer))
            if shape.packed:  # decode rows and packed prefill chunks in one ragged call
                return attention.ragged(q, kp, vp, db.page_tables, positions, db.q_starts, db.q_lens, context_lens,
                                        cfg.window(layer))
            return _attend_groups(q, kp, vp, db.page_tables, positions, context_lens, shape, cfg.window(layer),
                                  attention)

        hidden, (keys, values) = model.trunk(tokens, positions, attend, (kv.keys, kv.values), out_rows)
        rows = hidden if out_rows is not None else hidden[db.sample_rows]  # [R, hidden]
        full = model.logits(hidden[db.score_at]) if prompt_lp else None  # f32[S, V]: the scored tokens' alone
        return KVCache(keys, values), rows, full

    def next_tokens(rows, st: SamplingTensors):  # each row's from the screened head or the float32 one
        return head_choice.next_tokens(model, rows, st, flags, sampling_kernels)

    kv, rows, full = forward(kv, tokens, db.positions, db.slots, db.context_lens, shape.prompt_logprobs)
    known = db.sampling.output_ids.shape[1] + 1  # (penalties) this call's first token's column in output_ids
    if flags.penalties:  # the newest generated token may still be on device only; columns after it for this call's
        pending = jnp.where(db.sampling.pending >= 0, prev_tokens[jnp.maximum(db.sampling.pending, 0)], -1)
        later = jnp.full((pending.shape[0], shape.decode_steps - 1), -1, jnp.int32)  # fused steps' own tokens
        db = replace(db, sampling=replace(db.sampling, output_ids=jnp.concatenate(
            [db.sampling.output_ids, pending[:, None], later], axis=1)))
    sampled = [next_tokens(rows, db.sampling)]
    if shape.decode_steps > 1:  # fused decode: every row is a decode row
        def body(carry, i):
            kv, last, ids = carry
            positions = db.positions + i
            column = jnp.minimum(positions // shape.page_size, shape.pages - 1)
            page = jnp.take_along_axis(db.page_tables, column[:, None], axis=1)[:, 0]
            live = i < db.row_steps  # a row past its own step count writes to the reserved page 0
            slots = jnp.where(live, page * shape.page_size + positions % shape.page_size, 0)
            kv, rows, _ = forward(kv, last, positions, slots, db.context_lens + i, False)
            if flags.penalties:  # step i - 1's token counts from step i on (a row past its steps: never read)
                ids = jax.lax.dynamic_update_slice_in_dim(ids, last[:, None], known + i - 1, axis=1)
            out = next_tokens(rows, replace(db.sampling, out_pos=db.sampling.out_pos + i, output_ids=ids))
            return (kv, jnp.where(live, out[0], last), ids), out  # a row past its steps keeps its last token

        (kv, newest, _), rest = jax.lax.scan(body, (kv, sampled[0][0], db.sampling.output_ids),
                                             jnp.arange(1, shape.decode_steps))
        stacked = [jnp.concatenate([a[None], b]) for a, b in zip(sampled[0], rest)]
    else:
        newest = sampled[0][0]
        stacked = [a[None] for a in sampled[0]]
    pad = shape.max_rows - stacked[0].shape[1]
    stacked = [jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) for a in stacked]
    targets = jnp.maximum(db.targets, 0)  # i32[S] (-1: none)
    prompt = ((*log_probs(full, targets, flags.num_logprobs, sampling_kernels), token_ranks(full, targets))
              if full is not None else _no_prompt(flags))  # full f32[S, V]
    # each row's newest token again, as its own output: the next step's `prev_tokens` without a
    # host-side slice of `tokens` (an op dispatch of its own, ~0.2 ms per call). In a fused call it
    # is the token of the row's own last step, not of the call's: a row given fewer steps (pages
    # ran short) sampled nonsense after its last one, and the next step, launched before the host
    # had read the call back, fed that nonsense to the model as the row's newest token (session 50)
    return kv, StepOutput(*stacked, *prompt), jnp.pad(newest, (0, pad))


def _attend_groups(q, k_pages, v_pages, page_tables, positions, context_lens, shape: StepShape, window,
                   attention: AttentionOps):
    """Decode rows (one query each) then prefill rows (Qp queries each) -> [T, H, D]."""
    sd, sp, qp = shape.num_decode, shape.num_prefill, shape.prefill_len
    h, d = q.shape[1:]
    outs = []  # row layout only: a packed step calls attention.ragged instead
    if sd:
        outs.append(attention.decode(q[:sd], k_pages, v_pages, page_tables[:sd], positions[:sd],
                                           context_lens[:sd], window))
    if sp:
        outs.append(
            attention.prefill(
                q[sd:].reshape(sp, qp, h, d), k_pages, v_pages, page_tables[sd:], positions[sd:].reshape(sp, qp),
                context_lens[sd:], window,
            ).reshape(sp * qp, h, d)
        )
    return jnp.concatenate(outs) if len(outs) > 1 else outs[0]


def _no_prompt(flags: SamplerFlags):
    n = flags.num_logprobs
    return jnp.zeros((0,)), jnp.zeros((0, n), jnp.int32), jnp.zeros((0, n)), jnp.zeros((0,), jnp.int32)


def landed(out: StepOutput | Future) -> StepOutput:
    """A dispatched step's outputs (on the device), once its call has returned them: with a launch
    thread, the wait for that call (and any error it raised, raised here)."""
    return out.result() if isinstance(out, Future) else out


def to_host(out: StepOutput | Future, logprobs: bool = True, prompt: bool = True) -> StepOutput:
    """Block until the step is done and copy to numpy the results the batch uses: the tokens, the
    sampled logprobs if `logprobs`, the prompt logprobs if `prompt` (the rest are None). Each array
    read back costs ~10 us of host time whatever its size, the host's share of a decode step."""
    out = landed(out)
    names = ["tokens"]
    names += ["logprobs", "top_ids", "top_logprobs"] if logprobs else []
    names += ["prompt_logprobs", "prompt_top_ids", "prompt_top_logprobs", "prompt_ranks"] if prompt else []
    values = jax.device_get(tuple(getattr(out, n) for n in names))
    fields = dict.fromkeys(vars(out))
    fields.update((n, np.asarray(v)) for n, v in zip(names, values))
    return StepOutput(**fields)
