"""DraftGate (draft_gate.py): a decode batch that could fuse its steps takes drafts or fused steps,
whichever its calls showed to give more tokens a second. The policy on its own, with calls of
given lengths; then an engine whose gate flips between the two (the same greedy tokens as
transformers, every page back), and engines whose calls take the time a cost model says."""

from __future__ import annotations

import pytest

from tests.engine_support import ROOMY, drain, hf_greedy, tokenizer  # noqa: F401 (a fixture)
from tests.test_engine import assert_pages_returned, hf, make_engine, model, random_ckpt, record_chunks  # noqa: F401
from tests.test_speculation import repeating_prompts
from worker.engine import speculation
from worker.engine.draft_gate import MAX_TRIES, PROBE, SPACING, DraftGate
from worker.engine.sampling_params import SamplingParams


class Calls:
    """Calls of given lengths, one after another, read back into `gate`."""

    def __init__(self, gate: DraftGate):
        self.gate, self.now = gate, 0.0

    def run(self, kind: str, tokens: int, seconds: float, num_seqs: int = 8, times: int = 1) -> None:
        for _ in range(times):
            launched, self.now = self.now, self.now + seconds
            self.gate.record(kind, num_seqs, tokens, launched, self.now)


DRAFTS = ("drafts", 40, 0.0025)  # 8 sequences, their drafts all standing: 16k tokens/s
FUSED = ("fused", 128, 0.0055)  # 16 steps in one call: 23k tokens/s


def test_each_kind_is_measured_then_the_faster_one_is_chosen():
    gate = DraftGate()
    calls = Calls(gate)
    assert gate.drafts(8)  # nothing measured: drafts first
    calls.run(*DRAFTS, times=PROBE)
    assert not gate.drafts(8)  # then fused steps
    calls.run(*FUSED, times=PROBE)
    assert not gate.drafts(8) and gate.choices() == {8: "fused"}
    assert not gate.drafts(15) and gate.drafts(16) and gate.drafts(7)  # 8-15 sequences share a bucket
    calls.run("drafts", 5, 0.001, num_seqs=1, times=PROBE)  # batch 1: 5k tokens/s from drafts, 3.2k fused
    calls.run("fused", 16, 0.005, num_seqs=1, times=PROBE)
    assert gate.drafts(1) and gate.choices() == {1: "drafts", 8: "fused"}


def test_one_slow_call_does_not_decide():
    """A call that compiled its variant (or met a busy host) is left out of its kind's rate."""
    gate = DraftGate()
    calls = Calls(gate)
    calls.run("drafts", 40, 0.0015, times=PROBE - 1)  # 27k tokens/s
    calls.run("drafts", 40, 0.2)
    calls.run(*FUSED, times=PROBE)
    assert gate.drafts(8)


def test_calls_with_drafts_count_by_their_tokens_in_all():
    """Calls with drafts give many tokens, one or none (llama-100m at batch 1, one 14 ms step
    each): their sum over their time is the rate, 107 tokens/s here against fused steps' 72; the
    median call's rate would say 36."""
    gate = DraftGate()
    calls = Calls(gate)
    for tokens in (5, 0, 0, 1):
        calls.run("drafts", tokens, 0.014, num_seqs=1)
    calls.run("fused", 6, 0.083, num_seqs=1, times=PROBE)
    assert gate.drafts(1) and gate.choices() == {1: "drafts"}


def test_a_call_behind_another_counts_from_that_ones_read_back():
    """A call launched while the one before still ran took only the time from that one's read-back;
    calls of neither kind (prompts, single steps) count nowhere but still end the time before."""
    gate = DraftGate()
    gate.record("fused", 8, 128, 0.0, 0.010)
    gate.record("fused", 8, 128, 0.005, 0.016)  # behind the first: 6 ms, not 11
    gate.record(None, 8, 8, 0.016, 0.100)
    gate.record("fused", 8, 128, 0.050, 0.106)  # behind the one of neither kind: 6 ms
    assert [seconds for _, seconds in gate._buckets[8].calls["fused"]] == pytest.approx([0.010, 0.006, 0.006])


