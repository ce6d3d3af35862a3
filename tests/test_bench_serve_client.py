"""`redjax bench serve`'s client side without a server: ShareGPT files, flags refused before any
request, gamma arrivals, and the SSE parsing of streamed events."""

from __future__ import annotations

import json

import pytest

from tests.bench_support import run_bench


def test_sharegpt_file_gives_each_conversations_first_human_turn(tmp_path):
    from worker.bench.prompts import Prompt, file_prompts

    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "What is a river?"},
                                      {"from": "gpt", "value": "Water that flows."},
                                      {"from": "human", "value": "And a lake?"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "no human turn"}]},
        {"id": "c", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "user", "value": "Hi"}]},
    ]))
    assert file_prompts(str(path), 3) == [Prompt("What is a river?"), Prompt("Hi"), Prompt("What is a river?")]
    lines = tmp_path / "prompts.txt"
    lines.write_text("a prompt\n")
    with pytest.raises(ValueError, match="ShareGPT files only"):  # no reply there to measure
        file_prompts(str(lines), 1, tokenizer=object())


@pytest.mark.parametrize("argv, message", [
    (["--sweep", "1,fast"], "--sweep takes comma-separated request rates"),
    (["--request-rate", "0"], "request rates must be > 0"),
    (["--burstiness", "0"], "--burstiness must be > 0"),
    (["--burstiness", "2"], "--burstiness shapes the gaps between arrivals at a finite --request-rate"),
    (["--range-ratio", "1"], "--range-ratio must be in [0, 1)"),
    (["--concurrency", "0"], "--concurrency must be >= 1"),
    (["--concurrency", "2,many"], "--concurrency takes a number of requests"),
    (["--concurrency", "2", "--plot", "x.png"], "--plot needs a sweep"),
    (["--tokenizer", "/no/such/dir"], "--tokenizer: "),
    (["--prompts-file", "BAD_JSONL", "--range-ratio", "0.5"], "--range-ratio and --prefix-len shape random prompts"),
    (["--prompts-file", "BAD_JSONL", "--input-len", "9"], "--range-ratio and --prefix-len shape random prompts"),
    (["--prompts-file", "BAD_JSONL", "--prefix-len", "9"], "--range-ratio and --prefix-len shape random prompts"),
    (["--prefix-len", "-1"], "--prefix-len must be >= 0"),
    (["--temperature", "-0.5"], "sampling: --temperature must be >= 0"),
    (["--top-p", "0"], "--top-p in (0, 1]"),
    (["--top-k", "0"], "--top-k >= 1"),
    (["--min-p", "1.5"], "--min-p in [0, 1]"),
    (["--input-len", "0"], "must be >= 1"),
    (["--prompts-file", "BAD_JSONL", "--tokenizer", "/no/such/dir"], "--tokenizer: "),
    (["--percentiles", "50,100"], "--percentiles takes comma-separated numbers in (0, 100)"),
    (["--pairs", "2"], "more than 1 needs --compare-url"),
    (["--compare-url", "http://127.0.0.1:9", "--pairs", "0"], "--pairs must be >= 1"),
    (["--compare-model", "m"], "--compare-model, --compare-api-key and --compare-extra-body go with --compare-url"),
    (["--compare-extra-body", "{}"], "--compare-extra-body go with --compare-url"),
    (["--extra-body", "{top_k: 2}"], "--extra-body is not valid JSON"),
    (["--extra-body", "[1]"], "--extra-body must be a JSON object"),
    (["--compare-url", "http://127.0.0.1:9", "--compare-extra-body", "3"], "--compare-extra-body must be a JSON object"),
    (["--warmup", "-1"], "--warmup and --ready-timeout must be >= 0"),
    (["--save-detailed"], "--save-detailed adds to --json-out's report"),
    (["--prompts-file", "/no/such/file"], "--prompts-file: [Errno 2]"),
    (["--prompts-file", "BAD_JSONL"], "'max_tokens' must be a positive integer"),
])
def test_serve_refuses_bad_flags_before_sending_anything(argv, message, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "max_tokens": 0}\n')
    argv = [str(bad) if a == "BAD_JSONL" else a for a in argv]
    with pytest.raises(SystemExit) as exit_:
        run_bench("serve", "--url", "http://127.0.0.1:9", *argv)  # nothing listens there: no request may be sent
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_gamma_arrivals_keep_the_mean_rate_and_set_the_spread():
    import random
    import statistics

    from worker.bench.serve import Load

    for burstiness in (0.25, 1.0, 4.0):
        load = Load(1, request_rate=10.0, burstiness=burstiness)
        rng = random.Random(0)
        gaps = [load.gap(rng) for _ in range(40000)]
        assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.03)
        # gamma(k, 1 / (rate k)): variance 1 / (rate^2 k); burstier arrivals spread more
        assert statistics.pvariance(gaps) == pytest.approx(0.01 / burstiness, rel=0.08)
    assert Load(1).gap(random.Random(0)) == 0.0  # infinite rate: all at once


def test_serve_reads_events_split_across_reads_with_lf_or_crlf():
    """The load generator parses SSE per network read: lines cut between reads, CRLF endings and
    comment lines must not change what it counts."""
    import asyncio

    from worker.bench.serve import Result, _read_stream

    def event(obj) -> str:
        return f"data: {json.dumps(obj)}"

    lines = [": ping", event({"choices": [{"text": "a"}]}), "", event({"choices": [{"text": ""}]}), "",
             event({"choices": [{"text": "bc"}]}), "", event({"choices": [], "usage": {"prompt_tokens": 5,
                                                                                     "completion_tokens": 3}}),
             "", "data: [DONE]", "", event({"choices": [{"text": "after done"}]}), ""]

    class Content:
        def __init__(self, body: bytes, cut: int):
            self.parts = [body[i:i + cut] for i in range(0, len(body), cut)]

        async def iter_any(self):
            for part in self.parts:
                yield part

    for newline in ("\n", "\r\n"):
        body = newline.join(lines).encode()
        for cut in (1, 7, len(body)):
            r = Result(start=0.0)
            asyncio.run(_read_stream(Content(body, cut), r))
            assert (r.prompt_tokens, r.output_tokens) == (5, 3), (newline, cut)
            assert r.ttft > 0 and len(r.itl) == 1, (newline, cut)  # two chunks with text; "" is not content


def test_serve_times_chat_deltas_by_their_content():
    """A chat stream opens with a role-only delta (not a token); content, or a reasoning model's
    reasoning_content, is."""
    import asyncio

    from worker.bench.serve import Result, _read_stream

    def event(delta) -> bytes:
        return f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta}]})}\n\n".encode()

    class Content:
        async def iter_any(self):
            yield event({"role": "assistant", "content": ""})
            yield event({"reasoning_content": "think"})
            yield event({"content": None})
            yield event({"content": "answer"})
            yield b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}\n\ndata: [DONE]\n\n'

    r = Result(start=0.0)
    asyncio.run(_read_stream(Content(), r))
    assert r.ttft > 0 and len(r.itl) == 1 and (r.prompt_tokens, r.output_tokens) == (4, 2)
