"""Host-side packing of a ScheduledBatch into padded arrays (numpy), plus the static step shape."""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import numpy as np

from worker.engine.sampler import SPLIT_SHARE, SamplerFlags, SamplingTensors, biased, has_penalties, needs_logits
from worker.engine.scheduler import ScheduledBatch, ScheduledChunk
from worker.engine.sequence import IN_FLIGHT

MIN_PREFILL_LEN = 8
MIN_DECODE_ROWS = 8  # the default rung (accelerators': EngineConfig.min_decode_rows gives each backend's)
MIN_PAGES = 4
MIN_SCORED = 64  # scored-token slots of a step with prompt logprobs: powers of four from this (scored_slots)
# logit-bias entries per row: a variant's widths (64 since session 73: a first request with a few
# entries no longer leaves a later one with 9-64 to compile its own; the wider array costs nothing)
LOGIT_BIAS_LADDER = (64, 512, 4096)
OUTPUT_IDS_MIN = 64  # the narrowest output-id width of a batch with penalties (sampler_widths)
# a request with penalties gets output-id columns for this many of its max_tokens at once (all of
# them when it has none): one width, one variant, for most of its life (sampler_widths)
OUTPUT_IDS_AHEAD = 1024
# Reading one context token's K/V for a prefill row, relative to the matmuls of one query token:
# (2 * layers * kv_heads * head_dim * bytes) / bandwidth over (2 * params) / FLOP/s is below 1/100
# for the models measured here (CPU and GPU); 1/64 keeps a margin against tiny rows.
ROW_CONTEXT_WEIGHT = 1 / 64
PACK_GRANULE = 32  # packed prefill token slots come in multiples of this (on the slot_bucket ladder)
MIN_PACKED_ROWS = 4
# warm-up envelopes: (prefill rows, prefill tokens as a share of the step budget); consecutive
# rungs are close enough that a mix of arrivals and running decodes borrows one within the
# runner's BORROW_TOLERANCE instead of having its own shape compiled in the background
ENVELOPE_LADDER = ((4, 3 / 16), (4, 1 / 4), (8, 3 / 8), (8, 1 / 2), (16, 3 / 4), (32, 1))


