"""Continuous batching: admission, chunked prefill, preemption by recompute. No JAX.

Engine protocol, once per step:
  1. `batch = schedule()`; `None` means nothing to do right now (if `has_unfinished()`, read
     back the steps in flight, which resolves in-flight tokens or finishes sequences, then retry).
     Report `batch.finished` (sequences the scheduler ended with "length"). Run the device only
     when `batch.chunks` is non-empty.
  2. Dispatch the chunks, then call `advance(batch)` before the next `schedule()`: it marks
     their tokens computed, appends one in-flight token per sampled token and caches full pages.
  3. When sampled ids come back, `seq.resolve_in_flight(ids)` (oldest first); skip
     sequences already finished (their late results are dropped). End a sequence with
     `finish(seq, reason)` (EOS, stop string or token, max_tokens or max_model_len reached by
     known tokens) or `abort(request_id)`. A prompt-logprobs-only request (max_tokens 0) is
     prefilled without sampling; finish it ("length") when the chunk reaching the end of its
     prompt is read back. A sequence the engine leaves at its limit is finished by the
     scheduler once no in-flight token is left.

Rules: running sequences first, oldest first (a decode token or their next prefill chunk), then
waiting ones in arrival order. At light load, while 1 to LIGHT_DECODE_ROWS running sequences
stream their output and at most one request waits, a step's prompt chunks together take at most
`prompt_cap` tokens (the engine sets it to what its calls compute in about decode_window_ms), so a
newcomer's long prompt reaches the device in pieces instead of holding every stream's next token
for the whole prompt. With more streams or a queue, prompts take the whole budget: throughput
first, as the pieces' steps pad to a full batch's envelope or compile their own shapes (offline
64 x 128/128 of llama-100m with the cap whenever a stream decoded: 9-14 % slower).

A running sequence short of pages first shrinks its chunk, then preempts the newest running
sequence; only a sequence with no in-flight tokens in flight is preempted (otherwise the needy one
and everything newer sit this step out while those in-flight tokens drain). Nothing is preempted
for a newer sequence, so the oldest always progresses.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from worker.contract import FinishReason
from worker.engine.config import EngineConfig
from worker.engine.draft_gate import DraftGate
from worker.engine.page_allocator import PageAllocator, page_key
from worker.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from worker.engine.speculation import DraftIndex, back_off

LIGHT_DECODE_ROWS = 8  # light load: the prompt cap applies while at most this many sequences decode


@dataclass(frozen=True, eq=False)
class ScheduledChunk:
    """Compute tokens `[start, start + num_tokens)` of `seq.token_ids` (their K/V go to the pages).

    `samples`: the chunk reaches the end of the known tokens, so the step samples the next one.
    `num_steps > 1` (single-token sampling chunks only): fused decode; step i computes position
    `start + i` from the token sampled in step i - 1 and samples again, `num_steps` tokens in all.
    `drafts` (single-token sampling chunks of one step only): guessed next tokens (speculation.py),
    computed at positions `end`, `end + 1`, ... after the chunk's token, each a row that samples.
    `guess`: with drafts scheduled while the chunk's own token is still in flight, the token they
    take it to be (None: it was read back).
    """

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool
    num_steps: int = 1
    drafts: tuple[int, ...] = ()
    guess: int | None = None

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.samples


@dataclass
class ScheduledBatch:
    chunks: list[ScheduledChunk]
    finished: list[Sequence] = field(default_factory=list)  # ended here with "length": report them

    @property
    def num_tokens(self) -> int:
        """Tokens computed in the first (or only) step."""
        return sum(c.num_tokens + len(c.drafts) for c in self.chunks)

    @property
    def num_seqs(self) -> int:
        return len(self.chunks)

    @property
    def num_steps(self) -> int:
        return max((c.num_steps for c in self.chunks), default=1)

    @property
    def is_pure_decode(self) -> bool:
        return bool(self.chunks) and all(c.is_decode for c in self.chunks)


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: PageAllocator, max_model_len: int):
        if allocator.page_size != config.page_size:
            raise ValueError("allocator page_size differs from config.page_size")
        self.config = config
        self.allocator = allocator
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest (smallest arrival) first
        self.num_preemptions = 0
        self.gate = DraftGate()  # speculation: drafts or fused steps, for a batch that could fuse (the engine times calls)
        # prompt chunks (more than one token) per step at most. Warm-up sets it to the widest envelope's
        # prefill rows: a burst of short prompts at an idle worker otherwise made a step of more chunks
        # than any compiled shape holds, and every stream waited while that shape compiled (session 49)
        self.max_prefill_chunks = config.max_num_seqs
        # prompt tokens (chunks of more than one token) per step at most while 1 to LIGHT_DECODE_ROWS
        # running sequences have sampled and at most one request waits: their next tokens wait for the
        # step. The engine lowers it from its calls' timing (LLMEngine._time_prompts); until then, a
        # whole step budget
        self.prompt_cap = config.max_num_batched_tokens
        self.num_lookup_tokens = 0  # tokens of admitted sequences (prefix-cache hit rate: hit / lookup)
        self.num_hit_tokens = 0  # of which served from the prefix cache
        self._groups: dict[str, SequenceGroup] = {}
        self._next_arrival = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, group: SequenceGroup) -> None:
        """Queue every unfinished sequence of `group`, stamping its arrival order."""
        if group.request_id in self._groups:
            raise ValueError(f"request {group.request_id!r} is already scheduled")
        self._groups[group.request_id] = group
        for seq in group.sequences:
            seq.arrival = self._next_arrival
            self._next_arrival += 1
            seq.status = SequenceStatus.WAITING
            self.waiting.append(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish the request's unfinished sequences with "abort"; returns them."""
        group = self._groups.get(request_id)
        if group is None:
            return []
        seqs = [s for s in group.sequences if not s.is_finished]
        for seq in seqs:
            self.finish(seq, FinishReason.ABORT)
        return seqs

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """End `seq` now: free its pages, drop in-flight tokens still in flight. Idempotent."""
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
        seq.drop_in_flight()
        seq.last_chunk = seq.cut = None  # (their chunks refer back to it: no cycle left for the collector)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq.group is None or seq.group.is_finished:
            self._groups.pop(seq.request_id, None)

    def schedule(self, max_decode_steps: int = 1) -> ScheduledBatch | None:
        """Pick this step's chunks (pages allocated). With `max_decode_steps > 1`, a pure decode
        batch gets fused steps (`ScheduledChunk.num_steps`) when nobody waits or every sequence
        slot is taken (nobody waiting could join before a running sequence ends, and no fused
        window runs past a sequence's token limit; one that stops early frees its slot at the end
        of the window, at most max_decode_steps - 1 steps late) and no chunk has drafts (speculation:
        such a batch takes drafts when `gate` finds them faster)."""
        chunks: list[ScheduledChunk] = []
        finished: list[Sequence] = []
        budget = self.config.max_num_batched_tokens
        light = self.prompt_cap < budget and len(self.waiting) <= 1
        streams = sum(seq.num_output_tokens > 0 for seq in self.running) if light else 0
        prompt = self.prompt_cap if 0 < streams <= LIGHT_DECODE_ROWS else budget  # prompt tokens this step may take
        budget, prompt, stalled = self._schedule_running(chunks, finished, budget, prompt)
        if not stalled:
            budget = self._schedule_waiting(chunks, finished, budget, prompt)
        full = len(self.running) >= self.config.max_num_seqs
        fusable = (max_decode_steps > 1 and (full or not self.waiting) and chunks
                   and all(c.is_decode and c.seq.grammar is None for c in chunks))  # (a grammar: a token a call)
        if self.config.speculative_tokens and (not fusable or self.gate.drafts(len(chunks))):
            chunks = self._add_drafts(chunks, budget)
        if fusable and not any(c.drafts for c in chunks):
            chunks = [self._fuse(c, max_decode_steps) for c in chunks]
        if not chunks and not finished:
            return None
        return ScheduledBatch(chunks, finished)

    def advance(self, batch: ScheduledBatch) -> None:
        """After dispatching `batch`: count its tokens computed, add an in-flight token per sampled
        token, and put newly full pages of known tokens into the prefix cache."""
        for chunk in batch.chunks:
            seq = chunk.seq
            if seq.is_finished:
                continue
            if chunk.start != seq.num_computed_tokens:
                raise ValueError(f"chunk of sequence {seq.seq_id} is stale (advanced twice?)")
            seq.num_computed_tokens = chunk.end + chunk.num_steps - 1 + len(chunk.drafts)
            seq.last_chunk = chunk
            if chunk.samples:  # (drafts: as if all stand; the engine rejects the rest when read back)
                seq.append_in_flight(chunk.num_steps + len(chunk.drafts))
            self._register_full_pages(seq)
            if seq.group is not None and seq.num_computed_tokens >= seq.num_prompt_tokens:
                seq.group.prefilled = True

    def room(self, seq: Sequence) -> int:
        """Tokens `seq` may still sample (max_tokens and max_model_len, in-flight tokens counted)."""
        limit = self.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            limit = min(limit, seq.params.max_tokens - seq.num_output_tokens)
        return max(limit, 0)

    def _target(self, seq: Sequence) -> int:
        """Tokens that should have K/V: all while it may sample; the prompt alone when it wants
        only prompt logprobs (max_tokens 0); else 0, nothing left to do."""
        if seq.num_tokens > self.max_model_len:
            return 0
        if self.room(seq) > 0:
            return seq.num_tokens
        if seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0:
            return seq.num_prompt_tokens
        return 0

    def _schedule_running(
        self, chunks: list[ScheduledChunk], finished: list[Sequence], budget: int, prompt: int
    ) -> tuple[int, int, bool]:
        """Chunks for running sequences, oldest first, within `budget` tokens and `prompt` prompt
        tokens. Returns (token budget left, prompt tokens left, stalled)."""
        size, i = self.config.page_size, 0
        while i < len(self.running):
            seq = self.running[i]
            later = len(self.running) - i - 1  # newer ones keep one token each of the budget
            target = self._target(seq)
            start = seq.num_computed_tokens
            if start >= target:
                if target == 0 and seq.num_in_flight == 0:  # nothing to compute or sample
                    self._finish_length(seq, finished)
                else:  # limit reached: the engine finishes it once its last results are back
                    i += 1
                continue
            if self.config.pages_for(target) > self.allocator.num_usable_pages:  # cannot fit even alone
                if seq.num_in_flight == 0:
                    self._finish_length(seq, finished)
                else:  # its last sampled tokens are still coming back
                    i += 1
                continue
            take = target - start
            if take > 1:
                take = min(take, prompt)
            end = start + min(take, budget - later)
            if end <= start:  # no prompt token left (the budget always has one: budget >= max_num_seqs)
                i += 1
                continue
            while self._pages_short(seq, start + 1) and self.running[-1] is not seq:
                victim = self.running[-1]
                if victim.num_in_flight:
                    return budget, prompt, True
                self._preempt(victim)
            if self._pages_short(seq, start + 1):
                return budget, prompt, True  # older sequences hold the pages
            end = min(end, (len(seq.page_table) + self.allocator.num_free_pages) * size)
            self._grow(seq, end)
            samples = end == seq.num_tokens and self.room(seq) > 0
            chunks.append(ScheduledChunk(seq, start, end - start, samples))
            budget -= end - start
            if end - start > 1:
                prompt -= end - start
            i += 1
        return budget, prompt, False

    def _schedule_waiting(self, chunks: list[ScheduledChunk], finished: list[Sequence], budget: int,
                          prompt: int) -> int:
        """Admit waiting sequences in arrival order while seats, tokens, pages, prompt tokens and
        prompt chunks last. Returns the token budget left."""
        size, deferred = self.config.page_size, []
        prefills = sum(c.num_tokens > 1 for c in chunks)
        while self.waiting and budget > 0 and prompt > 0 and len(self.running) < self.config.max_num_seqs:
            if prefills >= self.max_prefill_chunks:
                break  # the rest are admitted next step
            seq = self.waiting[0]
            if self._waits_for_prefill(seq):
                deferred.append(self.waiting.popleft())
                continue
            target = self._target(seq)
            if target == 0:
                self._finish_length(seq, finished)
                continue
            if self.config.pages_for(target) > self.allocator.num_usable_pages:
                self._finish_length(seq, finished)  # cannot fit even alone
                continue
            hits, keys = [], []
            if seq.params.prompt_logprobs is None or seq.num_output_tokens > 0:
                max_hits = (target - 1) // size  # leave a token to compute, so the step samples
                hits, keys = self.allocator.lookup(seq.token_range(0, max_hits * size), max_hits)
            start = len(hits) * size
            end = start + min(target - start, budget, prompt)
            if not self.allocator.can_allocate(self.config.pages_for(end) - len(hits)):
                self.allocator.free(hits)
                break  # first come, first served: nobody jumps the queue for pages
            self.waiting.popleft()
            seq.page_table, seq.page_keys = hits, keys
            seq.num_computed_tokens = seq.num_cached_tokens = start
            if seq.group is not None and seq.group.num_cached_prompt_tokens is None:  # usage tells the client
                seq.group.num_cached_prompt_tokens = min(start, seq.num_prompt_tokens)
            self.num_lookup_tokens += target
            self.num_hit_tokens += start
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            self._grow(seq, end)
            chunks.append(ScheduledChunk(seq, start, end - start, end == seq.num_tokens and self.room(seq) > 0))
            budget -= end - start
            if end - start > 1:
                prompt -= end - start
                prefills += 1
        self.waiting.extendleft(reversed(deferred))
        return budget

    def must_read_back(self) -> bool:
        """Speculation: whether a sequence may look for drafts at the next step (the batch has spare
        rows; it has sampled, has no penalties, is not backing off) but has a fused call's tokens in
        flight, which it needs to look up from: its first lookup after fused steps."""
        if not self.config.speculative_tokens or not 0 < len(self.running) < self.config.max_num_seqs:
            return False
        if not self.gate.drafts(len(self.running)):  # the batch fuses again, unless some wait
            return False
        return any(s.num_output_tokens and _draftable(s) and _flight_tail(s) is None for s in self.running)

    def _add_drafts(self, chunks: list[ScheduledChunk], budget: int) -> list[ScheduledChunk]:
        """Speculation: decode chunks get draft tokens (`speculation.DraftIndex`), oldest first, from
        what the step has left once every running and admitted sequence has its chunk: rows (the
        step's chunks and drafts stay within max_num_seqs), tokens and free pages. While the step
        before is in flight, the lookup takes its drafts to stand and guesses the token it draws
        last (`ScheduledChunk.guess`). Sequences with penalties get none: the penalty of a draft's
        row would have to count the drafts before it; nor do those whose last drafts all fell or
        whose last lookup found nothing, for a while (`speculation.back_off`), nor those with a
        fused call in flight (`must_read_back`)."""
        spare = min(self.config.max_num_seqs - len(chunks), budget)
        out = []
        for chunk in chunks:
            if spare > 0 and chunk.is_decode and chunk.num_steps == 1 and _draftable(chunk.seq):
                chunk = self._with_drafts(chunk, spare)
                spare -= len(chunk.drafts)
            out.append(chunk)
        return out

    def _with_drafts(self, chunk: ScheduledChunk, spare: int) -> ScheduledChunk:
        seq, tail = chunk.seq, _flight_tail(chunk.seq)
        capacity = (len(seq.page_table) + self.allocator.num_free_pages) * self.config.page_size
        want = min(self.config.speculative_tokens, spare, self.room(seq) - 1, capacity - chunk.end)
        if want <= 0 or tail is None:
            return chunk
        seq.draft_index = seq.draft_index or DraftIndex()
        found = seq.draft_index.propose(seq, want + bool(seq.num_in_flight), tail)
        guess, drafts = (found[0], found[1:]) if found and seq.num_in_flight else (None, found)
        if not found:  # nothing to guess from: look again later, as after a miss
            back_off(seq, 0)
        if not drafts:
            return chunk
        self._grow(seq, chunk.end + len(drafts))
        return ScheduledChunk(seq, chunk.start, 1, True, 1, tuple(drafts), guess)

    def _waits_for_prefill(self, seq: Sequence) -> bool:
        """n > 1: later choices wait for the first one's prompt pages to reach the cache."""
        group = seq.group
        return (
            group is not None
            and seq.index > 0
            and not group.prefilled
            and self.allocator.enable_prefix_cache
            and seq.params.prompt_logprobs is None
            and not group.sequences[0].is_finished
        )

    def _fuse(self, chunk: ScheduledChunk, max_steps: int) -> ScheduledChunk:
        """Extend a decode chunk to up to `max_steps` fused steps, as room and pages allow."""
        seq, size = chunk.seq, self.config.page_size
        capacity = (len(seq.page_table) + self.allocator.num_free_pages) * size
        steps = max(1, min(max_steps, self.room(seq), capacity - chunk.start))
        self._grow(seq, chunk.start + steps)
        return ScheduledChunk(seq, chunk.start, chunk.num_tokens, chunk.samples, steps)  # half the cost of dataclasses.replace

    def _pages_short(self, seq: Sequence, end: int) -> bool:
        return not self.allocator.can_allocate(self.config.pages_for(end) - len(seq.page_table))

    def _grow(self, seq: Sequence, end: int) -> None:
        """Allocate pages so `seq` can hold tokens `[0, end)`: after its last page where it can,
        with room earmarked for every token it may reach (`PageAllocator.allocate`)."""
        table = seq.page_table
        need = self.config.pages_for(end) - len(table)
        if need > 0:
            reserve = self.config.pages_for(seq.num_tokens + self.room(seq)) - len(table)
            table.extend(self.allocator.allocate(need, after=table[-1] if table else None, reserve=reserve))

    def _preempt(self, seq: Sequence) -> None:
        """Free the newest running sequence's pages; it recomputes from the waiting queue's front."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.page_table)
        seq.page_table, seq.page_keys = [], []
        seq.num_computed_tokens = 0

    def _finish_length(self, seq: Sequence, finished: list[Sequence]) -> None:
        self.finish(seq, FinishReason.LENGTH)
        finished.append(seq)

    def _register_full_pages(self, seq: Sequence) -> None:
        """Key the pages that are full of computed, known tokens (prefix cache)."""
        if not self.allocator.enable_prefix_cache:
            return
        size = self.config.page_size
        full = min(seq.num_computed_tokens, seq.num_known_tokens) // size
        previous = seq.page_keys[-1] if seq.page_keys else None
        for i in range(len(seq.page_keys), full):
            tokens = tuple(seq.token_range(i * size, (i + 1) * size))
            previous = page_key(previous, tokens)
            self.allocator.register(seq.page_table[i], previous, tokens)
            seq.page_keys.append(previous)


def _flight_tail(seq: Sequence) -> tuple[int, ...] | None:
    """Speculation: what the tokens of `seq` in flight but the newest are taken to be, the drafts of
    the one-step chunk that drew them; None when a fused call drew them (nothing to take them for)."""
    n, last = seq.num_in_flight, seq.last_chunk
    if not n:
        return ()
    return last.drafts[: n - 1] if last is not None and last.num_steps == 1 and n - 1 <= len(last.drafts) else None


def _draftable(seq: Sequence) -> bool:
    """Speculation: a sequence without penalties (a draft row's penalty would have to count the
    drafts before it) that is not backing off (`speculation.back_off`)."""
    return not seq.params.penalised and seq.grammar is None and seq.num_tokens >= seq.drafts_from
