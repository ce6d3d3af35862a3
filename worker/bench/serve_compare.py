"""`redjax bench serve --compare-url`: the same load on two servers, in pairs, with the ratio.

Each load (a rate, a concurrency cap, or one of a sweep's) runs `--pairs` times on each server, the
two runs of a pair back to back on the same prompts, the server that goes first alternating from
pair to pair, so that a drift of the machine over the minutes (a neighbour on a shared host, a
thermal limit, the client's own warm-up) falls on both alike. A pair's ratio is the first server's
output tok/s over the baseline's; a load's ratio the median of its pairs'. Every pair draws prompts
of its own (other words, the same lengths), so neither server finds an earlier pair's in its prefix
cache; a `--prompts-file` is sent again in every pair. Two servers on one machine share its cores:
the idle one still takes its share of the idle CPU (for redjax a worker's polls of Redis), so a
benchmark of two servers on one host measures them beside each other.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace


def compare(args, servers: list, runs: list[tuple[float, int | None]], prompts_for: Callable[[int], list],
            slo: dict[str, float], percentiles: tuple[float, ...]) -> int:
    """Runs every load on both `servers` (serve_cli.Server: the first measured, the second the
    baseline) in `args.pairs` pairs; prints each pair and each load's median ratio, writes
    --json-out and --plot. 0 when every request of every run succeeded."""
    from worker.bench.serve import bench_serve
    from worker.bench.serve_cli import _load, _summary

    loads = []
    for index, (rate, concurrency) in enumerate(runs):
        load = _load(args, args.num_prompts, rate, concurrency)
        pairs = []
        for p in range(args.pairs):
            draw = index * args.pairs + p
            prompts = prompts_for(draw)
            order = (0, 1) if draw % 2 == 0 else (1, 0)  # who goes first alternates
            reports = {}
            for i in order:
                server = servers[i]
                reports[i] = bench_serve(server.url, server.model, prompts, replace(load, extra_body=server.extra),
                                         server.key, slo, percentiles, args.save_detailed)
            pair = {"first": "url" if order[0] == 0 else "compare_url", "report": reports[0], "baseline": reports[1],
                    "ratio": _ratio(reports[0], reports[1])}
            pairs.append(pair)
            print(_pair_text(servers, pair, p, args.pairs, _summary))
        ratios = [p["ratio"] for p in pairs if p["ratio"] is not None]
        ratio = statistics.median(ratios) if ratios else None
        loads.append({"request_rate": pairs[0]["report"]["request_rate"], "concurrency": concurrency,
                      "pairs": pairs, "ratio": ratio})
        if args.pairs > 1:
            each = ", ".join("n/a" if r is None else f"{r:.3f}" for r in (p["ratio"] for p in pairs))
            print(f"{_load_name(loads[-1])}: median ratio {_x(ratio)} over {args.pairs} pairs ({each})")
    result = {"url": servers[0].url, "compare_url": servers[1].url, "model": servers[0].model,
              "compare_model": servers[1].model, "pairs": args.pairs, "loads": loads}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        from worker.bench.plot import plot_sweep

        plot_sweep([_median_pair(load)["report"] for load in loads], args.plot,
                   [_median_pair(load)["baseline"] for load in loads], (servers[0].url, servers[1].url))
    failed = sum(r["failed"] for load in loads for p in load["pairs"] for r in (p["report"], p["baseline"]))
    if failed:
        print(f"redjax bench serve: {failed} requests failed (each run's errors line says why)", file=sys.stderr)
    return 0 if not failed else 1


def _ratio(report: dict, baseline: dict) -> float | None:
    """Output tok/s of `report` over `baseline`'s; None where either run failed a request (a run
    missing requests is not the same load)."""
    if report["failed"] or baseline["failed"] or not baseline["output_token_throughput"]:
        return None
    return report["output_token_throughput"] / baseline["output_token_throughput"]


def _median_pair(load: dict) -> dict:
    """The pair whose ratio is the load's median (the lower middle of an even count), else the first."""
    rated = sorted((p for p in load["pairs"] if p["ratio"] is not None), key=lambda p: p["ratio"])
    return rated[(len(rated) - 1) // 2] if rated else load["pairs"][0]


def _pair_text(servers: list, pair: dict, p: int, pairs: int, summary: Callable[[dict], str]) -> str:
    a, b = pair["report"], pair["baseline"]
    lines = [f"{_load_name(a)}, pair {p + 1} of {pairs} ({'baseline' if pair['first'] == 'compare_url' else 'url'} "
             "first):"]
    for name, server, report in (("url", servers[0], a), ("baseline", servers[1], b)):
        lines.append(f"  {name} {server.url} ({server.model}):")
        lines += ["  " + line for line in summary(report).splitlines()]
    lines.append(f"  ratio {_x(pair['ratio'])} (output tok/s {a['output_token_throughput']:.1f} against "
                 f"{b['output_token_throughput']:.1f}); p50 ttft {_ms(a['ttft'])} against {_ms(b['ttft'])}, "
                 f"tpot {_ms(a['tpot'])} against {_ms(b['tpot'])}")
    return "\n".join(lines)


def _load_name(report: dict) -> str:
    from worker.bench.serve import describe_load

    return describe_load(report["request_rate"], report["concurrency"])


def _x(ratio: float | None) -> str:
    return "n/a (a run had failed requests)" if ratio is None else f"{ratio:.3f}x"


def _ms(stats: dict) -> str:
    return "n/a" if stats["p50_ms"] is None else f"{stats['p50_ms']:.1f} ms"
