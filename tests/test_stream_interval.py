"""StreamInterval: a choice's outputs between two publishes are merged; first and last go out at once."""

from __future__ import annotations

import pytest

from worker.engine.request_output import RequestOutput
from worker.service.stream_interval import StreamInterval


def out(rid: str, tokens: list[int], *, index: int = 0, finish: str | None = None, done: bool = False,
        logprobs: bool = False) -> RequestOutput:
    return RequestOutput(rid, index, tokens, "".join(f" t{t}" for t in tokens),
                         logprobs=[{"token_id": t, "logprob": -0.5, "top": []} for t in tokens] if logprobs else None,
                         finish_reason=finish, num_output_tokens=tokens[-1] if tokens else 0,
                         request_finished=done)


def test_first_output_at_once_then_merged_until_due():
    s = StreamInterval(0.05)
    assert [o.token_ids for o in s.take([out("a", [1])], now=0.0)] == [[1]]  # first token: no wait
    assert s.take([out("a", [2])], now=0.02) == []
    assert s.take([out("a", [3])], now=0.04) == []
    (merged,) = s.take([out("a", [4])], now=0.051)
    assert merged.token_ids == [2, 3, 4] and merged.text == " t2 t3 t4" and merged.num_output_tokens == 4


def test_outputs_go_out_at_once_until_one_carries_text():
    s = StreamInterval(0.05)
    no_text = RequestOutput("a", 0, [1], "")  # the detokenizer holds an unfinished character
    assert s.take([no_text], now=0.0) == [no_text]
    assert s.take([out("a", [2])], now=0.01)[0].token_ids == [2]  # the first text: at once
    assert s.take([out("a", [3])], now=0.02) == []


def test_held_output_goes_out_when_due_without_new_tokens():
    s = StreamInterval(0.05)
    s.take([out("a", [1])], now=0.0)
    s.take([out("b", [7])], now=0.03)
    assert s.take([out("a", [2]), out("b", [8])], now=0.04) == []
    assert [(o.request_id, o.token_ids) for o in s.take([], now=0.06)] == [("a", [2])]  # b's not due yet
    assert [(o.request_id, o.token_ids) for o in s.take([], now=0.081)] == [("b", [8])]
    assert s.take([], now=1.0) == []


def test_finish_flushes_what_was_held_in_one_output():
    s = StreamInterval(0.05)
    s.take([out("a", [1], logprobs=True)], now=0.0)
    assert s.take([out("a", [2], logprobs=True)], now=0.01) == []
    (last,) = s.take([out("a", [3], finish="length", done=True, logprobs=True)], now=0.02)
    assert last.token_ids == [2, 3] and last.finish_reason == "length" and last.request_finished
    assert [lp["token_id"] for lp in last.logprobs] == [2, 3]
    assert s.take([out("a", [9])], now=0.03)[0].token_ids == [9]  # a new request with the same id starts afresh


def test_tokens_ending_inside_a_character_are_not_merged_behind_text():
    """A delta with text must carry the text of all its tokens: a worker resuming the request
    counts the tokens after the last delta with text as not yet turned into text."""
    s = StreamInterval(0.05)
    s.take([out("a", [1])], now=0.0)
    assert s.take([out("a", [2])], now=0.01) == []
    partial = RequestOutput("a", 0, [3], "")  # the first bytes of a character
    (sent,) = s.take([partial], now=0.02)
    assert (sent.token_ids, sent.text) == ([2], " t2")  # what was held goes out alone
    completed = RequestOutput("a", 0, [4], "é")
    assert s.take([completed], now=0.03) == []
    (merged,) = s.take([], now=0.071)
    assert (merged.token_ids, merged.text) == ([3, 4], "é")


def test_choices_are_held_apart():
    s = StreamInterval(0.05)
    s.take([out("a", [1], index=0), out("a", [5], index=1)], now=0.0)
    assert s.take([out("a", [2], index=0), out("a", [6], index=1)], now=0.01) == []
    (zero,) = s.take([out("a", [3], index=0, finish="stop")], now=0.02)
    assert (zero.index, zero.token_ids) == (0, [2, 3])
    (one,) = s.take([out("a", [7], index=1, finish="stop", done=True)], now=0.03)
    assert (one.index, one.token_ids) == (1, [6, 7])


def test_forget_drops_a_handed_back_request():
    s = StreamInterval(0.05)
    s.take([out("a", [1])], now=0.0)
    assert s.take([out("a", [2])], now=0.01) == []
    s.forget("a")
    assert s.take([], now=1.0) == []
    assert s.take([out("a", [3])], now=1.0)[0].token_ids == [3]  # resumed here later: first output again


def test_the_interval_shrinks_with_the_share_of_slots_in_use():
    s = StreamInterval(0.05)
    s.take([out("a", [1])], now=0.0, load=0.25)
    assert s.take([out("a", [2])], now=0.01, load=0.25) == []  # 12.5 ms at a quarter of the slots
    assert s.take([out("a", [3])], now=0.013, load=0.25)[0].token_ids == [2, 3]
    s.take([out("b", [1])], now=0.0, load=1 / 64)
    assert s.take([out("b", [2])], now=0.001, load=1 / 64)[0].token_ids == [2]  # a lone stream: ~every step
    assert s.take([out("b", [3])], now=0.0015, load=2.0) == []  # more than a full batch: 50 ms


def test_zero_interval_passes_every_output():
    s = StreamInterval(0.0)
    outputs = [out("a", [1]), out("a", [2]), out("b", [3])]
    assert s.take(outputs, now=0.0) == outputs
    assert s.take([out("a", [4])], now=0.0)[0].token_ids == [4]


def test_the_worker_setting_from_flag_and_environment():
    from worker.cli import parser
    from worker.service.config import WorkerConfig

    assert WorkerConfig(model_dir="m").stream_interval_ms == 50.0
    args = parser().parse_args(["worker", "--model", "m", "--stream-interval-ms", "0"])
    assert WorkerConfig.from_env({"model_dir": "m", "stream_interval_ms": args.stream_interval_ms},
                                 environ={}).stream_interval_ms == 0.0
    env = {"REDJAX_STREAM_INTERVAL_MS": "20"}
    assert WorkerConfig.from_env({"model_dir": "m"}, environ=env).stream_interval_ms == 20.0
    with pytest.raises(ValueError):
        WorkerConfig(model_dir="m", stream_interval_ms=-1)
