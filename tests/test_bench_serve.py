"""`redjax bench serve`, the load generator, against the real stack (API + worker subprocesses,
real Redis) on a tiny model: loads, sweeps, prompt sources, the untimed first request, two servers
compared. Its client side without a server is in test_bench_serve_client.py. No wall-clock
thresholds."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time

import httpx
import pytest

from tests.bench_support import check_serve_report, run_bench
from tests.conftest import free_port
from tests.stack_support import make_served_model, start_api, start_worker, stop, wait_until


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return make_served_model(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def stack(served, redis_url):
    worker = start_worker(served, redis_url, "bench-worker")
    api, url = start_api(served, redis_url)
    # the worker serves once its warm-up is done (~25 s on 2 cores): the benchmarks measure a warm one
    wait_until(lambda: httpx.get(url + "/ready").status_code == 200, 120)
    yield url
    stop(api)
    stop(worker)


def test_serve_concurrency(stack, tmp_path):
    out = tmp_path / "report.json"
    code, text = run_bench("serve", "--url", stack, "--num-prompts", "6", "--concurrency", "3", "--input-len", "12",
                           "--output-len", "8", "--goodput", "ttft:600000", "tpot:600000", "--json-out", str(out),
                           "--save-detailed")
    assert code == 0, text
    report = json.loads(out.read_text())
    check_serve_report(report, 6)
    assert report["concurrency"] == 3 and report["good_requests"] == 6
    assert "ttft" in text and "p99" in text
    # --save-detailed: each request's figures, which the summary's are made of
    each = report["requests"]
    assert len(each) == 6 and all(r["ok"] and r["error"] is None and r["output_tokens"] == 8 for r in each)
    assert min(r["sent_s"] for r in each) == 0.0
    assert all(0 < r["ttft_ms"] <= r["e2e_ms"] and len(r["itl_ms"]) <= 7 for r in each)
    assert sum(r["ttft_ms"] for r in each) / 6 == pytest.approx(report["ttft"]["mean_ms"], rel=1e-9)
    assert sum(r["prompt_tokens"] for r in each) == report["prompt_tokens"]
    # at most 3 in flight: the 4th is sent only once one of the first 3 has finished
    assert min(r["sent_s"] + r["e2e_ms"] / 1e3 for r in each[:3]) <= each[3]["sent_s"] + 1e-9


def test_serve_sweep_plot(stack, tmp_path):
    """Each run of a sweep sends prompts of its own (a seed no other test uses), so the second run
    finds none of the first's pages (of 8 tokens) in the worker's prefix cache."""
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    code, text = run_bench("serve", "--url", stack, "--num-prompts", "4", "--sweep", "2,inf", "--input-len", "20",
                           "--output-len", "8", "--seed", "23", "--json-out", str(out), "--plot", str(png),
                           "--percentiles", "99.9,50,99,90")
    assert code == 0, text
    reports = json.loads(out.read_text())
    assert [r["request_rate"] for r in reports] == [2.0, None]
    for r in reports:
        check_serve_report(r, 4)
        assert list(r["e2e"]) == ["mean_ms", "p50_ms", "p90_ms", "p99_ms", "p99.9_ms"]
        assert r["e2e"]["p99_ms"] <= r["e2e"]["p99.9_ms"]
        assert r["prompt_tokens"] >= 4 * 16 and r["cached_prompt_tokens"] == 0
    assert "p99.9" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serve_sweeps_the_concurrency(stack, tmp_path):
    """Comma-separated --concurrency values sweep it (one run each, a list of reports, a plot)."""
    out, png = tmp_path / "caps.json", tmp_path / "caps.png"
    code, text = run_bench("serve", "--url", stack, "--num-prompts", "4", "--concurrency", "1,4", "--input-len", "6",
                           "--output-len", "8", "--json-out", str(out), "--plot", str(png))
    assert code == 0, text
    reports = json.loads(out.read_text())
    assert [(r["request_rate"], r["concurrency"]) for r in reports] == [(None, 1), (None, 4)]
    for r in reports:
        check_serve_report(r, 4)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serve_sends_the_key_from_the_environment(served, stack, redis_url, tmp_path, monkeypatch, capsys):
    """An API that requires a key: refused without it, served with $OPENAI_API_KEY, and the key is
    nowhere in what the benchmark prints or writes."""
    api, url = start_api(served, redis_url, env={"REDJAX_API_KEY": "bench-secret-key"})
    try:
        out = tmp_path / "report.json"
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        args = ("serve", "--url", url, "--model", served.name, "--num-prompts", "2", "--input-len", "4",
                "--output-len", "8", "--json-out", str(out))
        code, text = run_bench(*args)  # the first request is refused: no load, no report
        assert code == 1 and not out.exists()
        assert f"the first (untimed) request to {url} failed, so no load was sent: HTTP 401" in capsys.readouterr().err
        assert run_bench(*[a for a in args if a not in ("--model", served.name)])[0] == 1  # /v1/models refused too
        assert "cannot read the served model" in capsys.readouterr().err
        monkeypatch.setenv("OPENAI_API_KEY", "bench-secret-key")
        code, text = run_bench(*args)
        assert code == 0, text
        check_serve_report(json.loads(out.read_text()), 2)
        assert "bench-secret-key" not in text + out.read_text()
    finally:
        stop(api)


def test_serve_counts_rejected_requests_as_failed(stack, tmp_path):
    """Requests the server refuses (each asks for more tokens than the model's context holds, while
    the untimed first request asks for --output-len): every one fails with the server's HTTP error,
    and the report says so instead of inventing latencies."""
    prompts, out, png = tmp_path / "long.jsonl", tmp_path / "report.json", tmp_path / "sweep.png"
    prompts.write_text("".join(json.dumps({"prompt": f"a b c {i}", "max_tokens": 10**6}) + "\n" for i in range(3)))
    code, text = run_bench("serve", "--url", stack, "--num-prompts", "3", "--prompts-file", str(prompts),
                           "--output-len", "4", "--sweep", "50,inf", "--json-out", str(out), "--plot", str(png),
                           "--save-detailed")
    assert code == 1
    for report in json.loads(out.read_text()):
        assert report["completed"] == 0 and report["failed"] == 3
        assert all(e.startswith("HTTP 400") for e in report["errors"]), report["errors"]
        assert all(not r["ok"] and r["error"].startswith("HTTP 400") and r["ttft_ms"] is r["e2e_ms"] is None
                   for r in report["requests"])
        for key in ("ttft", "tpot", "itl", "e2e"):  # nothing measured: no value, not a latency of 0 ms
            assert report[key] == {"mean_ms": None, "p50_ms": None, "p90_ms": None, "p99_ms": None}
    assert "ttft  ms: mean n/a  p50 n/a  p90 n/a  p99 n/a" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the plot leaves the runs without latencies out


def test_serve_sends_no_load_when_the_first_request_is_refused(stack, tmp_path, capsys):
    """A model the server does not serve: the untimed first request gets the server's 404, and the
    benchmark stops there: no run, no report."""
    out = tmp_path / "report.json"
    code, text = run_bench("serve", "--url", stack, "--model", "no-such-model", "--num-prompts", "3", "--input-len", "4",
                           "--output-len", "4", "--warmup", "2", "--json-out", str(out))
    assert code == 1 and not out.exists() and text == ""
    assert f"the first (untimed) request to {stack} failed, so no load was sent: HTTP 404" in capsys.readouterr().err


def test_serve_warms_up_untimed_on_prompts_of_its_own(stack, redis_url, tmp_path, capsys):
    """--warmup 4: the first request and 4 more reach the server before the timed run, which reports
    only its own 3; none of the timed prompts is in the prefix cache from the warm-up."""
    before = _enqueued(redis_url)
    out = tmp_path / "report.json"
    code, text = run_bench("serve", "--url", stack, "--num-prompts", "3", "--warmup", "4", "--concurrency", "2",
                           "--input-len", "20", "--output-len", "8", "--seed", "31", "--json-out", str(out))
    assert code == 0, text
    report = json.loads(out.read_text())
    check_serve_report(report, 3)
    assert report["warmup_requests"] == 5 and report["cached_prompt_tokens"] == 0
    assert _enqueued(redis_url) == before + 3 + 5
    assert "4 warm-up requests in" in capsys.readouterr().err


@pytest.mark.parametrize("model", [None, "served"])
def test_serve_waits_for_a_server_still_starting(served, stack, redis_url, tmp_path, model):
    """Started before the API listens (as `redjax serve & redjax bench serve ...` does): the
    benchmark asks again until it answers, for /v1/models or, with --model, for its first request,
    and times only what follows."""
    port = free_port()
    url, out, done = f"http://127.0.0.1:{port}", tmp_path / "report.json", {}
    argv = ["serve", "--url", url, "--num-prompts", "2", "--input-len", "6", "--output-len", "8", "--seed", "41",
            "--ready-timeout", "120", "--json-out", str(out)] + (["--model", served.name] if model else [])
    bench = threading.Thread(target=lambda: done.update(result=run_bench(*argv)))
    bench.start()
    time.sleep(3)  # it is retrying: nothing listens yet
    assert bench.is_alive()
    api, _ = start_api(served, redis_url, port=port)
    try:
        bench.join(120)
        code, text = done["result"]
        assert code == 0, text
        check_serve_report(json.loads(out.read_text()), 2)
    finally:
        stop(api)


def test_serve_compares_two_servers_in_alternating_pairs(served, stack, redis_url, tmp_path):
    """--compare-url: every load runs on both servers, back to back on the same prompts, the one
    that goes first alternating; a pair's ratio is the first server's output tok/s over the
    baseline's, a load's the median of its pairs'. Both servers here are APIs of one worker: the
    first run of a pair finds nothing of an earlier pair's prompts in its prefix cache (each pair
    draws its own), and both runs of a pair count the same prompt tokens."""
    import statistics

    api, other = start_api(served, redis_url)
    try:
        out, png = tmp_path / "compare.json", tmp_path / "compare.png"
        code, text = run_bench("serve", "--url", stack, "--compare-url", other + "/v1", "--num-prompts", "3",
                               "--input-len", "20", "--output-len", "8", "--concurrency", "1,3", "--pairs", "2",
                               "--seed", "43", "--json-out", str(out), "--plot", str(png))
    finally:
        stop(api)
    assert code == 0, text
    result = json.loads(out.read_text())
    assert (result["url"], result["compare_url"], result["pairs"]) == (stack, other, 2)
    assert result["model"] == result["compare_model"] == served.name
    assert [load["concurrency"] for load in result["loads"]] == [1, 3]
    assert [p["first"] for load in result["loads"] for p in load["pairs"]] == ["url", "compare_url"] * 2
    for load in result["loads"]:
        for pair in load["pairs"]:
            check_serve_report(pair["report"], 3)
            check_serve_report(pair["baseline"], 3)
            assert pair["ratio"] == pair["report"]["output_token_throughput"] / pair["baseline"]["output_token_throughput"]
            first = pair["report"] if pair["first"] == "url" else pair["baseline"]
            assert first["cached_prompt_tokens"] == 0  # nothing of an earlier pair's prompts
            assert pair["report"]["prompt_tokens"] == pair["baseline"]["prompt_tokens"]  # the same prompts
        assert len({pair["report"]["prompt_tokens"] for pair in load["pairs"]}) == 2  # each pair its own
        assert load["ratio"] == statistics.median(pair["ratio"] for pair in load["pairs"])
        assert f"median ratio {load['ratio']:.3f}x over 2 pairs" in text
    assert text.count(f"  baseline {other} ({served.name}):") == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _enqueued(redis_url: str) -> int:
    """Requests any API has put on the queue (the fleet's counter in Redis)."""
    import redis

    from worker import contract

    return int(redis.Redis.from_url(redis_url).hget(contract.TOTALS, contract.TOTAL_ENQUEUED) or 0)


def test_serve_chat_endpoint_with_poisson_arrivals_under_a_concurrency_cap(stack, tmp_path):
    """--endpoint chat sends each prompt as one user message to /v1/chat/completions and times the
    deltas' content; a rate and a concurrency together: arrivals wait for a free slot, so no more
    than the cap are ever in flight. The URL may be an OpenAI client's base URL (ending in /v1)."""
    out = tmp_path / "report.json"
    code, text = run_bench("serve", "--url", stack + "/v1/", "--endpoint", "chat", "--num-prompts", "6", "--request-rate", "200",
                           "--burstiness", "0.5", "--concurrency", "2", "--input-len", "5", "--output-len", "8",
                           "--json-out", str(out))
    assert code == 0, text
    report = json.loads(out.read_text())
    check_serve_report(report, 6)
    assert (report["endpoint"], report["request_rate"], report["burstiness"], report["concurrency"]) == \
        ("chat", 200.0, 0.5, 2)
    assert report["prompt_tokens"] > 6 * 5  # the chat template's tokens come on top of the words
    assert "rate 200/s, concurrency 2" in text


def test_serve_cap_holds_requests_in_flight_to_the_concurrency(stack):
    from worker.bench.prompts import Prompt
    from worker.bench.serve import Load, run_load, served_model

    load = Load(8, request_rate=1000.0, concurrency=2, output_len=8)
    _, results = asyncio.run(run_load(stack, served_model(stack), [Prompt(f"word {i}") for i in range(8)], load))
    assert all(r.ok for r in results), [r.error for r in results]
    events = sorted([(r.start, 1) for r in results] + [(r.start + r.e2e, -1) for r in results])
    in_flight = list(itertools.accumulate(step for _, step in events))
    assert max(in_flight) == 2  # the 8 arrive within ~10 ms; each takes far longer than that to stream 8 tokens


def test_serve_per_prompt_output_lengths_from_a_jsonl_file_and_random_ranges(stack, tmp_path):
    """JSON lines may give each prompt its own max_tokens; --range-ratio draws random lengths. With
    ignore_eos every request runs to its own length, counted from usage."""
    from worker.bench.prompts import random_prompts, random_workload

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "the river", "max_tokens": 3}\n\n{"prompt": "a stone"}\n'
                       '{"prompt": "light", "max_tokens": 11}\n')
    out = tmp_path / "report.json"
    code, text = run_bench("serve", "--url", stack, "--prompts-file", str(prompts), "--num-prompts", "4",
                           "--output-len", "5", "--json-out", str(out))
    assert code == 0, text
    report = json.loads(out.read_text())
    assert report["completed"] == 4 and report["output_tokens"] == 3 + 5 + 11 + 3  # cycled to 4 prompts

    drawn = random_workload(6, 10, 8, range_ratio=0.5, seed=4)
    assert {p.output_len for p in drawn} != {8} and all(4 <= p.output_len <= 12 for p in drawn)
    assert all(5 <= len(p.text.split()) <= 15 for p in drawn)
    assert [p.text for p in random_workload(3, 7, 8, seed=2)] == random_prompts(3, 7, seed=2)  # ratio 0: fixed
    # a sweep's later runs: other words, the same lengths, the same shared prefix
    first, later = random_workload(6, 10, 8, 0.5, seed=4, prefix_len=5), random_workload(6, 10, 8, 0.5, 4, 5, draw=1)
    assert [p.output_len for p in later] == [p.output_len for p in first] == [p.output_len for p in drawn]
    assert [len(p.text.split()) for p in later] == [len(p.text.split()) for p in first]
    assert {p.text.split()[:5] == first[0].text.split()[:5] for p in first + later} == {True}
    assert all(a.text != b.text for a, b in zip(first, later))
    code, text = run_bench("serve", "--url", stack, "--num-prompts", "6", "--input-len", "10", "--output-len", "8",
                           "--range-ratio", "0.5", "--seed", "4", "--json-out", str(out))
    assert code == 0, text
    assert json.loads(out.read_text())["output_tokens"] == sum(p.output_len for p in drawn)


