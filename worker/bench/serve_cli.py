"""`redjax bench serve`: its command line, the untimed first and warm-up requests, and the printed
summary (the load itself is in serve.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import NamedTuple

from worker.bench.cli import _check_logprobs, _check_prompt_source, _load_tokenizer, _read_prompts_file


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="redjax bench serve", description="load test an OpenAI-compatible endpoint")
    p.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000 (or the OpenAI clients' "
                   "base URL, ending in /v1)")
    p.add_argument("--model", help="model name to send (default: the first one /v1/models lists)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or None,
                   help="Bearer key (default: $OPENAI_API_KEY; an environment variable keeps it out of the "
                        "process list)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions (default) or /v1/chat/completions (each prompt as one user message)")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--request-rate", type=float, default=float("inf"), help="arrivals/s (default: all at once)")
    rate.add_argument("--sweep", help="comma-separated request rates, one run each")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps between arrivals: 1 Poisson (default), < 1 burstier, > 1 steadier")
    p.add_argument("--concurrency", help="requests in flight at most (with a rate too: arrivals wait for a free "
                   "slot); comma-separated values sweep it, e.g. 1,4,16,64")
    p.add_argument("--input-len", type=int, help="words per random prompt, or tokens with --tokenizer (default 128)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens (of file prompts without their own)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random prompts: input and output lengths "
                   "uniform in [len * (1 - R), len * (1 + R)] (default 0: fixed)")
    p.add_argument("--prefix-len", type=int, default=0, help="random prompts: this many random words before each, "
                   "the same in all (a shared system prompt: exercises the prefix cache)")
    p.add_argument("--prompts-file", help="one prompt per line, JSON lines with 'prompt' (and optionally "
                   "'max_tokens'), or a ShareGPT JSON file (each conversation's first human turn)")
    p.add_argument("--tokenizer", metavar="DIR", help="a local tokenizer directory (the served model's): random "
                   "prompts are then exactly --input-len tokens; with a ShareGPT --prompts-file each request's "
                   "max_tokens is the token count of the dataset's reply")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests end at EOS (without it every request sends the ignore_eos extension and "
                        "runs to max_tokens)")
    p.add_argument("--temperature", type=float, default=0.0, help="every request's temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, help="every request's top_p (default: not sent)")
    p.add_argument("--top-k", type=int, help="every request's top_k, an extension vLLM and redjax honour (default: "
                   "not sent)")
    p.add_argument("--min-p", type=float, help="every request's min_p, the same kind of extension (default: not sent)")
    p.add_argument("--logprobs", type=int, metavar="N", help="every request also asks for its tokens' logprobs and "
                   "the N most likely alternatives (0-20; default: none)")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=[],
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (keys: ttft, tpot, e2e)")
    p.add_argument("--percentiles", default="50,90,99", help="latency percentiles to report, comma-separated "
                   "(default 50,90,99; e.g. 50,90,99,99.9)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=0, metavar="N",
                   help="N untimed requests at the first run's concurrency before it, after the one untimed first "
                        "request every benchmark sends (default 0); random words at the workload's median prompt "
                        "length and --output-len tokens, so the timed prompts are not in the server's prefix cache")
    p.add_argument("--ready-timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait for a server still starting: for its port, then for the first request "
                        "(redjax queues it until a worker is up) (default 600)")
    p.add_argument("--compare-url", metavar="URL", help="a second OpenAI-compatible server, the baseline: every run "
                   "goes to both, in alternating order, on the same prompts, and the report gives each pair's "
                   "ratio of output tok/s (--url over this)")
    p.add_argument("--compare-model", help="model name to send the baseline (default: the first it lists)")
    p.add_argument("--compare-api-key", default=os.environ.get("COMPARE_API_KEY") or None,
                   help="the baseline's Bearer key (default: $COMPARE_API_KEY, else --api-key's)")
    p.add_argument("--extra-body", metavar="JSON", help="a JSON object whose fields every request to --url also "
                   "sends, after those set here (a server's own extensions: e.g. '{\"repetition_penalty\": 1.1}')")
    p.add_argument("--compare-extra-body", metavar="JSON", help="the same for the baseline (default: --extra-body's). "
                   "transformers serve refuses ignore_eos: with --no-ignore-eos, --extra-body '{\"ignore_eos\": true}' "
                   "and this '{\"generation_config\": \"{\\\"eos_token_id\\\": -1}\"}' both servers run to max_tokens")
    p.add_argument("--pairs", type=int, default=1, help="with --compare-url: pairs of runs at each load (default 1); "
                   "the ratio is their median")
    p.add_argument("--save-detailed", action="store_true", help="--json-out also holds each request's figures "
                   "(when it was sent, tokens, TTFT, TPOT, end-to-end latency, the gaps between its chunks, its "
                   "error), as vLLM's flag of the name does; never its text")
    p.add_argument("--json-out", help="write the report (a list of reports with a sweep) here")
    p.add_argument("--plot", help="with a sweep: PNG of latency against load")
    return p


def serve(argv: list[str]) -> int:
    parser = serve_parser()
    args = parser.parse_args(argv)
    args.url = _base_url(args.url)
    import httpx

    from worker.bench.serve import bench_serve, served_model

    try:
        slo = {k: float(v) for k, v in (item.split(":", 1) for item in args.goodput)}
    except ValueError:
        parser.error("--goodput takes KEY:MS pairs, e.g. ttft:500 tpot:50")
    if set(slo) - {"ttft", "tpot", "e2e"}:
        parser.error("--goodput keys are ttft, tpot and e2e")
    if args.num_prompts < 1 or (args.input_len is not None and args.input_len < 1) or args.output_len < 1:
        parser.error("--num-prompts, --input-len and --output-len must be >= 1")
    _check_prompt_source(parser, args)
    if not args.burstiness > 0:
        parser.error("--burstiness must be > 0")
    if args.warmup < 0 or not args.ready_timeout >= 0:
        parser.error("--warmup and --ready-timeout must be >= 0")
    if args.save_detailed and not args.json_out:
        parser.error("--save-detailed adds to --json-out's report: give --json-out too")
    if args.pairs < 1 or (args.pairs > 1 and not args.compare_url):
        parser.error("--pairs must be >= 1, and more than 1 needs --compare-url")
    if (args.compare_model or args.compare_api_key or args.compare_extra_body) and not args.compare_url:
        parser.error("--compare-model, --compare-api-key and --compare-extra-body go with --compare-url")
    extra = _json_object(parser, "--extra-body", args.extra_body)
    compare_extra = extra if args.compare_extra_body is None else _json_object(parser, "--compare-extra-body",
                                                                               args.compare_extra_body)
    if not 0 <= args.range_ratio < 1:
        parser.error("--range-ratio must be in [0, 1)")
    if not (args.temperature >= 0 and (args.top_p is None or 0 < args.top_p <= 1)
            and (args.top_k is None or args.top_k >= 1) and (args.min_p is None or 0 <= args.min_p <= 1)):
        parser.error("sampling: --temperature must be >= 0, --top-p in (0, 1], --top-k >= 1, --min-p in [0, 1]")
    _check_logprobs(parser, args)
    percentiles = _percentiles(parser, args.percentiles)
    prompts = _serve_prompts(parser, args)
    runs = _serve_runs(parser, args)
    sweep = bool(args.sweep) or len(runs) > 1
    if args.plot and not sweep:
        parser.error("--plot needs a sweep (--sweep, or several --concurrency values)")
    servers = [Server(args.url, args.model, args.api_key, extra)]
    if args.compare_url:
        servers.append(Server(_base_url(args.compare_url), args.compare_model, args.compare_api_key or args.api_key,
                              compare_extra))
    for i, server in enumerate(servers):
        try:
            servers[i] = server._replace(model=server.model or served_model(server.url, server.key, args.ready_timeout))
        except (httpx.HTTPError, LookupError, ValueError) as exc:
            key = "--compare-api-key or $COMPARE_API_KEY" if i else "--api-key or $OPENAI_API_KEY"
            print(f"redjax bench serve: cannot read the served model from {server.url}/v1/models ({exc}); "
                  f"is the server up, and is its key in {key}?", file=sys.stderr)
            return 1
    warm = _warm_prompts(args, prompts)
    if not all(_warm_up(args, server, warm, runs[0]) for server in servers):
        return 1
    if sweep and args.prompts_file:
        print("redjax bench serve: every run of the sweep sends the file's prompts again, so a prefix cache on the "
              "server may serve later runs from earlier ones (each run's 'prefix cache' line says how much)",
              file=sys.stderr)
    if args.compare_url:
        from worker.bench.serve_compare import compare

        return compare(args, servers, runs, lambda draw: _serve_prompts(parser, args, draw), slo, percentiles)
    reports = []
    for index, (rate, concurrency) in enumerate(runs):
        if index and not args.prompts_file:  # fresh words, the same lengths: nothing cached by an earlier run
            prompts = _serve_prompts(parser, args, draw=index)
        load = _load(args, args.num_prompts, rate, concurrency, extra)
        reports.append({**bench_serve(args.url, servers[0].model, prompts, load, args.api_key, slo, percentiles,
                                      args.save_detailed),
                        "warmup_requests": 0 if index else 1 + args.warmup})
        print(_summary(reports[-1]))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(reports if sweep else reports[0], f, indent=2)
    if args.plot:
        from worker.bench.plot import plot_sweep

        plot_sweep(reports, args.plot)
    return 0 if all(r["failed"] == 0 for r in reports) else 1


def _base_url(url: str) -> str:
    """The server's root: the paths requested start with /v1, which an OpenAI client's base URL ends in."""
    return url.rstrip("/").removesuffix("/v1")


class Server(NamedTuple):
    url: str
    model: str | None  # None: the first the server lists
    key: str | None
    extra: dict | None = None  # more fields every request to it sends (--extra-body)


def _json_object(parser: argparse.ArgumentParser, flag: str, text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        parser.error(f"{flag} is not valid JSON ({exc})")
    if not isinstance(value, dict):
        parser.error(f"{flag} must be a JSON object, e.g. '{{\"top_k\": 20}}'")
    return value


def _load(args, num_prompts: int, rate: float, concurrency: int | None, extra: dict | None = None):
    from worker.bench.serve import Load

    return Load(num_prompts, rate, concurrency, args.output_len, args.seed, args.burstiness, args.endpoint,
                args.ignore_eos, args.temperature, args.top_p, args.top_k, args.min_p, args.logprobs, extra)


def _warm_prompts(args, prompts: list) -> list:
    """The untimed requests' prompts, the first request's then --warmup more: random words (after the
    run's shared prefix) at the workload's median prompt length, --output-len tokens out, so that no
    timed prompt is in a server's prefix cache from them."""
    import statistics

    from worker.bench.prompts import random_workload

    words = args.input_len or 128
    if args.prompts_file:
        words = max(1, round(statistics.median(len(p.text.split()) for p in prompts)))
    tokenizer = _load_tokenizer(args.tokenizer) if args.tokenizer and not args.prompts_file else None
    return random_workload(1 + args.warmup, words, args.output_len, 0.0, args.seed, args.prefix_len, -1, tokenizer)


def _warm_up(args, server: Server, warm: list, first_run: tuple[float, int | None]) -> bool:
    """The untimed first request (`warm[0]`), then the other `warm` prompts at the first run's
    concurrency, all at once. False, with the server's answer printed, where one failed: nothing is
    timed then."""
    from worker.bench.serve import first_request, warm_up

    t0 = time.perf_counter()
    first = first_request(server.url, server.model, warm[0], _load(args, 1, *first_run, server.extra), server.key,
                          args.ready_timeout)
    if not first.ok:
        print(f"redjax bench serve: the first (untimed) request to {server.url} failed, so no load was sent: "
              f"{first.error}", file=sys.stderr)
        return False
    print(f"redjax bench serve: the first (untimed) request to {server.url} took {time.perf_counter() - t0:.2f} s",
          file=sys.stderr)
    if args.warmup:
        t0 = time.perf_counter()
        results = warm_up(server.url, server.model, warm[1:],
                          _load(args, args.warmup, float("inf"), first_run[1], server.extra), server.key)
        failed = [r.error for r in results if not r.ok]
        if failed:
            print(f"redjax bench serve: {len(failed)} of {args.warmup} warm-up requests failed, so no load was sent: "
                  f"{sorted(set(failed))[:3]}", file=sys.stderr)
            return False
        print(f"redjax bench serve: {args.warmup} warm-up requests in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    return True


def _percentiles(parser: argparse.ArgumentParser, text: str) -> tuple[float, ...]:
    try:
        percentiles = tuple(sorted({float(q) for q in text.split(",")}))
    except ValueError:
        percentiles = ()
    if not percentiles or not all(0 < q < 100 for q in percentiles):
        parser.error("--percentiles takes comma-separated numbers in (0, 100), e.g. 50,90,99,99.9")
    return percentiles


def _serve_prompts(parser: argparse.ArgumentParser, args, draw: int = 0) -> list:
    """The run's prompts: random words (`draw`: which of a sweep's runs), or --prompts-file (ShareGPT
    lengths through --tokenizer)."""
    from worker.bench.prompts import random_workload

    try:
        tokenizer = _load_tokenizer(args.tokenizer) if args.tokenizer else None
    except (OSError, ValueError) as exc:
        parser.error(f"--tokenizer: {str(exc).splitlines()[0]}")
    if args.prompts_file:
        return _read_prompts_file(parser, args, tokenizer)
    return random_workload(args.num_prompts, args.input_len or 128, args.output_len, args.range_ratio, args.seed,
                           args.prefix_len, draw, tokenizer)


def _serve_runs(parser: argparse.ArgumentParser, args) -> list[tuple[float, int | None]]:
    """(request rate, concurrency) of each run: every --sweep rate with every --concurrency value."""
    try:
        rates = [float(x) for x in args.sweep.split(",")] if args.sweep else [args.request_rate]
    except ValueError:
        parser.error("--sweep takes comma-separated request rates, e.g. 1,2,4,inf")
    if not all(rate > 0 for rate in rates):
        parser.error("request rates must be > 0")
    if args.burstiness != 1.0 and all(rate == float("inf") for rate in rates):
        parser.error("--burstiness shapes the gaps between arrivals at a finite --request-rate (or --sweep)")
    try:
        caps = [int(x) for x in args.concurrency.split(",")] if args.concurrency else [None]
    except ValueError:
        parser.error("--concurrency takes a number of requests, or comma-separated numbers to sweep")
    if not all(c is None or c >= 1 for c in caps):
        parser.error("--concurrency must be >= 1")
    return [(rate, cap) for rate in rates for cap in caps]


def _summary(r: dict) -> str:
    from worker.bench.serve import describe_load

    load = describe_load(r["request_rate"], r["concurrency"])
    lines = [f"{load}: {r['completed']}/{r['num_requests']} ok in {r['duration_s']:.2f} s, "
             f"{r['request_throughput']:.2f} req/s, {r['output_token_throughput']:.1f} output tok/s, "
             f"goodput {r['goodput']:.2f} req/s"]
    for key in ("ttft", "tpot", "itl", "e2e"):
        d = r[key]
        stats = "  ".join(f"{k.removesuffix('_ms')} " + ("n/a" if v is None else f"{v:.1f}") for k, v in d.items())
        lines.append(f"  {key:5s} ms: {stats}")
    if r.get("no_text_requests"):
        lines.append(f"  streamed no text: {r['no_text_requests']} of the requests (not in the TTFT and TPOT figures)")
    if r["completed"] and r["prompt_tokens"]:  # what the server counted, special tokens included
        lines.append(f"  prompt tokens: {r['prompt_tokens'] / r['completed']:.1f} a request, as the server counted them")
    if r["cached_prompt_tokens"] is not None:
        share = r["cached_prompt_tokens"] / max(1, r["prompt_tokens"])
        lines.append(f"  prefix cache: {r['cached_prompt_tokens']} of {r['prompt_tokens']} prompt tokens ({share:.1%})")
    if r["errors"]:
        lines.append(f"  errors: {r['errors']}")
    return "\n".join(lines)