def test_the_loser_is_tried_again_less_often_after_each_try_that_changes_nothing():
    """Fused steps won: drafts are tried again once fused calls have run SPACING times as long as
    drafts' last PROBE calls, then twice that after each try that changed nothing, up to
    2**MAX_TRIES times."""
    gate = DraftGate()
    calls = Calls(gate)
    calls.run(*DRAFTS, times=PROBE)
    calls.run(*FUSED, times=PROBE)
    waits = []
    for _ in range(MAX_TRIES + 2):
        for n in range(1, 10_000):
            calls.run(*FUSED)
            if gate.drafts(8):
                break
        waits.append(n)
        calls.run(*DRAFTS, times=PROBE)  # tried: as slow as before
        assert not gate.drafts(8)
    trial = PROBE * DRAFTS[2]
    want = [-(-SPACING * 2 ** min(k, MAX_TRIES) * trial // FUSED[2]) for k in range(MAX_TRIES + 2)]
    assert waits == pytest.approx(want, abs=1), (waits, want)


def test_text_that_starts_repeating_gets_its_drafts_back():
    gate = DraftGate()
    calls = Calls(gate)
    calls.run("drafts", 12, 0.0025, times=PROBE)  # few drafts stand
    calls.run(*FUSED, times=PROBE)
    for _ in range(1000):
        if gate.drafts(8):
            break
        calls.run(*FUSED)
    calls.run("drafts", 96, 0.0025, times=PROBE)  # now most do: 38k tokens/s
    assert gate.drafts(8) and gate.choices() == {8: "drafts"}
    for _ in range(1000):  # fused steps are tried again in their turn, and lose
        if not gate.drafts(8):
            break
        calls.run("drafts", 96, 0.0025)
    assert not gate.drafts(8)
    calls.run(*FUSED, times=PROBE)
    assert gate.drafts(8)


class Flips:
    """A gate that lets drafts in for two decisions, then not for one, and so on."""

    def __init__(self):
        self.n = 0

    def drafts(self, num_seqs: int) -> bool:
        self.n += 1
        return self.n % 3 != 0

    def record(self, *call) -> None:
        pass


def test_greedy_tokens_equal_generate_as_the_gate_flips(model, tokenizer, hf, monkeypatch):  # noqa: F811
    """Fused steps scheduled while drafts are in flight, taken back whole when a draft falls, and
    drafts looked up past a fused call read back first: the tokens stay transformers' own."""
    engine = make_engine(model, tokenizer, ROOMY, speculative_tokens=4, decode_steps=4)
    engine.scheduler.gate = Flips()
    chunks, cuts, settle = record_chunks(engine), [], speculation.settle

    def spy(seq, chunk, drawn):  # each newer chunk a check took back: its steps, and the rows still counted
        out = settle(seq, chunk, drawn)
        if seq.cut is not None and seq.cut[0] is not chunk:
            cuts.append((seq.cut[0].num_steps, seq.cut[1]))
        return out

    monkeypatch.setattr(speculation, "settle", spy)
    free = engine.allocator.num_free_pages
    prompts = repeating_prompts(len(tokenizer), 4)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    results = drain(engine)
    for i, p in enumerate(prompts):
        assert results[(f"r{i}", 0)].token_ids == hf_greedy(hf, p, 48), f"prompt {i}"
    assert any(c["drafts"] for c in chunks) and any(c["steps"] > 1 for c in chunks)
    assert (4, 0) in cuts and (1, 1) in cuts, cuts  # fused steps taken back whole; drafts on a wrong guess
    assert_pages_returned(engine, free)


class Costed(DraftGate):
    """The real gate, with each call taking the time `cost(kind)` says instead of the host's."""

    def __init__(self, cost):
        super().__init__()
        self.cost, self.now = cost, 0.0

    def record(self, kind, num_seqs, tokens, launched_at, read_at) -> None:
        launched = self.now
        self.now += self.cost[kind] if kind else 0.0
        super().record(kind, num_seqs, tokens, launched, self.now)


@pytest.mark.parametrize("winner, cost", [
    ("fused", {"drafts": 2.0, "fused": 1.5}),  # a call's overhead and the drafts' rows dominate (small model, CPU)
    ("drafts", {"drafts": 1.0, "fused": 4.0}),  # each step costs as much as a call with drafts
])
def test_the_engine_takes_the_kind_of_call_that_gives_more_tokens(model, tokenizer, hf, winner, cost):  # noqa: F811
    engine = make_engine(model, tokenizer, ROOMY, speculative_tokens=4, decode_steps=4)
    engine.scheduler.gate = gate = Costed(cost)
    chunks = record_chunks(engine)
    prompts = repeating_prompts(len(tokenizer), 4)[1:] + [[7, 8, 9, 10] * 5]  # one loops: its drafts stand
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    results = drain(engine)
    for i, p in enumerate(prompts):
        assert results[(f"r{i}", 0)].token_ids == hf_greedy(hf, p, 64), f"prompt {i}"
    assert gate.choices()[4] == winner, gate.choices()
    decode = [c for c in chunks if c["n"] == 1 and c["samples"]]
    half = decode[len(decode) // 2 :]  # after the first measurements
    drafted, fused = sum(bool(c["drafts"]) for c in half), sum(c["steps"] > 1 for c in half)
    # (a few drafts where fused steps won: smaller batches at the end, which their own bucket measures)
    assert (drafted > fused) if winner == "drafts" else (8 * drafted < fused), (drafted, fused)