def test_serve_prefix_len_reports_what_the_prefix_cache_served(stack, tmp_path):
    """--prefix-len: the same random words open every prompt; one request at a time, each after the
    first finds the prefix's full pages cached, as usage.prompt_tokens_details.cached_tokens says."""
    from worker.bench.prompts import random_workload

    drawn = random_workload(3, 4, 8, seed=5, prefix_len=30)
    prefix = " ".join(drawn[0].text.split()[:30]) + " "
    assert all(p.text.startswith(prefix) and len(p.text.split()) == 34 for p in drawn)
    out = tmp_path / "report.json"
    code, text = run_bench("serve", "--url", stack, "--num-prompts", "3", "--concurrency", "1", "--input-len", "4",
                           "--prefix-len", "30", "--output-len", "8", "--seed", "5", "--json-out", str(out))
    assert code == 0, text
    report = json.loads(out.read_text())
    check_serve_report(report, 3)
    assert report["cached_prompt_tokens"] >= 2 * 24 and report["cached_prompt_tokens"] % 8 == 0  # pages of 8
    assert f"prefix cache: {report['cached_prompt_tokens']} of {report['prompt_tokens']} prompt tokens" in text


def test_serve_random_prompts_through_a_tokenizer_are_exactly_input_len_tokens(served, stack, tmp_path):
    """Random words make more tokens than words with most tokenizers; with the served model's
    tokenizer each random prompt is cut to exactly its drawn length in tokens, and the report says
    what the server counted (its special tokens included)."""
    import random

    import transformers

    from worker.bench.prompts import draw_lengths, exact_tokens, random_workload

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(served), local_files_only=True)
    drawn = random_workload(12, 20, 4, range_ratio=0.5, seed=3, tokenizer=tokenizer)
    lengths = [k for k, _ in draw_lengths(12, 20, 4, 0.5, seed=3)]
    assert [len(tokenizer.encode(p.text, add_special_tokens=False)) for p in drawn] == lengths
    words = random_workload(12, 20, 4, range_ratio=0.5, seed=3)
    assert sum(len(tokenizer.encode(p.text, add_special_tokens=False)) for p in words) > sum(lengths)  # the reason
    assert len(tokenizer.encode(exact_tokens("the", 9, tokenizer, random.Random(0)), add_special_tokens=False)) == 9
    out = tmp_path / "report.json"
    code, text = run_bench("serve", "--url", stack, "--num-prompts", "4", "--input-len", "20", "--output-len", "3",
                           "--tokenizer", str(served), "--json-out", str(out))
    assert code == 0, text
    report = json.loads(out.read_text())
    sent = random_workload(4, 20, 3, tokenizer=tokenizer)
    assert report["prompt_tokens"] == sum(len(tokenizer.encode(p.text)) for p in sent)  # as the API encodes them
    assert f"prompt tokens: {report['prompt_tokens'] / 4:.1f} a request" in text


