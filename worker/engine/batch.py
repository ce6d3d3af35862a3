"""Host-side packing of a ScheduledBatch into padded arrays (numpy), plus the static step shape."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from worker.engine.sampler import SamplerFlags, SamplingTensors
from worker.engine.scheduler import ScheduledBatch, ScheduledChunk
from worker.engine.sequence import IN_FLIGHT

MIN_PREFILL_LEN = 8
MIN_PAGES = 4
LOGIT_BIAS_LADDER = (8, 64, 512, 4096)


@dataclass(frozen=True)
class StepShape:
    """Everything static about a step: one compiled variant per distinct value (with SamplerFlags)."""

    num_decode: int  # Sd: decode rows (one token each), padded
    num_prefill: int  # Sp: prefill rows, padded
    prefill_len: int  # Qp: tokens per prefill row, padded
    pages: int  # P: page-table width
    decode_steps: int  # K: fused decode steps (pure decode batches only)
    prompt_logprobs: bool  # compute logits for every token, not only sampled rows
    page_size: int
    max_rows: int

    @property
    def num_tokens(self) -> int:
        return self.num_decode + self.num_prefill * self.prefill_len

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
    targets: np.ndarray  # i32[T]: next prompt token at each position (prompt logprobs), or -1
    row_steps: np.ndarray  # i32[R]: fused decode steps of each row (a row stops writing after its own)
    sampling: SamplingTensors


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum); 0 stays 0."""
    return 0 if n == 0 else max(minimum, 1 << (n - 1).bit_length())


def build_batch(batch: ScheduledBatch, prev_rows: dict[int, int], page_size: int, max_rows: int, max_logprobs: int,
                fused_steps: int = 1):
    """-> (DeviceBatch, StepShape, SamplerFlags, rows: the chunk of each real row in order).

    A fused batch always runs `fused_steps` steps (rows with fewer stop writing after their own
    count), so fusion adds one compiled variant per shape, not one per step count.
    """
    decode = [c for c in batch.chunks if c.num_tokens == 1]
    prefill = [c for c in batch.chunks if c.num_tokens > 1]
    sd, sp = bucket(len(decode)), bucket(len(prefill))
    qp = bucket(max((c.num_tokens for c in prefill), default=0), MIN_PREFILL_LEN) if prefill else 0
    steps = fused_steps if batch.is_pure_decode and batch.num_steps > 1 else 1
    pages = bucket(max(len(c.seq.page_table) for c in batch.chunks), MIN_PAGES)
    want_prompt = any(c.seq.params.prompt_logprobs is not None for c in prefill + decode)
    shape = StepShape(sd, sp, qp, pages, steps, want_prompt, page_size, max_rows)
    if shape.num_rows > max_rows:
        raise ValueError(f"{shape.num_rows} rows exceed the runner's {max_rows}")

    t, r = shape.num_tokens, shape.num_rows
    tokens, src = np.zeros(t, np.int32), np.full(t, -1, np.int32)
    positions, slots, targets = np.zeros(t, np.int32), np.zeros(t, np.int32), np.full(t, -1, np.int32)
    tables, ctx, sample_rows = np.zeros((r, pages), np.int32), np.zeros(r, np.int32), np.zeros(r, np.int32)
    row_steps = np.zeros(r, np.int32)
    rows: list[ScheduledChunk] = decode + prefill
    offsets = list(range(len(decode))) + [sd + j * qp for j in range(len(prefill))]
    row_ids = list(range(len(decode))) + [sd + j for j in range(len(prefill))]
    for chunk, off, row in zip(rows, offsets, row_ids):
        seq, n = chunk.seq, chunk.num_tokens
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
        tables[row, : len(table)] = table
        ctx[row] = chunk.end
        sample_rows[row] = off + n - 1
        row_steps[row] = chunk.num_steps
        if want_prompt and seq.params.prompt_logprobs is not None:
            nxt = pos + 1
            inside = nxt < seq.num_prompt_tokens
            targets[off : off + n][inside] = np.asarray(seq.prompt_token_ids, np.int32)[nxt[inside]]
    by_row: list[ScheduledChunk | None] = [None] * r
    for chunk, row in zip(rows, row_ids):
        by_row[row] = chunk
    sampling, flags = _sampling(by_row, max_logprobs, prev_rows)
    db = DeviceBatch(tokens, src, positions, slots, tables, ctx, sample_rows, targets, row_steps, sampling)
    return db, shape, flags, by_row


