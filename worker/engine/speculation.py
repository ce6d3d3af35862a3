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
output is the same.

Steps overlap as without drafts: the next step is scheduled while the last one is on device, on
the guess that its drafts all stand, with drafts looked up past them and past a guess of the
token its last row draws (`ScheduledChunk.guess`). When the last step is read back and a draft
fell, the newer step's rows for that sequence are taken back too; when the guessed token was
wrong, the newer step's draft rows are (`settle`). A rejected draft costs its row's compute, and
its step's: a step with drafts is not fused with the next ones (`EngineConfig.decode_steps`). So a
sequence whose drafts all fell, or whose lookup found nothing, waits before it looks again,
twice as long after each such miss in a row (`back_off`).
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

    def propose(self, seq, k: int, tail: tuple[int, ...] = ()) -> list[int]:
        """`k` tokens that followed the latest earlier occurrence of the last n tokens of `seq`'s
        known tokens (a Sequence: its prompt and the output read back) then `tail` (what the tokens
        in flight but the newest are taken to be), for the longest n in [n_min, n_max] that occurs
        earlier; [] when none does. Where fewer than `k` followed it, those repeat: the last n
        tokens recur every `size - 1 - end` tokens, so the text is taken to go on doing so."""
        known = seq.num_known_tokens
        size = known + len(tail)
        if k <= 0 or size <= self.n_min:
            return []
        lo = max(0, self.indexed - self.n_max + 1)
        window = seq.token_range(lo, known) + list(tail)  # what the new runs and the last n need
        for end in range(self.indexed, known - 1):  # the runs of known tokens ending before the last one
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                self.ends[hash(tuple(window[end - n + 1 - lo : end + 1 - lo]))] = end
        self.indexed = max(self.indexed, known - 1)
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            end = self.ends.get(hash(tuple(window[-n:])))
            if end is not None:  # what followed it, up to now: a period, repeated (a loop goes on)
                span = seq.token_range(end + 1, known) + list(tail[max(0, end + 1 - known) :])
                return (span * -(-k // len(span)))[:k]
        return []


def accepted(drafts: tuple[int, ...] | list[int], drawn: list[int]) -> int:
    """How many leading drafts the step's draws confirm: `drawn[j]` is the token sampled after the
    row's last token and drafts[:j]; draft j stands while it equals drawn[j]."""
    n = 0
    while n < len(drafts) and drawn[n] == drafts[n]:
        n += 1
    return n


def settle(seq, chunk, drawn: list[int]) -> tuple[int, int, int]:
    """When the step that computed `chunk` of `seq` is read back, `drawn` the tokens its rows drew
    (the chunk's own row, then one per draft; a fused chunk's steps): (how many of them `seq`
    keeps, drafts checked, drafts that stood). Takes back the in-flight tokens, with their K/V,
    that rest on a draft that fell: this chunk's after it, and all of a newer chunk of `seq` in
    flight (`Sequence.cut`, 0 rows kept); or on a wrong guess of the token drawn last here: the
    newer chunk's drafts (1 row kept). Backs off after a check where no draft stood. A chunk
    whose rows an older step's check took back keeps none of them, or its own row only."""
    drafts, cut = chunk.drafts, seq.cut
    if cut is not None and cut[0] is chunk:
        seq.cut = None
        if not cut[1]:
            return 0, 0, 0
        drafts, drawn = (), drawn[:1]  # counted when they were taken back
    later = seq.last_chunk if seq.last_chunk is not chunk else None  # scheduled before this was read back
    stood, wrong_guess = accepted(drafts, drawn), False
    kept, checked = (stood + 1 if drafts else len(drawn)), len(drafts)
    if stood < len(drafts):
        if later is not None:
            seq.reject_in_flight(later.num_steps + len(later.drafts) if later.samples else 0)
            seq.cut, checked = (later, 0), checked + len(later.drafts)
        seq.reject_in_flight(len(drafts) - stood)
    elif later is not None and later.guess is not None and later.guess != drawn[kept - 1]:
        seq.reject_in_flight(len(later.drafts))
        seq.cut, checked, wrong_guess = (later, 1), checked + len(later.drafts), True
    if drafts:
        back_off(seq, stood)
    if wrong_guess:  # the newer chunk's drafts all fell
        back_off(seq, 0)
    return kept, checked, stood


def read_back(seq, chunk, tokens_by_row: list[list[int]], row: int, prev_rows: dict[int, int]):
    """The tokens `seq` keeps of `chunk`, whose step drew `tokens_by_row` ([rows][fused steps]) with
    the chunk's own row at `row` (then one row per draft), and the rows they came from (a slice),
    drafts checked, drafts that stood (`settle`). Where a newer step's drafts fell on a wrong guess,
    its own row drew the newest token: `prev_rows` (the runner's row of each sequence's newest token)
    says so."""
    drafts = chunk.drafts
    tokens = [t[0] for t in tokens_by_row[row : row + 1 + len(drafts)]] if drafts else tokens_by_row[row][: chunk.num_steps]
    kept, checked, stood = settle(seq, chunk, tokens)
    if seq.cut is not None and seq.cut[1]:
        prev_rows[seq.seq_id] -= len(seq.cut[0].drafts)
    return tokens[:kept], slice(row, row + (kept if drafts else 1)), checked, stood


def back_off(seq, stood: int) -> None:
    """After a check of `seq`'s drafts in which `stood` of them stood (or a lookup that found none:
    0): none, and it looks again only BACK_OFF, 2 x BACK_OFF, ... tokens on (at most MAX_BACK_OFF,
    longer than a fused call's steps, so that steps overlap meanwhile); any, and at the next step."""
    seq.draft_misses = 0 if stood else seq.draft_misses + 1
    wait = min(BACK_OFF << (seq.draft_misses - 1), MAX_BACK_OFF) if not stood else 0
    seq.drafts_from = seq.num_tokens + wait