def test_serve_without_ignore_eos_sends_only_standard_fields(stack, tmp_path):
    from worker.bench.prompts import Prompt
    from worker.bench.serve import Load

    load = Load(1, output_len=8, ignore_eos=False, endpoint="chat")
    body = load.body("m", Prompt("hello", 4))
    assert body == {"model": "m", "max_tokens": 4, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": "hello"}]}
    out = tmp_path / "report.json"
    code, text = run_bench("serve", "--url", stack, "--no-ignore-eos", "--num-prompts", "3", "--input-len", "4",
                           "--output-len", "8", "--json-out", str(out))
    assert code == 0, text
    report = json.loads(out.read_text())
    assert report["completed"] == 3 and 3 <= report["output_tokens"] <= 3 * 8 and report["ignore_eos"] is False


def test_serve_extra_body_goes_to_its_own_server_after_the_standard_fields(served, stack, redis_url, tmp_path):
    """--extra-body's fields go into every request to --url, after those the flags set (so they
    can also replace one); --compare-extra-body's into the baseline's (by default --extra-body's).
    Here --url's requests run to 3 tokens and the baseline's to the --output-len of 8."""
    from worker.bench.prompts import Prompt
    from worker.bench.serve import Load

    body = Load(1, output_len=8, extra_body={"max_tokens": 3, "top_k": 2}).body("m", Prompt("hi", None))
    assert (body["max_tokens"], body["top_k"], body["ignore_eos"]) == (3, 2, True)
    api, other = start_api(served, redis_url)
    try:
        out = tmp_path / "compare.json"
        code, text = run_bench("serve", "--url", stack, "--compare-url", other, "--num-prompts", "3", "--input-len", "6",
                               "--output-len", "8", "--extra-body", '{"max_tokens": 3}', "--compare-extra-body", "{}",
                               "--json-out", str(out))
    finally:
        stop(api)
    assert code == 0, text
    pair = json.loads(out.read_text())["loads"][0]["pairs"][0]
    assert (pair["report"]["output_tokens"], pair["baseline"]["output_tokens"]) == (3 * 3, 3 * 8)


def test_serve_sends_the_sampling_flags_with_every_request(stack, tmp_path):
    """--temperature, --top-p, --top-k and --min-p go into every request body (greedy and nothing
    else by default); the server runs the sampled requests, and the report records them."""
    from worker.bench.prompts import Prompt
    from worker.bench.serve import Load

    assert Load(1).sampling() == {"temperature": 0.0}
    sampled = Load(1, temperature=0.9, top_p=0.8, top_k=5, min_p=0.05)
    body = sampled.body("m", Prompt("hi", 3))
    assert {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p")} == sampled.sampling() == {
        "temperature": 0.9, "top_p": 0.8, "top_k": 5, "min_p": 0.05}
    assert "top_k" not in Load(1, top_p=0.5).body("m", Prompt("hi", 3))
    out = tmp_path / "report.json"
    code, text = run_bench("serve", "--url", stack, "--num-prompts", "4", "--input-len", "6", "--output-len", "8",
                           "--temperature", "0.9", "--top-p", "0.8", "--top-k", "5", "--min-p", "0.05",
                           "--json-out", str(out))
    assert code == 0, text
    report = json.loads(out.read_text())
    check_serve_report(report, 4)
    assert report["sampling"] == {"temperature": 0.9, "top_p": 0.8, "top_k": 5, "min_p": 0.05}


def test_serve_logprobs_asks_every_request_for_them(stack, tmp_path):
    """--logprobs N: completions send logprobs N, chat sends logprobs true and top_logprobs N (the
    API's two spellings); the server answers them and the report records N."""
    from worker.bench.prompts import Prompt
    from worker.bench.serve import Load

    assert "logprobs" not in Load(1).body("m", Prompt("hi", 3))
    assert Load(1, logprobs=3).body("m", Prompt("hi", 3))["logprobs"] == 3
    chat = Load(1, logprobs=3, endpoint="chat").body("m", Prompt("hi", 3))
    assert chat["logprobs"] is True and chat["top_logprobs"] == 3
    out = tmp_path / "report.json"
    for endpoint in ("completions", "chat"):
        code, text = run_bench("serve", "--url", stack, "--num-prompts", "3", "--input-len", "4", "--output-len", "8",
                               "--endpoint", endpoint, "--logprobs", "2", "--json-out", str(out))
        assert code == 0, text
        report = json.loads(out.read_text())
        check_serve_report(report, 3)
        assert report["logprobs"] == 2 and report["endpoint"] == endpoint


def test_sharegpt_replies_set_output_lengths_through_a_tokenizer(served, stack, tmp_path):
    """With --tokenizer, each ShareGPT request asks for as many tokens as the dataset's reply has
    (as vLLM's benchmark does); the served tokens add up to them (ignore_eos)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(served))
    replies = ["Water that flows to the sea.", "Hello there, how are you today?", ""]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "What is a river?"}, {"from": "gpt", "value": replies[0]}]},
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "user", "value": "Hi"},
                           {"from": "assistant", "value": replies[1]}]},
        {"conversations": [{"from": "human", "value": "no reply"}]},  # left out: nothing sets its length
    ]))
    lengths = [len(tok.encode(r, add_special_tokens=False)) for r in replies[:2]]
    assert min(lengths) > 1 and lengths[0] != lengths[1]
    out = tmp_path / "report.json"
    code, text = run_bench("serve", "--url", stack, "--endpoint", "chat", "--prompts-file", str(path),
                           "--tokenizer", str(served), "--num-prompts", "4", "--json-out", str(out))
    assert code == 0, text
    report = json.loads(out.read_text())
    assert report["completed"] == 4 and report["output_tokens"] == 2 * sum(lengths)