def _sampling(rows: list[ScheduledChunk | None], max_logprobs: int, prev_rows: dict[int, int]):
    r = len(rows)
    real = [c for c in rows if c is not None]
    params = [c.seq.params for c in real]
    greedy = all(p.temperature == 0.0 for p in params)
    penalties = any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params)
    bias_len = max((len(p.logit_bias) for p in params), default=0)
    want_top = any((p.logprobs or 0) > 0 or (p.prompt_logprobs or 0) > 0 for p in params)
    flags = SamplerFlags(
        all_greedy=greedy,
        needs_sort=not greedy and any(p.top_k > 0 or p.top_p < 1.0 for p in params),
        penalties=penalties,
        bias=bias_len > 0,
        num_logprobs=max_logprobs if want_top else 0,
        logprobs=any(p.logprobs is not None or p.prompt_logprobs is not None for p in params),
    )
    b = next(x for x in LOGIT_BIAS_LADDER + (bias_len,) if x >= bias_len) if bias_len else 1
    out_len = bucket(max((c.seq.num_output_tokens for c in real), default=0) + 1) if penalties else 1
    prompt_len = bucket(max((c.seq.num_prompt_tokens for c in real), default=0)) if penalties else 1
    f = {name: np.zeros(r, np.float32) for name in ("temperature", "top_p", "min_p", "presence", "frequency")}
    f["top_p"][:] = 1.0
    rep = np.ones(r, np.float32)
    i32 = {name: np.zeros(r, np.int32) for name in ("top_k", "choice", "out_pos")}
    seeds = np.zeros(r, np.uint32)
    bias_ids, bias_vals = np.zeros((r, b), np.int32), np.zeros((r, b), np.float32)
    out_ids, prompt_ids = np.full((r, out_len), -1, np.int32), np.full((r, prompt_len), -1, np.int32)
    pending = np.full(r, -1, np.int32)
    for i, c in enumerate(rows):
        if c is None:
            continue
        p, seq = c.seq.params, c.seq
        f["temperature"][i], f["top_p"][i], f["min_p"][i] = p.temperature, p.top_p, p.min_p
        f["presence"][i], f["frequency"][i], rep[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        i32["top_k"][i], i32["choice"][i] = max(p.top_k, 0), seq.index
        i32["out_pos"][i] = seq.num_output_tokens
        seeds[i] = (p.seed or 0) & 0xFFFFFFFF
        for j, (tok, val) in enumerate(p.logit_bias):
            bias_ids[i, j], bias_vals[i, j] = tok, val
        if penalties:
            outs = np.asarray(seq.output_token_ids, np.int32)
            out_ids[i, : len(outs)] = outs  # a trailing in-flight token (-1) is filled on device from `pending`
            if seq.num_in_flight:
                pending[i] = prev_rows.get(seq.seq_id, -1)
            prompt_ids[i, : seq.num_prompt_tokens] = seq.prompt_token_ids
    tensors = SamplingTensors(
        temperature=f["temperature"], top_k=i32["top_k"], top_p=f["top_p"], min_p=f["min_p"], seed=seeds,
        choice=i32["choice"], out_pos=i32["out_pos"], presence=f["presence"], frequency=f["frequency"],
        repetition=rep, bias_ids=bias_ids, bias_vals=bias_vals, output_ids=out_ids, prompt_ids=prompt_ids,
        pending=pending,
    )
    return tensors, flags
