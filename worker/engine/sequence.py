"""Sequence: one choice of one request; SequenceGroup: the n choices of a request. No JAX.

Async overlap: when a step that samples is dispatched, the sequence gets an in-flight output
token (-1); its real id is read back later and `resolve_in_flight` fills in the oldest ones.
An in-flight token counts in `num_tokens`: the device already knows the sampled token and computes
its K/V in the next step from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from worker.engine.sampling_params import SamplingParams
from worker.engine.speculation import DraftIndex

if TYPE_CHECKING:
    from worker.engine.grammar import Grammar

IN_FLIGHT = -1  # output token sampled on device, not read back yet


class SequenceStatus(str, Enum):
    WAITING = "waiting"  # in the waiting queue (new or preempted); holds no pages
    RUNNING = "running"  # admitted; holds pages for its computed tokens
    FINISHED = "finished"  # done; pages released, `finish_reason` set


@dataclass(eq=False)
class Sequence:
    seq_id: int  # engine-unique
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0  # choice number within the request
    group: SequenceGroup | None = None
    output_token_ids: list[int] = field(default_factory=list)  # IN_FLIGHT where not read back
    num_computed_tokens: int = 0  # leading tokens whose K/V are in the pages
    page_table: list[int] = field(default_factory=list)  # token t lives in page_table[t // page_size]
    page_keys: list[int] = field(default_factory=list)  # prefix-cache keys of the leading full pages
    status: SequenceStatus = SequenceStatus.WAITING
    arrival: int = 0  # admission order, stamped by Scheduler.add
    num_in_flight: int = 0  # trailing output tokens still IN_FLIGHT
    num_cached_tokens: int = 0  # tokens the prefix cache served at its last admission
    draft_misses: int = 0  # speculation: checks in a row where no draft stood (speculation.back_off)
    drafts_from: int = 0  # no drafts until the sequence holds this many tokens
    draft_index: DraftIndex | None = None  # speculation: where its runs of tokens last occurred (made when first asked)
    last_chunk: object | None = None  # the newest ScheduledChunk dispatched for it (Scheduler.advance)
    cut: tuple[object, int] | None = None  # speculation: (a chunk in flight, how many of its rows still count)
    finish_reason: str | None = None  # "stop", "length", "abort" (worker.contract.FinishReason)
    stop_reason: str | int | None = None  # matched stop string or stop token id
    early_bans: tuple[int, ...] = ()  # tokens that may not be sampled before params.min_tokens outputs (EOS, stop ids)
    grammar: Grammar | None = None  # structured output: where its tokens stand in the request's grammar

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host knows (all but the trailing in-flight tokens)."""
        return self.num_tokens - self.num_in_flight

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def token_range(self, start: int, end: int) -> list[int]:
        """`token_ids[start:end]` without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def append_in_flight(self, count: int = 1) -> None:
        """Record `count` tokens sampled on device whose ids are not read back yet."""
        self.output_token_ids.extend([IN_FLIGHT] * count)
        self.num_in_flight += count

    def resolve_in_flight(self, token_ids: list[int]) -> None:
        """Replace the oldest in-flight tokens with the token ids read back from the device."""
        n = len(token_ids)
        if n > self.num_in_flight:
            raise ValueError(f"sequence {self.seq_id} has {self.num_in_flight} in-flight tokens, not {n}")
        start = len(self.output_token_ids) - self.num_in_flight
        self.output_token_ids[start : start + n] = token_ids
        self.num_in_flight -= n

    def reject_in_flight(self, count: int) -> None:
        """Forget the newest `count` in-flight tokens and their computed K/V: the rows of drafts the
        step's draws did not confirm (speculation.py); the next step writes over their pages."""
        if count > self.num_in_flight:
            raise ValueError(f"sequence {self.seq_id} has {self.num_in_flight} in-flight tokens, not {count}")
        if count:
            del self.output_token_ids[-count:]
            self.num_in_flight -= count
            self.num_computed_tokens -= count

    def drop_in_flight(self) -> None:
        """Forget tokens still in flight (used when the sequence finishes early)."""
        if self.num_in_flight:
            del self.output_token_ids[-self.num_in_flight :]
            self.num_in_flight = 0


@dataclass(eq=False)
class SequenceGroup:
    """The `params.n` choices of one request; they share the prompt (and its cached pages)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # seconds (caller's clock) when the request arrived
    sequences: list[Sequence] = field(default_factory=list)
    prefilled: bool = False  # a choice has computed the whole prompt (others may hit its pages)
    first_token_time: float | None = None  # seconds, set by the engine when the first token is out
    num_cached_prompt_tokens: int | None = None  # prompt tokens the prefix cache served its first admitted choice

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        first_seq_id: int,
        arrival_time: float,
    ) -> SequenceGroup:
        """A group of `params.n` waiting sequences with ids `first_seq_id, first_seq_id + 1, ...`."""
        group = cls(request_id, list(prompt_token_ids), params, arrival_time)
        group.sequences = [
            Sequence(first_seq_id + i, request_id, group.prompt_token_ids, params, index=i, group=group)
            for i in range(params.n)
        ]
        return group

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.sequences)
