"""DraftGate: drafts or fused steps, chosen from measured tokens per second. No JAX.

A decode batch whose sequences could all fuse their next steps (`EngineConfig.decode_steps`) has
two ways to go. It can take drafts (speculation.py): one step that checks them, kept only as far
as they stand. Or it can fuse: many steps in one call, with one call's overhead for all of them.
Which gives more tokens a second depends on the model, the batch size, the host and how well the
text repeats. On a 2-core CPU a small model's fused calls of 16 steps at 8 sequences gave 1.45x the
tokens a second of calls with drafts that nearly all stood, while at batch 1 the calls with drafts
gave twice the fused calls' (docs/design-notes.md, "Speculation"). So the gate measures both.
Each call read back adds its tokens and its time to its kind ("drafts" or "fused") for its batch
size, rounded down to a power of two. A batch size starts by trying each kind for PROBE calls,
then takes the one whose last PROBE calls gave more tokens for their time in all. A call with
drafts gives many tokens, one, or none (a draft before it fell), so the sums count, not each
call's rate; a call that took SLOW times the median call's time (it compiled, or the host
stalled) is left out. The other kind is tried again once the winner has run SPACING times as
long as that kind's last PROBE calls took, and after each try that changes nothing twice as long,
up to 2**MAX_TRIES times: a try's own calls take at most 1/SPACING of the time, less and less
(the switches around a try, a read-back before the first step with drafts and fused calls taken
back behind a fallen draft, cost more than its calls), yet text that starts repeating gets its
drafts back.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

PROBE = 4  # calls of a kind measured before its rate counts; its last PROBE give it
SLOW = 3.0  # a call that took this many times the median call's time is left out of its kind's rate
SPACING = 64  # the winner runs this many times as long as a try of the other kind takes before the next
MAX_TRIES = 4  # the spacing doubles after each try in a row that changes nothing, this many times at most
KINDS = ("drafts", "fused")


@dataclass
class _Bucket:
    """What the gate knows of one batch size: the latest calls of each kind, (tokens, seconds)."""

    calls: dict[str, deque] = field(default_factory=lambda: {k: deque(maxlen=PROBE) for k in KINDS})
    winner: str | None = None  # the kind chosen when both were last measured
    on_winner: float = 0.0  # seconds of the winner's calls since it was chosen or last tried against
    tries: int = 0  # tries of the other kind in a row that changed nothing
    trying: bool = False  # the other kind's calls were forgotten: it is being tried again

    def measured(self, kind: str) -> bool:
        return len(self.calls[kind]) >= PROBE

    def rate(self, kind: str) -> float:
        """Tokens per second of the kind's last calls, those that took SLOW times the median left out."""
        cap = SLOW * statistics.median(t for _, t in self.calls[kind])
        kept = [(n, t) for n, t in self.calls[kind] if t <= cap]
        return sum(n for n, _ in kept) / sum(t for _, t in kept)


class DraftGate:
    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}
        self._read_at = 0.0  # when the last call was read back

    def drafts(self, num_seqs: int) -> bool:
        """Whether a decode batch of `num_seqs` sequences that could fuse its steps should take
        drafts instead: until both kinds are measured, whichever is not yet; then the winner."""
        b = self._buckets.get(_key(num_seqs))
        if b is None or not b.measured("drafts"):
            return True
        if not b.measured("fused"):
            return False
        return b.rate("drafts") >= b.rate("fused")

    def record(self, kind: str | None, num_seqs: int, tokens: int, launched_at: float, read_at: float) -> None:
        """Each call read back: one of `kind` ("drafts": some sequence's drafts checked; "fused":
        several steps; None: neither, not counted) for `num_seqs` sequences, launched and read back
        at those times (time.perf_counter), gave `tokens` tokens. Its time: from its launch, or from
        the read-back of the call before where it ran behind that one, to its own read-back."""
        seconds = read_at - max(launched_at, self._read_at)
        self._read_at = read_at
        if kind is None or seconds <= 0:
            return
        b = self._buckets.setdefault(_key(num_seqs), _Bucket())
        b.calls[kind].append((tokens, seconds))
        if not (b.measured("drafts") and b.measured("fused")):
            return
        winner = "drafts" if b.rate("drafts") >= b.rate("fused") else "fused"
        if b.trying or winner != b.winner:  # a choice made (the first), changed, or confirmed by a try
            b.tries = b.tries + 1 if b.trying and winner == b.winner else 0
            b.winner, b.on_winner, b.trying = winner, 0.0, False
        elif kind == winner:
            b.on_winner += seconds
            other = "fused" if winner == "drafts" else "drafts"
            if b.on_winner >= SPACING * (1 << min(b.tries, MAX_TRIES)) * sum(t for _, t in b.calls[other]):
                b.calls[other].clear()  # try it again: its next calls measure it afresh
                b.trying = True

    def choices(self) -> dict[int, str]:
        """Batch size (a power of two: that size up to twice it) -> the kind chosen, where both are measured."""
        return {k: b.winner for k, b in sorted(self._buckets.items()) if b.winner is not None}


def _key(num_seqs: int) -> int:
    """Batch sizes share a bucket from a power of two up to the next."""
    return 1 << (max(1, num_seqs).bit_length() - 1)