@dataclass(frozen=True)
class StepShape:
    """Everything static about a step: one compiled variant per distinct value (with SamplerFlags)."""

    num_decode: int  # Sd: decode rows (one token each), padded
    num_prefill: int  # Sp: prefill rows, padded
    prefill_len: int  # Qp: tokens per prefill row, padded (row layout); 0 when packed
    pages: int  # P: page-table width
    decode_steps: int  # K: fused decode steps (pure decode batches only)
    prompt_logprobs: bool  # compute the logits of scored prompt tokens too, not only of sampled rows
    page_size: int
    max_rows: int
    prefill_tokens: int = 0  # Tp: packed layout only: prefill token slots, each chunk a run of them
    drafts: bool = False  # decode rows alone, some of them drafts (speculation.py) reading the K/V of rows before them
    scored: int = 0  # S: with prompt_logprobs, token slots whose logits the head computes (<= T; padded)

    @property
    def packed(self) -> bool:
        """Prefill chunks packed back to back (one row each, any length; needs ragged attention)
        instead of split into rows of Qp tokens, each padded to Qp."""
        return self.prefill_tokens > 0

    @property
    def prefill_slots(self) -> int:
        return self.prefill_tokens if self.packed else self.num_prefill * self.prefill_len

    @property
    def num_tokens(self) -> int:
        return self.num_decode + self.prefill_slots

    @property
    def num_rows(self) -> int:
        return self.num_decode + self.num_prefill


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DeviceBatch:
    tokens: np.ndarray  # i32[T]; in-flight tokens come from `src`
    src: np.ndarray  # i32[T]: row of the previous step's sampled tokens, or -1
    positions: np.ndarray  # i32[T]
    slots: np.ndarray  # i32[T]: page * page_size + offset where the token's K/V go
    page_tables: np.ndarray  # i32[R, P]
    context_lens: np.ndarray  # i32[R]: tokens in the pages once this step's are written
    sample_rows: np.ndarray  # i32[R]: index into T of each row's last token
    score_at: np.ndarray  # i32[S]: index in T of each token whose prompt logprob the step computes
    targets: np.ndarray  # i32[S]: the next prompt token after each of those, or -1 (padding)
    row_steps: np.ndarray  # i32[R]: fused decode steps of each row (a row stops writing after its own)
    q_starts: np.ndarray  # i32[R]: index in T of each row's first query token
    q_lens: np.ndarray  # i32[R]: query tokens of each row (0: padding row)
    sampling: SamplingTensors


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum); 0 stays 0."""
    return 0 if n == 0 else max(minimum, 1 << (n - 1).bit_length())


def scored_slots(n: int, num_tokens: int) -> int:
    """Slots for n scored prompt tokens in a step of num_tokens: a power of four from MIN_SCORED,
    at most num_tokens. Coarser than the other shapes' ladders: each count is a variant of its own,
    which on a GPU takes 25-60 s to compile while the scoring chunks wait, and the head over a few
    padding tokens costs little beside the step."""
    slots = MIN_SCORED
    while slots < n:
        slots *= 4
    return min(slots, num_tokens)


def decode_rows(n: int, max_rows: int, minimum: int = MIN_DECODE_ROWS) -> int:
    """Padded decode row count for n decode rows: a power of two, at least `minimum` unless that
    would take more than half of the runner's rows (prefill rows need the other half)."""
    return bucket(n, min(minimum, max_rows // 2))


def mixed_decode_rows(max_rows: int) -> int:
    """Decode rows of a row-layout step that also has prefill rows: all of them (half the runner's
    rows, which hold max_num_seqs). Such a step carries at least MIN_PREFILL_LEN prompt tokens per
    prefill row, and its prefill and decode shapes would otherwise multiply: a 64 x 1024/1024 run
    on a GPU met 18 mixed variants, each 25-60 s to compile for llama3-8b, where full decode rows
    leave one per prefill shape. The padding rows cost their share of the projections (a few
    percent beside the prompt tokens on a GPU) and no attention (no context). The packed layout
    (ragged attention, the CPU kernel) keeps the ladder: its mixes are served by a few envelopes."""
    return max_rows // 2


def row_bucket(n: int) -> int:
    """Smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5x them) >= n."""
    b = bucket(n)
    return b * 3 // 4 if b >= 4 and n <= b * 3 // 4 else b


def plan_prefill(lengths: list[int], max_rows: int, context: int) -> tuple[int, int]:
    """Split prefill chunks into rows of Qp tokens: -> (Qp, padded row count).

    Padding every chunk to the longest one wastes up to half a step when one long chunk rides
    with short ones (a 1024-token budget packed as 8 + 7 x 128 + 104 tokens took 16 rows of 128).
    Each power of two Qp is costed as padded tokens plus, per row, its gathered context
    (`context` tokens of K/V) at ROW_CONTEXT_WEIGHT of a token's cost; the cheapest wins,
    ties going to the longer rows.
    """
    best: tuple[float, int, int] | None = None
    qp = bucket(max(lengths), MIN_PREFILL_LEN)
    while qp >= MIN_PREFILL_LEN:
        rows = row_bucket(sum(-(-n // qp) for n in lengths))
        cost = rows * (qp + context * ROW_CONTEXT_WEIGHT)
        if rows <= max_rows and (best is None or cost < best[0]):
            best = (cost, qp, rows)
        qp //= 2
    if best is None:
        raise ValueError(f"{len(lengths)} prefill chunks do not fit in {max_rows} rows")
    return best[1], best[2]


def slot_bucket(n: int) -> int:
    """Smallest of 1..8, then four steps per octave (10, 12, 14, 16, 20, 24, 28, 32, 40, ...) >= n:
    under a quarter of padding."""
    b = bucket(n)
    step = max(1, b // 8)
    return -(-n // step) * step


def plan_packed(lengths: list[int], max_rows: int) -> tuple[int, int]:
    """Packed prefill chunks: -> (padded row count, padded token slots). Slots come in multiples
    of PACK_GRANULE on the slot_bucket ladder, rows in powers of two (a padding row costs only
    its sampled logits)."""
    if len(lengths) > max_rows:
        raise ValueError(f"{len(lengths)} prefill chunks do not fit in {max_rows} rows")
    rows = min(bucket(len(lengths), MIN_PACKED_ROWS), max_rows)
    return rows, PACK_GRANULE * slot_bucket(-(-sum(lengths) // PACK_GRANULE))


def fits(shape: StepShape, num_decode: int, prefill_lengths: list[int], pages: int) -> bool:
    """Can a batch with these decode rows, prefill chunk lengths and page-table width run in `shape`?"""
    if shape.num_decode < num_decode or shape.pages < pages or bool(shape.num_prefill) != bool(prefill_lengths):
        return False
    if not prefill_lengths:
        return True
    if shape.packed:
        return len(prefill_lengths) <= shape.num_prefill and sum(prefill_lengths) <= shape.prefill_tokens
    return sum(-(-n // shape.prefill_len) for n in prefill_lengths) <= shape.num_prefill


def step_cost(shape: StepShape) -> float:
    """Relative work of a step shape: padded tokens plus, per prefill row, the context it gathers
    (row layout) or its sampled logits, about a token's worth (packed: the ragged attention reads
    only each row's own context)."""
    per_row = 1 if shape.packed else shape.pages * shape.page_size * ROW_CONTEXT_WEIGHT
    return shape.decode_steps * shape.num_decode + shape.prefill_slots + shape.num_prefill * per_row


def envelopes(max_decode: int, budget: int, max_pages: int, page_size: int, max_rows: int) -> list[StepShape]:
    """Packed mixed (decode + prefill) shapes compiled at warm-up so that a batch of a new mix
    runs at once, padded into one of them, instead of stopping the worker for seconds to compile:
    all decode rows plus, on ENVELOPE_LADDER, from 3/16 of a step budget of prefill tokens in
    up to 4 chunks (a few arrivals joining a running batch) to a whole budget in up to 32; then
    the same prefill rungs with no decode rows (arrivals at an idle worker: a lone prompt padded
    into a full decode envelope costs half again its own step, so without these the first bursts
    after start-up compiled their own shape in the background, a core for a second).

    All use the widest page table, so they cover any context. Every batch fits the largest: after
    warm-up the scheduler takes no more prefill chunks in a step than it has rows
    (`Scheduler.max_prefill_chunks`).
    """
    rows_for = envelope_rungs(budget, max_rows - max_decode)
    return [StepShape(decode, rows, 0, max_pages, 1, False, page_size, max_rows, tokens)
            for decode in (max_decode, 0) for tokens, rows in sorted(rows_for.items())]


def envelope_rungs(budget: int, spare_rows: int) -> dict[int, int]:
    """The envelopes' prompt token slots -> their prompt rows, on ENVELOPE_LADDER for a step budget
    (a small budget collapses rungs: each keeps the most rows)."""
    rows_for: dict[int, int] = {}
    for rows, share in ENVELOPE_LADDER:
        tokens = plan_packed([max(1, int(budget * share))], 1)[1]
        rows_for[tokens] = max(rows_for.get(tokens, 0), min(rows, spare_rows))
    return rows_for


def empty_batch(shape: StepShape, flags: SamplerFlags) -> DeviceBatch:
    """A DeviceBatch of `shape` holding no sequence: the argument for compiling a variant ahead of
    time (its arrays have the dtypes and shapes build_batch gives a real batch of this shape and
    these flags, penalty and logit-bias widths included)."""
    t, r, scored = shape.num_tokens, shape.num_rows, shape.scored
    i32 = lambda *dims: np.zeros(dims, np.int32)  # noqa: E731
    return DeviceBatch(i32(t), np.full(t, -1, np.int32), i32(t), i32(t), i32(r, shape.pages), i32(r), i32(r),
                       i32(scored), np.full(scored, -1, np.int32), i32(r), i32(r), i32(r),
                       _sampling([None] * r, flags, {}))


def pack(db: DeviceBatch) -> np.ndarray:  # i32[N]
    """The batch's host arrays, each 32 bits wide, end to end as one i32 buffer: a step's launch
    then hands the runtime one host array instead of ~26. Each costs the launch 5.7-6.5 us on
    this project's CPUs (`redjax bench launch`) and a transfer of its own on a GPU. The step
    recovers the arrays with `unpack`."""
    leaves = jax.tree_util.tree_leaves(db)
    if any(a.dtype.itemsize != 4 for a in leaves):
        raise TypeError("pack: every batch array must be 32 bits wide")
    return np.concatenate([np.ascontiguousarray(a).view(np.int32).reshape(-1) for a in leaves])


def unpack(buf, shape: StepShape, flags: SamplerFlags) -> DeviceBatch:
    """`pack`'s buffer (i32[N], on the device inside the jitted step) -> the DeviceBatch of
    variant (shape, flags): the arrays' shapes and dtypes are `empty_batch`'s, known at trace time."""
    leaves, tree = jax.tree_util.tree_flatten(empty_batch(shape, flags))
    if buf.shape != (sum(leaf.size for leaf in leaves),):
        raise ValueError(f"unpack: a buffer of {buf.shape} values for a batch of {sum(a.size for a in leaves)}")
    parts, at = [], 0
    for leaf in leaves:
        part = buf[at : at + leaf.size].reshape(leaf.shape)
        parts.append(part if leaf.dtype == np.int32 else jax.lax.bitcast_convert_type(part, leaf.dtype))
        at += leaf.size
    return jax.tree_util.tree_unflatten(tree, parts)


def build_batch(batch: ScheduledBatch, prev_rows: dict[int, int], page_size: int, max_rows: int, max_logprobs: int,
                fused_steps: int = 1, fixed_pages: int | None = None, packed: bool = False, split: bool = False,
                choose=None, min_rows: int = MIN_DECODE_ROWS):
    """-> (DeviceBatch, StepShape, SamplerFlags, rows, starts).

    `rows[r]` is the chunk whose sampled token row r holds (None for padding and for the leading
    rows of a prefill chunk split over several rows: it sits in its last one); `starts[r]` is the
    index in S (`DeviceBatch.score_at`) of that chunk's first token where it has prompt tokens to
    score, else 0. Only those tokens get logits from the head: a chunk scoring its prompt among
    others costs the head its own tokens, not the step's.

    A fused batch always runs `fused_steps` steps (rows with fewer stop writing after their own
    count), so fusion adds one compiled variant per shape, not one per step count. With
    `fixed_pages` (attention that reads only each row's own context), every batch uses that
    page-table width: variants no longer multiply with context lengths. `packed` (ragged
    attention): prefill chunks are packed back to back, one row each (`StepShape.packed`). `split`
    (a model with a screened head): a batch whose rows needing every logit are at most 1 /
    SPLIT_SHARE of its rows gets `SamplerFlags.apart`.
    `choose(exact_shape, flags, decode_rows, prefill_lengths, pages, plain, scored)` may return
    another (shape, flags) variant the batch fits in (an already compiled one) to run instead;
    `plain`: chunks whose requests have neither penalties nor logit bias; `scored`: chunks with
    prompt tokens to score (`predicts_prompt`).
    """
    decode = [c for c in batch.chunks if c.num_tokens == 1]
    prefill = [c for c in batch.chunks if c.num_tokens > 1]
    ahead = None  # speculation: each draft a decode row of its own after its chunk's, `ahead` tokens on
    if any(c.drafts for c in decode):
        ahead = [j for c in decode for j in range(1 + len(c.drafts))]
        decode = [c for c in decode for _ in range(1 + len(c.drafts))]
    sd = mixed_decode_rows(max_rows) if decode and prefill and not packed else decode_rows(len(decode), max_rows, min_rows)
    needed = bucket(max(len(c.seq.page_table) for c in batch.chunks), MIN_PAGES)
    pages = needed if fixed_pages is None else max(fixed_pages, needed)
    lengths = [c.num_tokens for c in prefill]
    qp = sp = tp = 0
    if prefill and packed:
        sp, tp = plan_packed(lengths, max_rows - sd)
    elif prefill:
        qp, sp = plan_prefill(lengths, max_rows - sd, needed * page_size)
    steps = fused_steps if batch.is_pure_decode and batch.num_steps > 1 else 1
    scoring = [c for c in batch.chunks if predicts_prompt(c)]  # chunks with prompt tokens to score
    want_prompt = bool(scoring)
    shape = StepShape(sd, sp, qp, pages, steps, want_prompt, page_size, max_rows, tp, ahead is not None and not prefill)
    if want_prompt:
        shape = replace(shape, scored=scored_slots(sum(c.num_tokens for c in scoring), shape.num_tokens))
    if shape.num_rows > max_rows:
        raise ValueError(f"{shape.num_rows} rows exceed the runner's {max_rows}")
    prompt_top = any(c.seq.params.prompt_logprobs > 0 for c in scoring)
    flags = sampler_widths(batch.chunks, sampler_flags([c.seq.params for c in batch.chunks], max_logprobs, prompt_top))
    flags = replace(flags, mask_words=max((c.seq.grammar.words for c in batch.chunks if c.seq.grammar), default=0))
    if split:
        logit_rows = sum(needs_logits(c.seq.params) for c in decode + prefill)  # sampled rows (a draft's too)
        flags = replace(flags, apart=0 < logit_rows <= shape.num_rows // SPLIT_SHARE)
    if choose is not None:
        plain = sum(not needs_arrays(c.seq.params) for c in batch.chunks)
        shape, flags = choose(shape, flags, len(decode), lengths, pages, plain, len(scoring))
        sd, qp, pages = shape.num_decode, shape.prefill_len, shape.pages

    t, r = shape.num_tokens, shape.num_rows
    tokens, src = np.zeros(t, np.int32), np.full(t, -1, np.int32)
    positions, slots = np.zeros(t, np.int32), np.zeros(t, np.int32)
    tables, ctx, sample_rows = np.zeros((r, pages), np.int32), np.zeros(r, np.int32), np.zeros(r, np.int32)
    row_steps, q_starts, q_lens = np.zeros(r, np.int32), np.zeros(r, np.int32), np.zeros(r, np.int32)
    rows: list[ScheduledChunk] = decode + prefill
    offsets, spans = list(range(len(decode))), [(i, i + 1) for i in range(len(decode))]  # rows [first, last + 1)
    first, off = sd, sd
    for chunk in prefill:  # packed: one row per chunk, tokens back to back; else rows of qp tokens
        pieces = 1 if shape.packed else -(-chunk.num_tokens // qp)
        offsets.append(off)
        spans.append((first, first + pieces))
        first += pieces
        off += chunk.num_tokens if shape.packed else pieces * qp
    _fill_decode_rows(decode, ahead, prev_rows, page_size, tokens, src, positions, slots, tables, ctx,
                      sample_rows, row_steps, q_starts, q_lens)
    for chunk, off, (row0, row_end) in zip(prefill, offsets[len(decode):], spans[len(decode):]):
        seq, n = chunk.seq, chunk.num_tokens
        piece = n if shape.packed else qp  # query tokens per row
        ids = np.asarray(seq.token_range(chunk.start, chunk.end), np.int32)
        if (ids == IN_FLIGHT).any():  # only the newest token can still be on device
            if ids[-1] != IN_FLIGHT or (ids[:-1] == IN_FLIGHT).any() or seq.seq_id not in prev_rows:
                raise RuntimeError(f"sequence {seq.seq_id}: in-flight token not produced by the previous step")
            src[off + n - 1] = prev_rows[seq.seq_id]
            ids[-1] = 0
        pos = np.arange(chunk.start, chunk.end, dtype=np.int32)
        table = np.asarray(seq.page_table, np.int32)
        tokens[off : off + n], positions[off : off + n] = ids, pos
        slots[off : off + n] = table[pos // page_size] * page_size + pos % page_size
        for row in range(row0, row_end):  # each row attends over the whole sequence's pages
            tables[row, : len(table)] = table
            ctx[row] = chunk.end
            q_starts[row] = off + (row - row0) * piece
            q_lens[row] = min(piece, n - (row - row0) * piece)
            sample_rows[row] = q_starts[row] + q_lens[row] - 1
            row_steps[row] = chunk.num_steps
    score_at, targets, first_scored = _scored_tokens(rows, offsets, shape.scored) if want_prompt else (
        np.zeros(0, np.int32), np.zeros(0, np.int32), {})
    by_row: list[ScheduledChunk | None] = [None] * r
    starts = [0] * r
    for chunk, (_, row_end) in zip(rows, spans):
        by_row[row_end - 1], starts[row_end - 1] = chunk, first_scored.get(id(chunk), 0)
    sampling = _sampling(by_row, flags, prev_rows, ahead)
    db = DeviceBatch(tokens, src, positions, slots, tables, ctx, sample_rows, score_at, targets, row_steps, q_starts,
                     q_lens, sampling)
    return db, shape, flags, by_row, starts


def _scored_tokens(chunks: list[ScheduledChunk], offsets: list[int], slots: int):
    """-> (score_at i32[slots], targets i32[slots], {id(chunk): its first slot}): every token of
    each chunk with prompt tokens to score (`predicts_prompt`), in order; `offsets[i]`: the index in
    T of chunks[i]'s first token. A target is the prompt token after its token, -1 past the prompt
    and in padding slots."""
    score_at, targets = np.zeros(slots, np.int32), np.full(slots, -1, np.int32)
    first: dict[int, int] = {}
    at = 0
    for chunk, off in zip(chunks, offsets):
        if not predicts_prompt(chunk) or id(chunk) in first:
            continue
        seq, n = chunk.seq, chunk.num_tokens
        first[id(chunk)] = at
        score_at[at : at + n] = off + np.arange(n)
        nxt = np.arange(chunk.start + 1, chunk.end + 1)
        inside = nxt < seq.num_prompt_tokens
        targets[at : at + n][inside] = np.asarray(seq.prompt_token_ids, np.int32)[nxt[inside]]
        at += n
    return score_at, targets, first


def _fill_decode_rows(decode: list[ScheduledChunk], ahead: list[int] | None, prev_rows: dict[int, int],
                      page_size: int, tokens, src, positions, slots, tables, ctx, sample_rows,
                      row_steps, q_starts, q_lens) -> None:
    """Rows 0..n-1 (and tokens 0..n-1) for one-token chunks, in a few array operations instead of
    the prefill loop's dozen per row. `ahead[i]`: row i is draft `ahead[i] - 1` of its chunk (0:
    the chunk's own token), at that many positions after the chunk's token (None: no drafts)."""
    n = len(decode)
    if not n:
        return
    ids = np.fromiter((c.drafts[j - 1] if j else c.seq.token_range(c.start, c.end)[0]
                       for c, j in zip(decode, ahead or [0] * n)), np.int32, n)
    for i in np.flatnonzero(ids == IN_FLIGHT):  # the newest token, sampled by the previous step
        seq_id = decode[i].seq.seq_id
        if seq_id not in prev_rows:
            raise RuntimeError(f"sequence {seq_id}: in-flight token not produced by the previous step")
        src[i], ids[i] = prev_rows[seq_id], 0
    pos = np.fromiter((c.start for c in decode), np.int32, n)
    if ahead is not None:
        pos += np.asarray(ahead, np.int32)
    for i, c in enumerate(decode):
        tables[i, : len(c.seq.page_table)] = c.seq.page_table
    tokens[:n], positions[:n] = ids, pos
    slots[:n] = tables[np.arange(n), pos // page_size] * page_size + pos % page_size
    ctx[:n] = pos + 1
    sample_rows[:n] = q_starts[:n] = np.arange(n)
    q_lens[:n] = 1
    row_steps[:n] = np.fromiter((c.num_steps for c in decode), np.int32, n)


def predicts_prompt(chunk: ScheduledChunk) -> bool:
    """Whether a chunk's request asks for prompt logprobs and the chunk holds a prompt token with a
    next prompt token to predict: only then does a step compute every token's logits
    (`StepShape.prompt_logprobs`). A request's decode steps never do."""
    seq = chunk.seq
    return seq.params.prompt_logprobs is not None and chunk.start + 1 < seq.num_prompt_tokens


def needs_arrays(p) -> bool:
    """Whether a request's sampling needs arrays sized by the batch (penalties, logit bias, or
    min_tokens' bans, which are bias entries; a grammar's mask): only a variant with the same
    flags and widths serves it (`SamplerFlags.widths`, `mask_words`)."""
    return has_penalties(p) or biased(p) or p.grammar is not None


BANNED = float("-inf")  # the bias of a token min_tokens holds back


def bias_entries(seq) -> list[tuple[int, float, int]]:
    """A sequence's logit-bias entries as (token id, bias, output position it applies before):
    the request's logit_bias throughout, then min_tokens' bans on EOS and stop tokens
    (`Sequence.early_bans`) until it holds min_tokens outputs."""
    p = seq.params
    always = np.iinfo(np.int32).max
    return [(tok, val, always) for tok, val in p.logit_bias] + [(tok, BANNED, p.min_tokens) for tok in seq.early_bans]


def sampler_flags(params: list, max_logprobs: int, prompt_top: bool = False) -> SamplerFlags:
    """The static sampler switches a batch with these SamplingParams needs; `prompt_top`: some
    chunk's prompt logprobs come with top alternatives."""
    greedy = all(p.temperature == 0.0 for p in params)
    want_top = prompt_top or any((p.logprobs or 0) > 0 for p in params)
    return SamplerFlags(
        all_greedy=greedy,
        needs_cut=not greedy and any(p.top_k > 0 or p.top_p < 1.0 for p in params),
        top_p=not greedy and any(p.top_p < 1.0 for p in params),
        min_p=not greedy and any(p.min_p > 0.0 for p in params),
        penalties=any(has_penalties(p) for p in params),
        bias=any(biased(p) for p in params),
        num_logprobs=max_logprobs if want_top else 0,
        # the sampled tokens' logprobs only: prompt logprobs come from every token's logits
        # (StepShape.prompt_logprobs), so a row asking only for those stays on the screened head
        logprobs=any(p.logprobs is not None for p in params),
    )


def sampler_widths(chunks: list[ScheduledChunk], flags: SamplerFlags) -> SamplerFlags:
    """`flags` with the widths of its penalty and logit-bias arrays (`SamplerFlags.widths`), from
    the rows with penalties (only theirs are written). Output ids get columns for the tokens a
    request may still generate, up to OUTPUT_IDS_AHEAD: a width sized to the tokens so far met a
    new variant at every doubling of a request's output (64, 128, ... 1024: five compiles for one
    600-token request, 0.5 s each for the demo model on the 2-core CPU, 25-60 s each on a GPU)."""
    if not (flags.penalties or flags.bias):
        return flags
    bias_len = max((len(c.seq.params.logit_bias) + len(c.seq.early_bans) for c in chunks), default=0)
    b = next(x for x in LOGIT_BIAS_LADDER + (bias_len,) if x >= bias_len) if bias_len else 1
    penalised = [c.seq for c in chunks if has_penalties(c.seq.params)]
    if not penalised:
        return replace(flags, widths=(1, 1, b))
    out_len = bucket(max(max(s.num_output_tokens + 1, _outputs_ahead(s.params)) for s in penalised), OUTPUT_IDS_MIN)
    prompt_len = bucket(max(s.num_prompt_tokens for s in penalised))
    return replace(flags, widths=(out_len, prompt_len, b))


def _outputs_ahead(p) -> int:
    """Output-id columns a request with penalties asks for up front (SamplingParams `p`)."""
    return OUTPUT_IDS_AHEAD if p.max_tokens is None else min(p.max_tokens, OUTPUT_IDS_AHEAD)


def _sampling(rows: list[ScheduledChunk | None], flags: SamplerFlags, prev_rows: dict[int, int],
              ahead: list[int] | None = None):
    """The rows' sampling arrays; a draft's row (`ahead`, rows first) samples `ahead[i]` outputs on."""
    r = len(rows)
    penalties = flags.penalties
    out_len, prompt_len, b = flags.widths
    f = {name: np.zeros(r, np.float32) for name in ("temperature", "top_p", "min_p", "presence", "frequency")}
    f["top_p"][:] = 1.0
    rep = np.ones(r, np.float32)
    i32 = {name: np.zeros(r, np.int32) for name in ("top_k", "choice", "out_pos")}
    seeds = np.zeros(r, np.uint32)
    bias_ids, bias_vals = np.zeros((r, b), np.int32), np.zeros((r, b), np.float32)
    bias_until = np.zeros((r, b), np.int32)  # padding entries: until 0, so never applied
    out_ids, prompt_ids = np.full((r, out_len), -1, np.int32), np.full((r, prompt_len), -1, np.int32)
    pending = np.full(r, -1, np.int32)
    full_head = np.zeros(r, np.int32)  # (a bool array could not be packed with the rest)
    allowed = np.full((r, flags.mask_words), -1, np.int32)  # every bit set: any token
    for i, c in enumerate(rows):
        if c is None:
            continue
        p, seq = c.seq.params, c.seq
        f["temperature"][i], f["top_p"][i], f["min_p"][i] = p.temperature, p.top_p, p.min_p
        f["presence"][i], f["frequency"][i], rep[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        i32["top_k"][i], i32["choice"][i] = max(p.top_k, 0), seq.index
        i32["out_pos"][i] = seq.num_output_tokens + (ahead[i] if ahead is not None and i < len(ahead) else 0)
        seeds[i] = (p.seed or 0) & 0xFFFFFFFF
        full_head[i] = needs_logits(p)
        if seq.grammar is not None and c.samples:  # (the engine read its last token back first)
            seq.grammar.fill(allowed, i)
        if flags.bias:
            for j, (tok, val, until) in enumerate(bias_entries(seq)):
                bias_ids[i, j], bias_vals[i, j], bias_until[i, j] = tok, val, until
        if penalties and has_penalties(p):  # (the widths count these rows alone)
            outs = np.asarray(seq.output_token_ids, np.int32)
            out_ids[i, : len(outs)] = outs  # a trailing in-flight token (-1) is filled on device from `pending`
            if seq.num_in_flight > 1:  # (the engine reads a fused call with them back first)
                raise RuntimeError(f"sequence {seq.seq_id}: penalties fill in only the newest in-flight token")
            if seq.num_in_flight:
                pending[i] = prev_rows.get(seq.seq_id, -1)
            prompt_ids[i, : seq.num_prompt_tokens] = seq.prompt_token_ids
    tensors = SamplingTensors(
        temperature=f["temperature"], top_k=i32["top_k"], top_p=f["top_p"], min_p=f["min_p"], seed=seeds,
        choice=i32["choice"], out_pos=i32["out_pos"], presence=f["presence"], frequency=f["frequency"],
        repetition=rep, bias_ids=bias_ids, bias_vals=bias_vals, bias_until=bias_until, output_ids=out_ids,
        prompt_ids=prompt_ids, pending=pending, full_head=full_head, allowed=allowed,
    )
    return tensors
