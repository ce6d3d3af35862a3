"""LLMEngine: requests in, token deltas out. One step reads: schedule -> run -> postprocess.

With async overlap the step dispatched now is read back on the next call, so the host's
scheduling and batch building for step k+1 run while the device computes step k.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import statistics
import time
import zlib
from functools import partial
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

from worker.contract import FinishReason
from worker.engine.batch import StepShape, bucket, decode_rows, envelopes, envelope_rungs, sampler_flags
from worker.engine.config import DEFAULT_DECODE_STEPS, EngineConfig
from worker.engine import cpu_layer_ops, cpu_matmul, cpu_sampling, projections, screened_head, speculation
from worker.engine.attention_choice import choose_attention
from worker.engine.detokenizer import detokenizers
from worker.engine.draft_gate import DraftGate
from worker.engine.grammar import GrammarCompiler
from worker.engine.idle_compiles import widest_sampling
from worker.engine.kv_cache import RESERVED_PAGES, KVCache, choose_num_pages, element_bytes
from worker.engine.page_allocator import PageAllocator
from worker.engine.request_output import RequestOutput
from worker.engine.runner import COMPILE_THREADS, InFlight, ModelRunner, to_host
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import ScheduledBatch, Scheduler
from worker.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from worker.engine.stop_checker import StopChecker
from worker.engine.track import Track
from worker.host_memory import loading
from worker.models.config import ModelConfig
from worker.models.loader import DTYPES, load_model, load_tokenizer, shard_model, weight_bytes
from worker.models.sharding import kv_sharding, make_mesh

log = logging.getLogger("redjax.engine")

KV_DTYPES = DTYPES | {"int8": jnp.int8}  # int8 pages: kv_quant.py
CALIBRATION_STEPS = 6  # timed single decode steps at a full batch (auto decode_steps)
# Auto async overlap on the CPU with a sequence slot free: calls shorter than this are still dispatched
# ahead. The demo model's batch-1 calls (~4 ms) ran 5-11 % slower read back one by one, llama-100m's
# (~24 ms) no slower, and each such call dispatched ahead is time an arrival waits (session 77)
SHORT_CALL_S = 0.010
# The prompt cap (Scheduler.prompt_cap): calls carrying at least TIMED_PROMPT_SLOTS prompt token slots
# time a prompt token (a running mean, the newest call weighing PROMPT_TIMING_WEIGHT), and at light load
# a step beside decoding streams takes the prompt tokens of the largest warm-up envelope that runs in
# decode_window_ms (batch.envelope_rungs), at least the smallest's. A 1024-token prompt of llama-100m on
# 2 cores is a ~0.4 s step: without the cap every stream's next token waited for it (session 78). Pieces
# under the smallest envelope padded into it (3x a 64-token piece's work on a 1B model)
TIMED_PROMPT_SLOTS = 128
PROMPT_TIMING_WEIGHT = 0.3


class LLMEngine:
    def __init__(self, model, tokenizer, config: EngineConfig):
        cfg = model.cfg
        config = config.for_backend(jax.default_backend())
        self.config = config
        self.model_config = cfg
        self.tokenizer = tokenizer
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        kv_dtype = KV_DTYPES[config.kv_cache_dtype or config.dtype or cfg.dtype]
        mesh = make_mesh(config.tensor_parallel) if config.tensor_parallel > 1 else None
        if mesh is not None:
            model = shard_model(model, mesh)
        model, self.quantization = projections.quantize(model, config)  # "int8 (kernel)", "int4 (xla)"... or None
        self.matmul = cpu_matmul.choose_matmul(config.matmul, config.tensor_parallel, model)
        if self.matmul == "kernel":  # before sizing the KV pages: the packed weights are new memory
            model = cpu_layer_ops.with_kernels(cpu_matmul.pack_model(model))
        self.greedy_head = screened_head.choose(config.greedy_head, self.matmul, model)  # "screened-int8", "screened-bf16" or "full"
        num_pages = choose_num_pages(config, cfg, self.max_model_len, element_bytes(kv_dtype, cfg.head_dim), mesh.size if mesh else 1)
        self.allocator = PageAllocator(num_pages, config.page_size, config.enable_prefix_cache, RESERVED_PAGES)
        self.scheduler = Scheduler(config, self.allocator, self.max_model_len)
        kv = KVCache.create(cfg, num_pages, config.page_size, kv_dtype, kv_sharding(mesh) if mesh else None)
        attention = choose_attention(config.attention, config.tensor_parallel, cfg.head_dim, config.page_size,
                                     DTYPES[config.dtype or cfg.dtype], kv_dtype, config.tuning(), config.pallas_prefill)
        # attention that reads only each row's own context lets every step use one page-table
        # width (the most any sequence can hold) whatever the contexts: fewer compiled variants
        widest = self.widest_pages = bucket(config.pages_for(self.max_model_len))
        # fused decode steps per call: the configured number, or with auto a default until the
        # warm-up times a step (calibrate_decode_steps)
        self.decode_steps = config.decode_steps or DEFAULT_DECODE_STEPS
        self.decode_step_s: float | None = None  # the full-batch decode step auto timed
        self.prompt_token_s: float | None = None  # a prompt token's time in the calls so far (_time_prompts)
        kernels = cpu_sampling.choose(config.sampler, config.tensor_parallel)
        self.sampler = "cpu-kernel" if kernels else "jnp"  # how sampled rows are filtered and drawn
        self.runner = ModelRunner(model, kv, config.page_size, 2 * bucket(config.max_num_seqs), config.max_logprobs,
                                  self.decode_steps, attention, widest if attention.reads_own_context else None,
                                  kernels, config.launch_thread, config.min_decode_rows)
        self.runner.background_compiles = config.compile_threads or COMPILE_THREADS
        self.eos_ids = set(cfg.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        self.grammars = GrammarCompiler(tokenizer, cfg.vocab_size, tuple(sorted(self.eos_ids)))  # structured output
        self._groups: dict[str, SequenceGroup] = {}
        self._tracks: dict[int, Track] = {}
        self._detokenizer = detokenizers(tokenizer)  # (prompt ids, skip specials) -> a sequence's detokenizer
        self._seq_ids = itertools.count()
        self._inflight: InFlight | None = None
        self._last_call_s = 0.0  # the last call read back: its time from launch (or the call before's end) to read-back
        self._read_at = 0.0  # time.perf_counter() of the last read-back
        self.num_generated_tokens = self.num_prompt_tokens = 0
        self.num_steps = 0
        self.num_step_seqs = 0  # sum of sequences over steps (mean batch size)
        self.num_draft_tokens = self.num_accepted_tokens = 0  # speculation: drafts checked, drafts that stood

    @classmethod
    def from_path(cls, path: str | Path, config: EngineConfig | None = None) -> "LLMEngine":
        config = config or EngineConfig()
        mesh = make_mesh(config.tensor_parallel) if config.tensor_parallel > 1 else None
        # the projections quantized or packed as they load: the float weights never all in memory at once
        project, head = projections.load_forms(config.for_backend(jax.default_backend()), ModelConfig.from_dir(path))
        log.info("loading %s", path)
        with loading():  # what loading frees goes back to the OS (host_memory.py)
            t0, model = time.perf_counter(), load_model(path, config.dtype, mesh, project, head)
            log.info("loaded in %.1f s: %.2f GiB of weights", time.perf_counter() - t0, weight_bytes(model) / 2**30)
            return cls(model, load_tokenizer(path), config)

    # ---- requests ----

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self._groups:
            raise ValueError(f"request {request_id!r} already exists")
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        params.check_vocab(self.model_config.vocab_size)
        bad = [t for t in prompt_token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids outside the vocabulary: {bad[:5]}")
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; the model allows {self.max_model_len}")
        if params.seed is None:  # from (engine seed, request id) alone: hash() of a str differs per process
            seed = zlib.crc32(f"{self.config.seed}:{request_id}".encode()) & 0x7FFFFFFF
            params = dataclasses.replace(params, seed=seed)
        first = next(self._seq_ids)
        for _ in range(params.n - 1):
            next(self._seq_ids)
        group = SequenceGroup.create(request_id, prompt_token_ids, params, first, arrival_time or time.time())
        bans = tuple(dict.fromkeys(self._stop_ids(params))) if params.min_tokens else ()
        for seq in group.sequences:  # (a grammar that does not compile raises before anything is held)
            seq.grammar = self.grammars.matcher(params.grammar) if params.grammar is not None else None
        self._groups[request_id] = group
        for seq in group.sequences:
            seq.early_bans = bans  # sampled with no chance until min_tokens outputs (batch.bias_entries)
            detok = self._detokenizer(prompt_token_ids, params.skip_special_tokens)
            self._tracks[seq.seq_id] = Track(detok, StopChecker(params.stop, params.include_stop_str_in_output))
        self.scheduler.add(group)
        self.num_prompt_tokens += len(prompt_token_ids)

    def resume_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       emitted: dict[int, list[int]], finished: dict[int, str] | None = None,
                       arrival_time: float | None = None, held: dict[int, int] | None = None) -> None:
        """Continue a request another worker started: `emitted[choice]` tokens were already sent,
        the text of all but the last `held[choice]` of them too (those ended inside a character),
        `finished[choice]` says which choices had ended. Prompt + emitted tokens are recomputed."""
        self.add_request(request_id, prompt_token_ids, params, arrival_time)
        for seq in self._groups[request_id].sequences:
            tokens = emitted.get(seq.index, [])
            seq.output_token_ids.extend(tokens)
            if seq.grammar is not None and not seq.grammar.consume(tokens):  # (followed it where it ran)
                error = seq.grammar.error
                self.abort(request_id)  # nothing of it stays held
                raise ValueError(f"the tokens already sent break the request's grammar: {error}")
            track = self._tracks[seq.seq_id]
            track.prompt_sent = True
            cut = len(tokens) - (held or {}).get(seq.index, 0)
            track.stops.add(track.detok.resume(tokens[:cut], tokens[cut:]), armed=False)  # (checked where it ran)
            if finished and seq.index in finished:
                self.scheduler.finish(seq, finished[seq.index])
                del self._tracks[seq.seq_id]  # its end was reported by the worker that ran it

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stop a request now: its pages are free when this returns."""
        group = self._groups.get(request_id)
        if group is None:
            return []
        self.scheduler.abort(request_id)
        return [self._finish_output(seq) for seq in group.sequences if seq.finish_reason == FinishReason.ABORT]

    def not_started(self, request_id: str) -> bool:
        """Whether the request is still queued here with nothing computed (it can go elsewhere)."""
        group = self._groups.get(request_id)
        return group is not None and all(
            seq.status == SequenceStatus.WAITING and seq.num_computed_tokens == 0 for seq in group.sequences)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # ---- the step ----

    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch the next step, then read back the previous one (async overlap), or
        the step itself."""
        outputs: list[RequestOutput] = []
        # read back first: penalties count every earlier token; drafts are looked up past one step's tokens, not a fused call's
        flight = self._inflight
        if flight is not None and (flight.penalised or flight.constrained or self.scheduler.must_read_back()):
            outputs += self._postprocess(self._inflight)
            self._inflight = None
        elif self._inflight is not None and not self._dispatch_ahead():
            # overlap ends: the call in flight is read back and its tokens go out now; read after the
            # next call's, they would wait for that call too (the next step reads its call back at once)
            outputs = self._postprocess(self._inflight)
            self._inflight = None
            return outputs
        overlapping = self._inflight is not None
        batch = self.scheduler.schedule(self.decode_steps)
        launched = None
        if batch is not None:
            outputs += [self._finish_output(seq) for seq in batch.finished]
            if batch.chunks:
                launched = self.runner.dispatch(batch)
                while launched is None and batch.chunks:  # some chunks wait for their variant: the rest go on
                    batch = ScheduledBatch([c for c in batch.chunks if not self.runner.waits(c)], batch.finished)
                    launched = self.runner.dispatch(batch) if batch.chunks else None
                self.scheduler.advance(batch)
                self.num_steps += 1
                self.num_step_seqs += len(batch.chunks)
        if self._inflight is not None:
            outputs += self._postprocess(self._inflight)
            self._inflight = None
        if launched is not None:
            if overlapping or self._dispatch_ahead():
                self._inflight = launched
            else:
                outputs += self._postprocess(launched)
        return outputs

    def _dispatch_ahead(self) -> bool:
        """Whether steps stay in flight while the next is scheduled and launched (async overlap), or
        are read back as soon as launched. Auto on the CPU (config.async_overlap None): only while
        a request arriving now could not start at the next step anyway, as every sequence slot is
        taken or requests already wait; otherwise it would wait for the step dispatched ahead too.
        A call shorter than SHORT_CALL_S (a small model's) is dispatched ahead anyway: there the host
        work it hides is a large share of the call, and an arrival waits little more."""
        if self.config.async_overlap is not None:
            return self.config.async_overlap
        return (self.scheduler.num_waiting > 0 or self.scheduler.num_running >= self.config.max_num_seqs
                or self._last_call_s < SHORT_CALL_S)

    def _postprocess(self, flight: InFlight) -> list[RequestOutput]:
        sampled_lps = any(c.seq.params.logprobs is not None for c in flight.rows if c is not None)
        out = to_host(flight.out, logprobs=sampled_lps, prompt=flight.shape.prompt_logprobs)  # as the batch decided
        done, generated = time.perf_counter(), self.num_generated_tokens
        tokens_by_row = out.tokens.T.tolist()  # [R][K]: one conversion instead of one per token
        results: list[RequestOutput] = []
        for row, chunk in enumerate(flight.rows):
            if chunk is None or chunk.seq.is_finished or (row and flight.rows[row - 1] is chunk):  # (drafts' rows)
                continue
            seq, track = chunk.seq, self._tracks[chunk.seq.seq_id]
            if seq.params.prompt_logprobs is not None and chunk.start < seq.num_prompt_tokens:
                track.collect_prompt_logprobs(seq, chunk, flight.starts[row], out)
            if seq.params.max_tokens == 0 and not seq.output_token_ids and chunk.end >= seq.num_prompt_tokens:
                self.scheduler.finish(seq, FinishReason.LENGTH)
                results.append(self._finish_output(seq))
                continue
            if not chunk.samples:
                continue
            n, steps, rows = seq.params.logprobs, chunk.num_steps, slice(row, row + 1)
            tokens = tokens_by_row[row][:steps]
            if self.config.speculative_tokens:  # drafts, and a newer step that guessed (speculation.settle)
                tokens, rows, checked, stood = speculation.read_back(seq, chunk, tokens_by_row, row, self.runner.prev_rows)
                self.num_draft_tokens, self.num_accepted_tokens = self.num_draft_tokens + checked, self.num_accepted_tokens + stood
                if not tokens:  # an older step's check took its rows back
                    continue
            m = steps * (rows.stop - rows.start)  # tokens: fused steps of one row, or a row per draft
            lps = None if n is None else list(zip(  # one conversion an array, not one a number
                out.logprobs[:steps, rows].reshape(m).tolist(), out.top_ids[:steps, rows, :n].reshape(m, n).tolist(),
                out.top_logprobs[:steps, rows, :n].reshape(m, n).tolist()))
            results.append(self._take_tokens(seq, track, tokens, lps))
        kind = "drafts" if flight.shape.drafts else "fused" if flight.shape.decode_steps > 1 else None  # (draft_gate.py)
        self.scheduler.gate.record(kind, len(flight.batch.chunks), self.num_generated_tokens - generated,
                                   flight.launched_at, done)
        # the call's own time: from its launch, or from the read-back of the call it ran behind
        self._last_call_s, self._read_at = done - max(flight.launched_at, self._read_at), done
        if flight.shape.prefill_slots >= TIMED_PROMPT_SLOTS:
            self._time_prompts(self._last_call_s / flight.shape.prefill_slots)
        return results

    def _time_prompts(self, token_s: float) -> None:
        """Fold a call's seconds per prompt token slot into `prompt_token_s` (its decode rows and
        fixed costs counted in: the cap errs short) and set the scheduler's prompt cap from it: the
        prompt tokens of the largest warm-up envelope that run in decode_window_ms, at least the
        smallest's, at most a step's budget."""
        old = self.prompt_token_s
        self.prompt_token_s = token_s if old is None else old + PROMPT_TIMING_WEIGHT * (token_s - old)
        budget = self.config.max_num_batched_tokens
        fit = int(self.config.decode_window_ms / 1e3 / self.prompt_token_s)
        rungs = sorted(envelope_rungs(budget, 1))
        cap = min(budget, max((tokens for tokens in rungs if tokens <= fit), default=rungs[0]))
        if old is None:
            log.info("prompt tokens a step beside a few streams: %d (a prompt token %.0f us; window %g ms)",
                     cap, self.prompt_token_s * 1e6, self.config.decode_window_ms)
        self.scheduler.prompt_cap = cap

    def _take_tokens(self, seq: Sequence, track: Track, tokens: list[int], lps: list | None) -> RequestOutput:
        """Resolve read-back tokens up to the first that ends the sequence.

        With stop strings each token's text goes through the stop check on its own; without, the
        text of all of them is decoded at once (one detokenizer call per fused step instead of one
        per token). `lps`: (logprob, top ids, top logprobs) per token as Python numbers, the top
        lists cut to the request's `logprobs`, only when the request asks for logprobs."""
        end = self._first_stop(seq, tokens)
        ids = tokens if end is None else tokens[: end + 1]
        if seq.grammar is not None and not seq.grammar.consume(ids):  # the mask allowed only what it takes
            raise RuntimeError(f"sequence {seq.seq_id} drew a token its grammar does not allow: {seq.grammar.error}")
        logprobs = []
        if lps is not None:
            for token, (lp, top_ids, top_lps) in zip(ids, lps):
                logprobs.append({"token_id": token, "logprob": lp, "top": [[i, x] for i, x in zip(top_ids, top_lps)]})
        if not seq.params.stop:
            seq.resolve_in_flight(ids)
            reason = None if end is None else self._stop_reason(seq, ids[-1])
            text, reason = self._text(track, ids, reason, "")
            return self._emit(seq, track, ids, logprobs, text, reason)
        text, reason = "", None
        for k, token in enumerate(ids):  # a stop string may end the text at an earlier token
            seq.resolve_in_flight([token])
            armed = seq.num_output_tokens - seq.num_in_flight >= seq.params.min_tokens  # stop strings count from there
            text, reason = self._text(track, [token], self._stop_reason(seq, token) if k == end else None, text, armed)
            if reason is not None:
                ids, logprobs = ids[: k + 1], logprobs[: k + 1]
                break
        return self._emit(seq, track, ids, logprobs, text, reason)

    def _first_stop(self, seq: Sequence, tokens: list[int]) -> int | None:
        """Index of the first of `tokens` (the next ones read back for `seq`) at which a stop token,
        EOS or a length limit ends the sequence; None if none does. Same order as `_stop_reason`."""
        p, outputs = seq.params, len(seq.output_token_ids) - seq.num_in_flight  # outputs before tokens[0]
        end = self.max_model_len - len(seq.prompt_token_ids) - outputs - 1
        if p.max_tokens is not None and p.max_tokens - outputs - 1 < end:
            end = p.max_tokens - outputs - 1
        end = max(0, end)
        stops = self._stop_ids(p)
        if stops:
            end = next((k for k, t in enumerate(tokens[:end]) if t in stops), end)
        return end if end < len(tokens) else None

    def _stop_ids(self, p: SamplingParams) -> tuple[int, ...]:
        """The tokens that end a request's sequences: its stop_token_ids, and EOS unless ignore_eos."""
        return p.stop_token_ids if p.ignore_eos else (*p.stop_token_ids, *self.eos_ids)

    def _text(self, track: Track, ids: list[int], reason, text: str, armed: bool = True):
        """Append the text of `ids` (EOS / stop tokens are not text) through the stop-string check."""
        stop_token = reason is not None and reason[0] == FinishReason.STOP
        delta = track.detok.add(ids[:-1] if stop_token else ids) if ids else ""
        if reason is not None:
            delta += track.detok.flush()
        if track.stops.idle:  # no stop strings: nothing held back, the text goes out as decoded
            return text + delta, reason
        check = track.stops.add(delta, armed)
        text += check.text
        if check.stop is not None:
            return text, (FinishReason.STOP, check.stop)
        if reason is not None:
            text += track.stops.flush()
        return text, reason

    def _stop_reason(self, seq: Sequence, token: int) -> tuple[str, str | int | None] | None:
        p = seq.params
        if token in p.stop_token_ids:
            return FinishReason.STOP, token
        if token in self.eos_ids and not p.ignore_eos:
            return FinishReason.STOP, None
        if p.max_tokens is not None and seq.num_output_tokens - seq.num_in_flight >= p.max_tokens:
            return FinishReason.LENGTH, None
        if seq.num_tokens - seq.num_in_flight >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None

    def _emit(self, seq: Sequence, track: Track, ids: list[int], logprobs: list, text: str, reason) -> RequestOutput:
        self.num_generated_tokens += len(ids)
        if seq.group.first_token_time is None:
            seq.group.first_token_time = time.time()
        if reason is not None:
            self.scheduler.finish(seq, reason[0], reason[1])
        return self._output(seq, track, ids, text, logprobs if seq.params.logprobs is not None else None)

    def _finish_output(self, seq: Sequence) -> RequestOutput:
        """A choice that ended without a new token (length limit, abort, max_tokens=0)."""
        track = self._tracks[seq.seq_id]
        text = track.stops.flush() if seq.finish_reason != FinishReason.ABORT else ""
        return self._output(seq, track, [], text, [] if seq.params.logprobs is not None else None)

    def _output(self, seq: Sequence, track: Track, ids: list[int], text: str, logprobs) -> RequestOutput:
        prompt_lps = track.take_prompt_logprobs(seq)
        done = False
        if seq.is_finished:  # its last output: choices finished together (abort) each still get theirs
            self._tracks.pop(seq.seq_id, None)
            done = seq.group.is_finished and not any(s.seq_id in self._tracks for s in seq.group.sequences)
        output = RequestOutput(
            request_id=seq.request_id, index=seq.index, token_ids=ids, text=text, logprobs=logprobs,
            prompt_logprobs=prompt_lps, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.group.num_cached_prompt_tokens or 0, request_finished=done,
        )
        if done:  # the request's last output says so, once
            self._groups.pop(seq.request_id, None)
            # no sequence <-> group cycle left: its objects are freed now, not at the cycle
            # collector's next full pass (which walks every finished request's objects until then)
            for choice in seq.group.sequences:
                choice.group = None
        return output

    def warmup(self, sampling: tuple[SamplingParams, ...] | None = None) -> int:
        """Compile the step variants a server meets first, for each of `sampling`: every pure-decode
        batch-size bucket's fused window, by running throwaway one-token requests (and a full batch's
        single step), and, when attention cost follows each row's own context (the CPU kernel: an
        envelope's widest page table is free), the mixed decode + prefill envelopes (`batch.envelopes`)
        that batches of new mixes borrow until their own shape is compiled in the background (a step
        then takes no more prompt chunks than the widest has rows). The default: greedy, sampled,
        and sampled with top-p, min-p and logprobs, which any batch without penalties or logit bias
        can run in (`variant_serves.serves`; a worker compiles ones with them while idle,
        idle_compiles.py). The variants are planned first and compiled together (`compile_ahead`);
        the requests then run on them. Returns how many variants were compiled; counters are
        restored afterwards."""
        if sampling is None:
            sampling = (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
                        widest_sampling(self.config.max_logprobs))
        self.calibrate_decode_steps()
        runner = self.runner
        before = len(runner.compiled) + len(runner.ready)
        sizes = self._decode_rungs()
        mixed = envelopes(sizes[-1], self.config.max_num_batched_tokens, runner.fixed_pages, self.config.page_size,
                          runner.max_rows) if runner.fixed_pages and runner.attention.ragged else []  # packed shapes
        self.scheduler.max_prefill_chunks = max((s.num_prefill for s in mixed), default=self.config.max_num_seqs)
        # full-batch decode variants at the widest table for batches the requests below never make (each
        # then borrows one at once; its own shape compiles in the background): single steps, and without
        # one table width for every step (jnp, Pallas) longer contexts (a variant follows their pages)
        widest = self.widest_pages if runner.fixed_pages is None else runner.fixed_pages
        steps = sorted({1, self.decode_steps}) if runner.fixed_pages is None else [1]
        long = [StepShape(sizes[-1], 0, 0, widest, k, False, self.config.page_size, runner.max_rows) for k in steps]
        long += self.speculation_shapes()

        def drive():
            for k, params in enumerate(sampling):
                params = dataclasses.replace(params, n=1, max_tokens=self.decode_steps + 2, ignore_eos=True,
                                             seed=k)
                for size in sizes:
                    for i in range(size):
                        self.add_request(f"warmup-{k}-{size}-{i}", [0], params)
                    while self.has_unfinished():
                        self.step()
                for shape in mixed + long:
                    runner.precompile(shape, sampler_flags([params], self.config.max_logprobs))

        with self._uncounted():
            self.compile_ahead(drive)
            drive()
        return len(runner.compiled) + len(runner.ready) - before

    def speculation_shapes(self) -> list[StepShape]:
        """Speculation (none when off): decode steps at every decode-row rung, at the widest page
        table: single steps with drafts, and single and fused steps without. How many rows a step
        has, and how many sequences are still running, follow which drafts stood before, so any rung
        may come; warm-up compiles them all."""
        if not self.config.speculative_tokens:
            return []
        runner = self.runner
        widest = self.widest_pages if runner.fixed_pages is None else runner.fixed_pages
        shape = partial(StepShape, num_prefill=0, prefill_len=0, pages=widest, page_size=self.config.page_size,
                        max_rows=runner.max_rows)
        return [shape(n, decode_steps=k, prompt_logprobs=False, drafts=drafts) for n in self._decode_rungs()
                for k, drafts in ((1, True), *((k, False) for k in sorted({1, self.decode_steps})))]

    def _decode_rungs(self) -> list[int]:
        """The row counts a decode step's variants come in, for 1 .. max_num_seqs rows."""
        return sorted({decode_rows(n, self.runner.max_rows, self.config.min_decode_rows)
                       for n in range(1, self.config.max_num_seqs + 1)})

    def compile_ahead(self, drive: Callable[[], object]) -> int:
        """Run `drive` (it adds requests and steps the engine until they finish) without the device:
        the runner records each step's variant and hands back zeros for its tokens. Then compile
        the variants not compiled yet, several at once (`runner.compile_planned`: a GPU host's cores
        overlap a warm-up's 25-60 s compiles), so that running `drive` for real compiles nothing.
        The plan is exact where request lengths do not depend on the tokens (ignore_eos, no stop
        strings); a variant it misses compiles when met. The planned steps' prefix-cache entries
        are dropped (their pages were never written). Returns how many variants were compiled."""
        if self.has_unfinished():
            raise RuntimeError("compile_ahead needs an idle engine")
        runner, cached = self.runner, self.allocator.cache_entries()
        rows, wanted = runner.prev_rows, dict(runner.wanted)
        runner.planned = {}
        t0 = time.perf_counter()
        try:
            with self._uncounted():
                drive()
            if self.has_unfinished():
                raise RuntimeError("compile_ahead: drive() left requests unfinished")
        except BaseException:
            runner.planned = None
            self._inflight = None  # a planned step's zeros: nothing to read back
            for request_id in list(self._groups):  # the engine was idle: these are drive()'s
                self.abort(request_id)
            raise
        finally:
            self.allocator.uncache([p for p, key in self.allocator.cache_entries().items() if cached.get(p) != key])
            runner.prev_rows, runner.wanted = rows, wanted
        log.info("planned %d step variants in %.1f s", len(runner.planned), time.perf_counter() - t0)
        return runner.compile_planned(self.config.compile_threads or COMPILE_THREADS)

    def calibrate_decode_steps(self) -> int:
        """With decode_steps auto (None): time single greedy decode steps of throwaway requests at a
        full batch (short contexts) and fuse as many steps per call as fit in decode_window_ms
        (EngineConfig.fused_steps_for). Runs once, before any fused variant is compiled (warmup()
        calls it first); a configured decode_steps is kept as it is. Returns the steps now fused;
        counters are restored."""
        if self.config.decode_steps is not None or self.decode_step_s is not None or self.has_unfinished():
            return self.decode_steps
        chosen, self.decode_steps = self.decode_steps, 1  # single steps while timing
        params = SamplingParams(temperature=0.0, max_tokens=CALIBRATION_STEPS + 3, ignore_eos=True, seed=0)
        seconds: list[float] = []  # per step() call: its decode step's period once compiled
        try:
            with self._uncounted():
                for i in range(self.config.max_num_seqs):
                    self.add_request(f"calibrate-{i}", [0], params)
                while self.has_unfinished():
                    t0 = time.perf_counter()
                    self.step()
                    seconds.append(time.perf_counter() - t0)
        finally:
            self.decode_steps = chosen
        # calls: the prefill, the first decode (compiles), decodes, the last read-back
        self.decode_step_s = step_s = statistics.median(seconds[2:-1]) if len(seconds) > 3 else 0.0
        self.decode_steps = self.runner.fused_steps = self.config.fused_steps_for(step_s)
        log.info("decode steps: %d fused per call (a decode step of %d rows took %.1f ms; window %g ms)",
                 self.decode_steps, self.config.max_num_seqs, step_s * 1e3, self.config.decode_window_ms)
        return self.decode_steps

    @contextlib.contextmanager
    def _uncounted(self):
        """Throwaway requests (warm-up, calibration) leave the throughput counters as they were, and
        what the draft gate measured (their calls compile, or while planning never run)."""
        names = ("num_generated_tokens", "num_prompt_tokens", "num_steps", "num_step_seqs", "num_draft_tokens",
                 "num_accepted_tokens")
        counters, gate = [getattr(self, name) for name in names], self.scheduler.gate
        self.scheduler.gate = DraftGate()
        try:
            yield
        finally:
            self.scheduler.gate = gate
            for name, value in zip(names, counters):
                setattr(self, name, value)

    # ---- stats ----

    @property
    def attention(self) -> str:
        """Which paged attention the jitted step runs: "cpu-kernel" or "jnp"."""
        return self.runner.attention.name

    @property
    def pages_total(self) -> int:
        return self.allocator.num_usable_pages

    @property
    def pages_used(self) -> int:
        return self.allocator.num_usable_pages - self.allocator.num_free_pages
