"""Prompt-lookup speculation: draft tokens from a sequence's own text, checked by the model. No JAX.

Where a sequence's last few tokens occurred before (in its prompt or its output), the tokens that
followed them then are a guess at what follows now: summaries, code edits, extraction and
retrieval answers copy long runs of their prompt. The scheduler gives a decode row such drafts
(`ScheduledChunk.drafts`); the step computes the row's last token and every draft as rows of
their own, each sampling the token after it as if the drafts before it were already the
sequence's. Those draws use each position's own key (seed, choice, output index), so they are
the tokens the sequence would sample one step at a time. The engine keeps the draws up to and
including the first that differs from its draft (`accepted`): one token a step at worst, as
without drafts, and up to every draft plus one where the guess holds. Greedy or sampled, the
output is the same; a rejected draft costs its row's compute and nothing else.
"""

from __future__ import annotations

import numpy as np

NGRAM_MAX = 4  # the longest run of last tokens looked up first
NGRAM_MIN = 2  # the shortest: a single token matches too often to guess well


def propose(tokens: list[int], k: int, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens of
    `tokens`, for the longest n in [n_min, n_max] that occurs earlier; [] when none does."""
    if k <= 0 or len(tokens) <= n_min:
        return []
    ids = np.asarray(tokens, np.int64)  # [L]
    for n in range(min(n_max, len(ids) - 1), n_min - 1, -1):
        tail = ids[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # [L - n, n]: every earlier run
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the token after the latest earlier run
            return ids[start : start + k].tolist()
    return []


def accepted(drafts: tuple[int, ...] | list[int], drawn: list[int]) -> int:
    """How many leading drafts the step's draws confirm: `drawn[j]` is the token sampled after the
    row's last token and drafts[:j]; draft j stands while it equals drawn[j]."""
    n = 0
    while n < len(drafts) and drawn[n] == drafts[n]:
        n += 1
    return n
