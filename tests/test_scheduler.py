"""Scheduler driven by a fake device: budgets, chunked prefill, preemption, prefix cache, n > 1.

The fake device writes every computed token id into its page slot and, for each chunk, checks
that every earlier position of the sequence reads back the right token through the page table:
that is what attention would see. Sampled tokens are a pure function of (seq_id, position),
as with per-request seeds, so a recomputation reproduces them.
"""

from __future__ import annotations

import random
from collections import deque

from worker.engine.config import EngineConfig
from worker.engine.page_allocator import PageAllocator
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import LIGHT_DECODE_ROWS, ScheduledBatch, Scheduler
from worker.engine.sequence import IN_FLIGHT, Sequence, SequenceGroup, SequenceStatus

EOS_MOD = 97  # a sampled token divisible by this is EOS unless ignore_eos


def sampled(seq: Sequence, position: int) -> int:
    """The token the fake device samples for `seq` at `position`."""
    return 1 + (seq.seq_id * 7919 + position * 104729) % 5000


class FakeDevice:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.size = scheduler.config.page_size
        self.slots: dict[tuple[int, int], int] = {}
        self.steps = 0

    def token_at(self, seq: Sequence, position: int) -> int:
        if position < seq.num_tokens:
            token = seq.token_range(position, position + 1)[0]
            if token != IN_FLIGHT:
                return token
        return sampled(seq, position)

    def run(self, batch: ScheduledBatch) -> list[tuple[Sequence, list[int]]]:
        """Compute the batch (before `advance`, as a dispatch would); returns sampled ids
        (none for a chunk that completes a prompt-only request)."""
        alloc = self.scheduler.allocator
        results = []
        for chunk in batch.chunks:
            seq = chunk.seq
            positions = list(range(chunk.start, chunk.end)) + [chunk.end + i for i in range(chunk.num_steps - 1)]
            assert len(seq.page_table) * self.size >= positions[-1] + 1
            for p in positions:
                page = seq.page_table[p // self.size]
                assert page >= alloc.reserved_pages
                assert alloc.refcount(page) == 1, "wrote into a shared page"
                self.slots[(page, p % self.size)] = self.token_at(seq, p)
            for q in range(positions[-1] + 1):
                assert self.slots.get((seq.page_table[q // self.size], q % self.size)) == self.token_at(seq, q)
            if chunk.samples:
                results.append((seq, [sampled(seq, chunk.end + i) for i in range(chunk.num_steps)]))
            elif chunk.end == seq.num_prompt_tokens and self.scheduler.room(seq) == 0:
                results.append((seq, []))
        self.steps += 1
        return results


def check_batch(sched: Scheduler, batch: ScheduledBatch) -> None:
    cfg = sched.config
    assert batch.num_tokens <= cfg.max_num_batched_tokens
    assert batch.num_seqs <= cfg.max_num_seqs
    assert len({id(c.seq) for c in batch.chunks}) == batch.num_seqs
    for c in batch.chunks:
        seq = c.seq
        assert seq.status == SequenceStatus.RUNNING and c.num_tokens >= 1
        assert c.start == seq.num_computed_tokens and c.end <= seq.num_tokens
        last = c.end + c.num_steps - 1  # tokens whose K/V exist after the chunk
        assert last <= sched.max_model_len
        if c.samples:
            assert c.end == seq.num_tokens
            assert seq.num_tokens + c.num_steps <= sched.max_model_len
            if seq.params.max_tokens is not None:
                assert seq.num_output_tokens + c.num_steps <= seq.params.max_tokens
        if c.num_steps > 1:
            assert c.is_decode
    for seq in batch.finished:
        assert seq.is_finished and seq.finish_reason == "length"


def read_back(sched: Scheduler, results: list[tuple[Sequence, list[int]]]) -> None:
    """The engine's postprocess: resolve in-flight tokens, finish on EOS or limits."""
    for seq, tokens in results:
        if not tokens:  # prompt logprobs would be published here
            sched.finish(seq, "length")
        for token in tokens:
            if seq.is_finished:
                break  # late results of a finished sequence are dropped
            seq.resolve_in_flight([token])
            known_out = seq.num_output_tokens - seq.num_in_flight
            if token % EOS_MOD == 0 and not seq.params.ignore_eos:
                sched.finish(seq, "stop", token)
            elif (seq.params.max_tokens is not None and known_out >= seq.params.max_tokens) or (
                seq.num_known_tokens >= sched.max_model_len
            ):
                sched.finish(seq, "length")


def drive(sched: Scheduler, depth=0, decode_steps=1, max_steps=10_000, on_step=None, device=None) -> FakeDevice:
    """Run until everything finishes; `depth` steps stay in flight before a read-back."""
    device = device or FakeDevice(sched)
    in_flight: deque = deque()
    for _ in range(max_steps):
        if not sched.has_unfinished() and not in_flight:
            return device
        before = list(sched.running)
        batch = sched.schedule(decode_steps)
        if batch is not None:
            check_batch(sched, batch)
        if batch is not None and batch.chunks:
            in_flight.append(device.run(batch))
            sched.advance(batch)
        if on_step is not None:  # between steps: new arrivals, aborts
            on_step(before, batch)
        elif batch is None and not in_flight:
            raise AssertionError("deadlock: nothing scheduled, nothing in flight")
        if in_flight and (len(in_flight) > depth or batch is None or not batch.chunks):
            read_back(sched, in_flight.popleft())
    raise AssertionError("did not finish")


def make(num_pages=64, page_size=4, max_num_seqs=8, max_tokens=32, max_model_len=256, prefix=True):
    cfg = EngineConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens, page_size=page_size,
        num_pages=num_pages, enable_prefix_cache=prefix,
    )
    return Scheduler(cfg, PageAllocator(num_pages, page_size, prefix), max_model_len)


class Requests:
    def __init__(self) -> None:
        self.next_id = 0

    def __call__(self, sched: Scheduler, prompt: list[int], **params) -> SequenceGroup:
        group = SequenceGroup.create(f"r{self.next_id}", prompt, SamplingParams(**params), self.next_id * 100, 0.0)
        self.next_id += 1
        sched.add(group)
        return group


def test_chunked_prefill_respects_token_budget():
    sched, new = make(max_tokens=16), Requests()
    long = new(sched, list(range(1, 41)), max_tokens=3, ignore_eos=True).sequences[0]
    batch = sched.schedule()
    assert [(c.start, c.num_tokens, c.samples) for c in batch.chunks] == [(0, 16, False)]
    sched.advance(batch)
    assert long.num_computed_tokens == 16 and long.output_token_ids == []
    short = new(sched, [5, 6, 7], max_tokens=3, ignore_eos=True).sequences[0]
    batch = sched.schedule()  # running first: the long prefill takes the whole budget
    assert [(c.seq, c.start, c.num_tokens, c.samples) for c in batch.chunks] == [(long, 16, 16, False)]
    sched.advance(batch)
    batch = sched.schedule()
    assert [(c.seq, c.start, c.num_tokens, c.samples) for c in batch.chunks] == [
        (long, 32, 8, True), (short, 0, 3, True)]
    assert not batch.is_pure_decode and batch.num_tokens == 11
    sched.advance(batch)
    assert short.output_token_ids == [IN_FLIGHT] and short.num_in_flight == 1
    batch = sched.schedule()
    assert batch.is_pure_decode and [(c.start, c.num_tokens) for c in batch.chunks] == [(40, 1), (3, 1)]


def test_at_light_load_a_step_takes_at_most_prompt_cap_prompt_tokens():
    """While 1 to LIGHT_DECODE_ROWS running sequences have sampled and at most one request waits,
    prompt chunks (running ones' and newcomers') share `prompt_cap` tokens a step; decodes are not
    capped. Before any stream, beside more streams, or with a queue, prompts take the whole budget.
    Arrivals come one at a time, then in bursts; everything finishes with its pages back."""
    sched, new, rng = make(num_pages=200, max_tokens=48, max_num_seqs=12), Requests(), random.Random(5)
    sched.prompt_cap = 8
    prompt = lambda: [rng.randrange(1, 99) for _ in range(rng.randrange(20, 40))]  # noqa: E731
    groups = [new(sched, prompt(), max_tokens=16, ignore_eos=True)]
    seen = []  # (prompt tokens, streams, waiting) per step

    def on_step(before, batch):
        tokens = sum(c.num_tokens for c in batch.chunks if c.num_tokens > 1) if batch else 0
        seen.append((tokens, sum(s.num_output_tokens > 0 for s in before), waiting))
        if len(seen) < 12:  # one at a time
            groups.append(new(sched, prompt(), max_tokens=16, ignore_eos=True))
        elif len(seen) in (14, 30):  # bursts
            groups.extend(new(sched, prompt(), max_tokens=16, ignore_eos=True) for _ in range(6))

    waiting = len(sched.waiting)
    schedule = sched.schedule

    def count_waiting(*args):  # the queue as the step is scheduled
        nonlocal waiting
        waiting = len(sched.waiting)
        return schedule(*args)

    sched.schedule = count_waiting
    drive(sched, depth=1, decode_steps=4, on_step=on_step)
    light = [tokens for tokens, streams, queued in seen if 0 < streams <= LIGHT_DECODE_ROWS and queued <= 1]
    assert seen[0][0] > 8 and max(light) == 8  # nothing streams at first: the whole prompt at once
    assert max(tokens for tokens, streams, queued in seen if streams > LIGHT_DECODE_ROWS or queued > 1) > 8
    assert all(g.sequences[0].num_output_tokens == 16 for g in groups)
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages


def test_a_step_takes_no_more_prompt_chunks_than_max_prefill_chunks():
    """Warm-up caps a step's prompt chunks at the widest compiled envelope's rows: the rest of a
    burst of short prompts waits a step instead of the step needing a shape nothing compiled."""
    sched, new = make(max_tokens=64), Requests()
    sched.max_prefill_chunks = 3
    groups = [new(sched, [i + 1, i + 2, i + 3], max_tokens=4, ignore_eos=True) for i in range(7)]
    steps = []  # (prompt chunks, decode chunks) of each step
    drive(sched, on_step=lambda before, batch: steps.append(
        (sum(c.num_tokens > 1 for c in batch.chunks), sum(c.num_tokens == 1 for c in batch.chunks))))
    assert steps[:4] == [(3, 0), (3, 3), (1, 6), (0, 7)]  # arrival order kept; decode rows are not capped
    assert all(g.sequences[0].num_output_tokens == 4 for g in groups)
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages


def test_everything_finishes_and_pages_return():
    sched, new = make(), Requests()
    groups = [new(sched, list(range(i, i + 5 + 3 * i)), max_tokens=4 + i, ignore_eos=True) for i in range(10)]
    drive(sched, depth=1)
    for i, g in enumerate(groups):
        seq = g.sequences[0]
        assert seq.finish_reason == "length" and len(seq.output_token_ids) == 4 + i
        assert seq.output_token_ids == [sampled(seq, seq.num_prompt_tokens + k) for k in range(4 + i)]
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages
    assert not sched._groups


def test_preemption_with_tiny_page_pool():
    for depth in (0, 1, 2):
        sched, new = make(num_pages=13, page_size=4, max_num_seqs=6, max_tokens=24), Requests()
        groups = [new(sched, list(range(100 * i, 100 * i + 6)), max_tokens=20, ignore_eos=True) for i in range(6)]
        drive(sched, depth=depth)
        assert sched.num_preemptions > 0
        for g in groups:
            seq = g.sequences[0]
            assert seq.finish_reason == "length" and seq.num_output_tokens == 20
            assert seq.output_token_ids == [sampled(seq, 6 + k) for k in range(20)]
        assert sched.allocator.num_free_pages == 12


def test_preempted_sequence_goes_to_front_and_keeps_outputs():
    sched, new = make(num_pages=5, page_size=2, max_num_seqs=2, max_tokens=8), Requests()
    old = new(sched, [1, 2, 3], max_tokens=6, ignore_eos=True).sequences[0]
    young = new(sched, [4, 5, 6], max_tokens=6, ignore_eos=True).sequences[0]
    later = new(sched, [7], max_tokens=1, ignore_eos=True).sequences[0]
    device = FakeDevice(sched)
    for _ in range(4):
        batch = sched.schedule()
        if any(s.status == SequenceStatus.WAITING for s in (young,)):
            break
        results = device.run(batch)
        sched.advance(batch)
        read_back(sched, results)
    assert young.status == SequenceStatus.WAITING and sched.num_preemptions == 1
    assert list(sched.waiting)[:2] == [young, later]
    assert young.num_computed_tokens == 0 and young.page_table == [] and young.num_output_tokens > 0
    assert [c.seq for c in batch.chunks] == [old]


def test_preemption_waits_for_in_flight_tokens():
    """A victim with tokens in flight is not preempted; the needy one sits the step out."""
    sched, new = make(num_pages=5, page_size=2, max_num_seqs=2, max_tokens=8), Requests()
    old = new(sched, [1, 2, 3], max_tokens=6, ignore_eos=True).sequences[0]
    young = new(sched, [4, 5, 6], max_tokens=6, ignore_eos=True).sequences[0]
    batch = sched.schedule()
    sched.advance(batch)  # both have an in-flight token; 4 pages used, 0 free
    batch = sched.schedule()  # both decode position 3 (pages 2 hold it): no new pages needed
    sched.advance(batch)
    assert sched.allocator.num_free_pages == 0 and young.num_in_flight == 2
    batch = sched.schedule()  # old needs a page for position 4; young has in-flight tokens
    assert batch is None and sched.num_preemptions == 0
    for seq in (old, young):
        while seq.num_in_flight:
            seq.resolve_in_flight([9])
    batch = sched.schedule()
    assert sched.num_preemptions == 1 and young.status == SequenceStatus.WAITING
    assert [c.seq for c in batch.chunks] == [old]


def test_sequence_too_long_for_all_pages_finishes_with_length():
    sched, new = make(num_pages=5, page_size=4), Requests()  # 16 tokens of pages
    big = new(sched, list(range(1, 18)), max_tokens=4).sequences[0]
    grows = new(sched, list(range(1, 14)), max_tokens=10, ignore_eos=True).sequences[0]
    batch = sched.schedule()
    assert batch.finished == [big] and big.finish_reason == "length"
    drive(sched)
    assert grows.finish_reason == "length"
    assert grows.num_tokens == 17  # 16 tokens of K/V fit; the last one sampled from them
    assert sched.allocator.num_free_pages == 4


def test_max_model_len_is_never_exceeded():
    sched, new = make(max_model_len=12), Requests()
    seq = new(sched, list(range(1, 9)), max_tokens=None, ignore_eos=True).sequences[0]
    too_long = new(sched, list(range(1, 14)), max_tokens=2).sequences[0]
    drive(sched, depth=1, decode_steps=3)
    assert seq.num_tokens == 12 and seq.finish_reason == "length"
    assert too_long.finish_reason == "length" and too_long.num_output_tokens == 0


def test_max_tokens_zero_and_prompt_logprobs_only():
    sched, new = make(), Requests()
    nothing = new(sched, [1, 2, 3], max_tokens=0).sequences[0]
    echo = new(sched, list(range(1, 11)), max_tokens=0, prompt_logprobs=1).sequences[0]
    batch = sched.schedule()
    assert batch.finished == [nothing]
    assert [(c.seq, c.num_tokens, c.samples) for c in batch.chunks] == [(echo, 10, False)]
    results = FakeDevice(sched).run(batch)
    sched.advance(batch)
    assert sched.schedule() is None  # computed; the engine finishes it when results are back
    read_back(sched, results)
    assert echo.finish_reason == "length" and echo.output_token_ids == []
    assert not sched.has_unfinished()


def test_abort_frees_pages_of_waiting_and_running():
    sched, new = make(num_pages=9, page_size=4, max_tokens=8), Requests()
    a = new(sched, list(range(1, 10)), n=2, max_tokens=5)
    b = new(sched, list(range(1, 30)), max_tokens=5)
    batch = sched.schedule()
    sched.advance(batch)
    assert sched.allocator.num_free_pages < 8
    aborted = sched.abort(a.request_id)
    assert set(aborted) == set(a.sequences) and all(s.finish_reason == "abort" for s in aborted)
    assert sched.abort(a.request_id) == [] and sched.abort("nope") == []
    assert sched.abort(b.request_id) == b.sequences
    assert not sched.has_unfinished()
    assert sched.allocator.num_free_pages == 8


def test_finish_drops_tokens_in_flight():
    sched, new = make(), Requests()
    seq = new(sched, [1, 2, 3], max_tokens=8).sequences[0]
    for _ in range(3):
        sched.advance(sched.schedule())
    seq.resolve_in_flight([11])
    sched.finish(seq, "stop", 11)
    assert seq.output_token_ids == [11] and seq.num_in_flight == 0
    assert seq.stop_reason == 11 and sched.allocator.num_free_pages == 63
    sched.finish(seq, "length")  # idempotent
    assert seq.finish_reason == "stop"


def test_n_choices_share_prompt_pages():
    sched, new = make(num_pages=32, page_size=4, max_tokens=64), Requests()
    group = new(sched, list(range(1, 19)), n=3, max_tokens=4, ignore_eos=True)  # 4 full pages + 2
    first, second, third = group.sequences
    batch = sched.schedule()
    assert [c.seq for c in batch.chunks] == [first]  # the others wait for its prompt pages
    device = FakeDevice(sched)
    results = device.run(batch)
    sched.advance(batch)
    batch = sched.schedule()
    assert [(c.seq, c.start, c.num_tokens) for c in batch.chunks] == [(first, 18, 1), (second, 16, 2), (third, 16, 2)]
    shared = first.page_table[:4]
    assert second.page_table[:4] == shared == third.page_table[:4]
    assert all(sched.allocator.refcount(p) == 3 for p in shared)
    assert second.num_cached_tokens == 16 and len({first.page_table[4], second.page_table[4], third.page_table[4]}) == 3
    results2 = device.run(batch)
    sched.advance(batch)
    read_back(sched, results)
    read_back(sched, results2)
    drive(sched, device=device)
    for seq in group.sequences:
        assert seq.output_token_ids == [sampled(seq, 18 + k) for k in range(4)]
    assert sched.allocator.num_free_pages == 31


def test_n_choices_without_prefix_cache_prefill_themselves():
    sched, new = make(prefix=False, max_tokens=64), Requests()
    group = new(sched, list(range(1, 19)), n=3, max_tokens=4, ignore_eos=True)
    batch = sched.schedule()
    assert [(c.seq, c.start, c.num_tokens) for c in batch.chunks] == [(s, 0, 18) for s in group.sequences]
    pages = [set(s.page_table) for s in group.sequences]
    assert not (pages[0] & pages[1]) and not (pages[1] & pages[2])
    device = FakeDevice(sched)
    results = device.run(batch)
    sched.advance(batch)
    read_back(sched, results)
    drive(sched, device=device)
    assert all(s.num_output_tokens == 4 for s in group.sequences)
    assert sched.allocator.num_free_pages == 63 and sched.allocator.num_cached_pages == 0


def test_prefix_cache_hit_skips_computed_pages():
    sched, new = make(), Requests()
    prompt = list(range(1, 15))  # 3 full pages + 2 tokens
    a = new(sched, prompt, max_tokens=2, ignore_eos=True).sequences[0]
    device, pending = drive(sched), []

    def dispatch(batch: ScheduledBatch) -> None:
        pending.append(device.run(batch))
        sched.advance(batch)

    b = new(sched, prompt[:12] + [99, 98, 97], max_tokens=2).sequences[0]
    batch = sched.schedule()
    assert [(c.seq, c.start, c.num_tokens) for c in batch.chunks] == [(b, 12, 3)]
    assert b.num_cached_tokens == 12 and sched.num_hit_tokens == 12
    dispatch(batch)
    # a whole-page prompt that is fully cached still computes its last page, to sample
    c = new(sched, prompt[:12], max_tokens=2).sequences[0]
    batch = sched.schedule()
    assert [(ch.seq, ch.start, ch.num_tokens) for ch in batch.chunks if ch.seq is c] == [(c, 8, 4)]
    assert a.page_table == [] and c.page_table[:2] == b.page_table[:2]
    dispatch(batch)
    # prompt logprobs skip the cache
    d = new(sched, prompt, max_tokens=2, prompt_logprobs=0).sequences[0]
    batch = sched.schedule()
    assert [(ch.start, ch.num_tokens) for ch in batch.chunks if ch.seq is d] == [(0, 14)]
    dispatch(batch)
    for results in pending:
        read_back(sched, results)
    drive(sched, device=device)
    assert sched.allocator.num_free_pages == 63


def test_fused_decode_steps_only_when_pure_decode():
    sched, new = make(), Requests()
    seqs = [new(sched, [1, 2, 3 + i], max_tokens=9, ignore_eos=True).sequences[0] for i in range(2)]
    batch = sched.schedule(4)
    assert batch.num_steps == 1  # prefill
    sched.advance(batch)
    batch = sched.schedule(4)
    assert batch.is_pure_decode and [c.num_steps for c in batch.chunks] == [4, 4]
    sched.advance(batch)
    assert seqs[0].num_in_flight == 5 and seqs[0].num_computed_tokens == 7
    assert len(seqs[0].page_table) * 4 >= 7
    new(sched, [5, 5], max_tokens=1)
    for seq in seqs:
        while seq.num_in_flight:
            seq.resolve_in_flight([3])
    batch = sched.schedule(4)
    assert batch.num_steps == 1 and not batch.is_pure_decode
    sched.advance(batch)
    batch = sched.schedule(8)
    assert [c.num_steps for c in batch.chunks if c.seq in seqs] == [3, 3]  # max_tokens caps it


def test_decode_steps_fuse_while_a_request_waits_for_a_slot_but_not_when_one_is_free():
    sched, new = make(max_num_seqs=2), Requests()
    running = [new(sched, [1, 2, 3 + i], max_tokens=20, ignore_eos=True).sequences[0] for i in range(2)]
    waiting = new(sched, [7, 8, 9], max_tokens=20, ignore_eos=True).sequences[0]
    sched.advance(sched.schedule(4))  # both prompts; the third request has no slot
    batch = sched.schedule(4)
    assert sched.num_waiting == 1 and [c.num_steps for c in batch.chunks] == [4, 4]  # it could not join anyway
    sched.advance(batch)
    sched.abort(running[0].request_id)  # a slot frees: the next step admits the waiting request
    while running[1].num_in_flight:
        running[1].resolve_in_flight([3])
    batch = sched.schedule(4)
    assert sched.num_waiting == 0 and waiting in [c.seq for c in batch.chunks]
    assert all(c.num_steps == 1 for c in batch.chunks)


def test_randomized_stress_no_starvation():
    rng = random.Random(1234)
    for trial in range(6):
        prefix = trial % 2 == 0
        sched = make(num_pages=rng.choice([12, 20, 40]), page_size=rng.choice([2, 4]), max_num_seqs=rng.choice([3, 5]),
                     max_tokens=rng.choice([8, 16]), max_model_len=48, prefix=prefix)
        new = Requests()
        bases = [[rng.randrange(1, 50) for _ in range(20)] for _ in range(3)]
        groups: list[SequenceGroup] = []
        aborted: set[str] = set()
        start_free = sched.allocator.num_free_pages

        def arrive() -> None:
            base = rng.choice(bases)
            prompt = base[: rng.randrange(1, 20)] + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 6))]
            groups.append(new(sched, prompt, n=rng.choice([1, 1, 2, 3]), max_tokens=rng.randrange(0, 14),
                              ignore_eos=rng.random() < 0.5, prompt_logprobs=rng.choice([None, None, 1])))

        def arrive_and_check(before: list[Sequence], batch) -> None:
            if before:  # the oldest running sequence is never preempted
                assert before[0].status != SequenceStatus.WAITING
            for _ in range(rng.choice([0, 0, 0, 1, 2])):
                if len(groups) < 30:
                    arrive()
            if groups and rng.random() < 0.05:
                victim = rng.choice(groups)
                if sched.abort(victim.request_id):
                    aborted.add(victim.request_id)

        for _ in range(8):
            arrive()
        drive(sched, depth=rng.choice([0, 1, 2]), decode_steps=rng.choice([1, 3]), on_step=arrive_and_check)
        assert len(groups) >= 10
        for g in groups:
            for seq in g.sequences:
                assert seq.is_finished and seq.num_in_flight == 0 and IN_FLIGHT not in seq.output_token_ids
                assert seq.num_tokens <= sched.max_model_len
                if g.request_id in aborted and seq.finish_reason == "abort":
                    continue
                expected = [sampled(seq, seq.num_prompt_tokens + k) for k in range(seq.num_output_tokens)]
                assert seq.output_token_ids == expected
                if seq.finish_reason == "stop":
                    assert seq.output_token_ids[-1] % EOS_MOD == 0
                else:
                    assert seq.finish_reason == "length"
                    assert seq.num_output_tokens == seq.params.max_tokens or seq.num_tokens >= 48 \
                        or sched.config.pages_for(seq.num_tokens) > sched.allocator.num_usable_pages
        assert sched.allocator.num_free_pages == start_free
        assert not sched.running and not sched.waiting and not sched._groups


def test_each_sequence_keeps_its_pages_consecutive_after_churn():
    """Pages scatter as requests come and go; each new sequence still gets one run of pages,
    its prompt and the tokens it decodes, while no other run is in the way."""
    sched, new = make(num_pages=97, page_size=4, max_num_seqs=6, max_tokens=64), Requests()
    rng = random.Random(3)
    seen = []

    def record(before, batch):
        for seq in sched.running:
            seen.append(list(seq.page_table))

    for wave in range(4):
        for i in range(6):
            new(sched, [rng.randrange(1, 500) for _ in range(rng.randrange(3, 20))],
                max_tokens=rng.randrange(2, 40), ignore_eos=True)
        drive(sched, depth=1, on_step=record)
    assert sched.allocator.num_free_pages == 96 and sched.allocator.num_earmarked_pages == 0
    pairs = [(a, b) for table in seen for a, b in zip(table, table[1:])]
    assert pairs and all(b == a + 1 for a, b in pairs)
