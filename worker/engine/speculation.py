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
output is the same. A rejected draft costs its row's compute, and its step's: a step with drafts
is not fused with the next ones (`EngineConfig.decode_steps`), and while some sequence may draft
the engine reads each step back before scheduling the next (drafts come from tokens read back).
So a sequence whose drafts all fell, or whose lookup found nothing, waits before it looks again,
twice as long after each such miss in a row (`back_off`); while every sequence waits, steps overlap.
"""

from __future__ import annotations

NGRAM_MAX = 4  # the longest run of last tokens looked up first
NGRAM_MIN = 3  # the shortest: one or two tokens match too often to guess well
BACK_OFF = 8  # tokens a sequence goes without drafts after a check where none stood, doubled after each
# such miss in a row: a failed check costs a step of its own, on the CPU several fused steps' worth
MAX_BACK_OFF = 128  # at most


class DraftIndex:
    """Where each run of NGRAM_MIN..NGRAM_MAX tokens of one sequence last ended, kept up to date as
    the sequence grows (a sequence's tokens only ever grow: rejected drafts are never its tokens),
    so a step's lookup costs a few dictionary reads, not a pass over the sequence. Runs are keyed
    by their hash: a collision only proposes drafts that then fail their check."""

    def __init__(self, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN):
        self.n_max, self.n_min = n_max, n_min
        self.ends: dict[int, int] = {}  # hash of a run -> index of its last token, the latest
        self.indexed = 0  # runs ending before this index are in `ends`

    def propose(self, seq, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens of
        `seq` (a Sequence: its prompt and output tokens), for the longest n in [n_min, n_max] that
        occurs earlier; [] when none does."""
        size = seq.num_tokens
        if k <= 0 or size <= self.n_min:
            return []
        lo = max(0, self.indexed - self.n_max + 1)
        window = seq.token_range(lo, size)  # what the new runs and the last n need, not the whole sequence
        for end in range(self.indexed, size - 1):  # the runs ending before the last token
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                self.ends[hash(tuple(window[end - n + 1 - lo : end + 1 - lo]))] = end
        self.indexed = max(self.indexed, size - 1)
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            end = self.ends.get(hash(tuple(window[-n:])))
            if end is not None:
                return seq.token_range(end + 1, min(end + 1 + k, size))
        return []


def accepted(drafts: tuple[int, ...] | list[int], drawn: list[int]) -> int:
    """How many leading drafts the step's draws confirm: `drawn[j]` is the token sampled after the
    row's last token and drafts[:j]; draft j stands while it equals drawn[j]."""
    n = 0
    while n < len(drafts) and drawn[n] == drafts[n]:
        n += 1
    return n


def settle(seq, drafts: tuple[int, ...], drawn: list[int]) -> int:
    """After a step checked `seq`'s `drafts`, its rows drawing `drawn` (the chunk's own row first):
    take back the tokens in flight after the first draw that parts from its draft (and their K/V),
    back off if no draft stood. Returns how many stood; the draws up to one past them are kept."""
    stood = accepted(drafts, drawn)
    seq.reject_in_flight(len(drafts) - stood)
    back_off(seq, stood)
    return stood


def back_off(seq, stood: int) -> None:
    """After a check of `seq`'s drafts in which `stood` of them stood (or a lookup that found none:
    0): none, and it looks again only BACK_OFF, 2 x BACK_OFF, ... tokens on (at most MAX_BACK_OFF,
    longer than a fused call's steps, so that steps overlap meanwhile); any, and at the next step."""
    seq.draft_misses = 0 if stood else seq.draft_misses + 1
    wait = min(BACK_OFF << (seq.draft_misses - 1), MAX_BACK_OFF) if not stood else 0
    seq.drafts_from = seq.num_tokens + wait
