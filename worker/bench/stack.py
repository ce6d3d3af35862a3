"""`redjax bench stack`: what the serving path costs, as a ratio to the engine alone, minutes apart.

Each pair of runs is one serving run and one offline run on the same machine:

- serving: `redjax serve` (embedded Redis, the API, one worker) on a free port, a warm-up load,
  then `bench serve` with every request sent at once (saturation), then the stack is stopped;
- offline: `redjax bench offline` in its own process, on the same prompts (`--prompts-file`, through
  the model's tokenizer as the API tokenizes them) and as many output tokens.

With `--compare hf` the other half is Hugging Face's own server on the same model instead, sent the
same load (hf_server.py).

Pairs alternate which run goes first, so a machine that drifts over the minutes of a benchmark
weighs on both. The load generator runs in this process, on the same cores as the stack: on a
small machine its CPU counts against the serving figure (`bench serve` pointed at a remote
server does not have that cost).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from worker.bench import cpu_usage
from worker.contract import HEARTBEAT_INTERVAL_S
from worker.service.cores import children_on, split_cores

WARMUP_PROMPTS = 64  # the first serving load of a fresh stack, at most this many requests
WARMUP_OUTPUT_LEN = 16
READY_TIMEOUT_S = 900.0  # the worker compiles its step shapes before it joins
STOP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class StackRun:
    model_dir: str
    num_prompts: int
    input_len: int  # words per random serving prompt
    output_len: int
    pairs: int
    seed: int
    engine_argv: tuple[str, ...]  # engine flags for the worker and the offline engine alike
    range_ratio: float = 0.0  # each request's words in and tokens out drawn around input_len, output_len
    prefix_len: int = 0  # random words before every prompt, the same in all of a pair
    workers: int = 1  # redjax serve's workers, each on its own cores; offline, as many engines on the same
    offline_argv: tuple[str, ...] = ()  # each offline engine's flags with several (its share of KV memory)
    compare: str = "offline"  # the baseline half: the engine alone, or "hf": transformers serve (hf_server.py)


def bench_stack(run: StackRun, log=print) -> dict:
    """Runs `run.pairs` serving/baseline pairs (the baseline: the engine alone, or with
    `run.compare` "hf" transformers' own server); returns each pair and the medians."""
    pairs: list[dict] = []
    prompt_tokens = 0  # per request, from the first serving run
    base = run.compare
    for i in range(run.pairs):
        seed = run.seed + 1000 * i
        order = ("serve", base) if i % 2 == 0 else (base, "serve")
        pair: dict = {"first": order[0]}
        for half in order:
            print(f"pair {i + 1}/{run.pairs}: {HALVES[half]}", file=sys.stderr, flush=True)
            if half == "serve":
                report, pair["serve_cpu"] = _serve_once(run, seed)
                prompt_tokens = prompt_tokens or max(1, round(report["prompt_tokens"] / max(1, report["completed"])))
                pair.update(_served("serve", report))
                pair["serve_step_compiles"] = report["step_compiles"]
                pair["serve_compile_stall_s"] = report["compile_stall_s"]
            elif half == "hf":
                from worker.bench.hf_server import hf_serve_once

                report, pair["hf_cpu"] = hf_serve_once(run, seed)
                pair.update(_served("hf", report))
            else:
                offline = _offline_once(run, seed)
                pair["offline_output_tokens_per_s"] = offline["output_tokens_per_s"]
                pair["offline_prompt_tokens"] = round(offline["mean_input_len"] * offline["num_prompts"])
                pair["offline_output_tokens"] = offline["output_tokens"]
                pair["offline_cached_prompt_tokens"] = offline["prefix_cache_hit_tokens"]
                pair["offline_cpu"] = offline["cpu"]
                if "engines" in offline:  # several engines, each on its own cores: each one's figures
                    pair["offline_engines"] = offline["engines"]
        pair["ratio"] = pair["serve_output_tokens_per_s"] / pair[f"{base}_output_tokens_per_s"]
        pairs.append(pair)
        log(f"pair {i + 1}/{run.pairs} ({order[0]} first): serving {pair['serve_output_tokens_per_s']:.1f}, "
            f"{BASELINES[base]} {pair[f'{base}_output_tokens_per_s']:.1f} output tok/s -> {pair['ratio']:.3f}x")
        log(f"  serving CPU, {cpu_usage.describe(pair['serve_cpu'])}")
        if pair["serve_step_compiles"] is not None:
            log(f"  serving run: {pair['serve_step_compiles']} step variants compiled by the workers, "
                f"{pair['serve_compile_stall_s']:.2f} s of stalled streams")
        log(f"  {BASELINES[base]} CPU, {cpu_usage.describe(pair[f'{base}_cpu'])}")
        if base == "hf":
            log(f"  p50 ttft {_p50(pair, 'serve', 'ttft')} against {_p50(pair, 'hf', 'ttft')} ms, "
                f"tpot {_p50(pair, 'serve', 'tpot')} against {_p50(pair, 'hf', 'tpot')} ms")
        if run.prefix_len:
            log(f"  prefix cache hits (prompt tokens): serving {pair['serve_cached_prompt_tokens']}, "
                f"{BASELINES[base]} {pair[f'{base}_cached_prompt_tokens']} of {pair['serve_prompt_tokens']}")
    serve = [p["serve_output_tokens_per_s"] for p in pairs]
    baseline = [p[f"{base}_output_tokens_per_s"] for p in pairs]
    return {
        "model": run.model_dir, "num_prompts": run.num_prompts, "input_words": run.input_len,
        "range_ratio": run.range_ratio, "prefix_words": run.prefix_len,
        "prompt_tokens_per_request": prompt_tokens, "output_len": run.output_len, "engine_flags": list(run.engine_argv),
        "workers": run.workers, "baseline": base,
        "pairs": [{k: v for k, v in p.items() if not k.endswith("_report")} for p in pairs],
        "serve_output_tokens_per_s": statistics.median(serve),
        f"{base}_output_tokens_per_s": statistics.median(baseline),
        "median_ratio": statistics.median(p["ratio"] for p in pairs),
        "failed": sum(p["serve_failed"] + p.get("hf_failed", 0) for p in pairs),
        "last_serve_report": pairs[-1]["serve_report"],
        **({"last_hf_report": pairs[-1]["hf_report"]} if base == "hf" else {}),
    }


HALVES = {"serve": "serving through redjax serve", "offline": "offline engine",
          "hf": "serving through transformers serve --continuous-batching"}
BASELINES = {"offline": "offline", "hf": "transformers serve"}


def _served(half: str, report: dict) -> dict:
    """A served half's figures in the pair, each key starting with `half`."""
    figures = {"output_tokens_per_s": report["output_token_throughput"], "prompt_tokens": report["prompt_tokens"],
               "output_tokens": report["output_tokens"], "cached_prompt_tokens": report["cached_prompt_tokens"],
               "failed": report["failed"], "report": report}
    return {f"{half}_{key}": value for key, value in figures.items()}


def _p50(pair: dict, half: str, key: str) -> str:
    value = pair[f"{half}_report"][key]["p50_ms"]
    return "n/a" if value is None else f"{value:.1f}"


def _serve_once(run: StackRun, seed: int) -> tuple[dict, dict | None]:
    """The measured run's report, and where the machine's CPU went during it."""
    from worker.bench.serve import Load, bench_serve

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile(mode="w+") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "serve", "--model", run.model_dir, "--port", str(port),
             "--workers", str(run.workers), *run.engine_argv],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            _wait_ready(proc, url, out, run.workers)
            _wait_compiled(url)
            warm_up(url, run, seed)
            prompts = _prompts(run, seed)
            roles = {"API": [proc.pid], "worker": cpu_usage.children(proc.pid, "worker"), "load generator": [os.getpid()]}
            compiled = _compiles(url)
            before = cpu_usage.take(roles)  # redis-server (its own daemon) is in the rest
            report = bench_serve(url, None, prompts, Load(run.num_prompts, output_len=run.output_len, seed=seed))
            usage = cpu_usage.between(before, cpu_usage.take(roles))
            report["step_compiles"], report["compile_stall_s"] = _compiles_since(url, compiled, time.monotonic())
            return report, usage
        finally:
            _stop(proc)


def warm_up(url: str, run: StackRun, seed: int, **load) -> None:
    """A fresh server's untimed load before the measured one: at most WARMUP_PROMPTS requests of
    WARMUP_OUTPUT_LEN tokens, shaped as the measured prompts (a prefix of their own: a prefix cache
    serves it in the same places); `load`: more Load fields (a server's own way to ignore EOS)."""
    from worker.bench.prompts import random_workload
    from worker.bench.serve import Load, bench_serve

    warm = min(run.num_prompts, WARMUP_PROMPTS)
    bench_serve(url, None, random_workload(warm, run.input_len, WARMUP_OUTPUT_LEN, 0.0, seed + 7, run.prefix_len),
                Load(warm, output_len=WARMUP_OUTPUT_LEN, seed=seed + 7, **load))


def _prompts(run: StackRun, seed: int) -> list:
    """The pair's measured prompts and output lengths, served and run offline alike."""
    from worker.bench.prompts import random_workload

    return random_workload(run.num_prompts, run.input_len, run.output_len, run.range_ratio, seed, run.prefix_len)


def _offline_once(run: StackRun, seed: int) -> dict:
    """The offline half: `bench offline` on the pair's prompts. With several workers, as many
    processes, each on the cores its worker gets and every n-th prompt, timing their rounds together
    (barrier.py); output tok/s is then all their output tokens over the longest round, and the CPU
    figures are the longest one's (they count every engine's threads)."""
    prompts, n = _prompts(run, seed), run.workers
    cores = split_cores(sorted(os.sched_getaffinity(0)), n)
    flags = [*run.offline_argv] if n > 1 else [*run.engine_argv]
    with tempfile.TemporaryDirectory(prefix="redjax-offline-") as tmp:
        procs = []
        for i in range(n):
            share = prompts[i::n]
            path = os.path.join(tmp, f"prompts-{i}.jsonl")
            with open(path, "w") as file:
                file.writelines(json.dumps({"prompt": p.text, "max_tokens": p.output_len}) + "\n" for p in share)
            cmd = [sys.executable, "-m", "worker.cli", "bench", "offline", "--model", run.model_dir, "--num-prompts",
                   str(len(share)), "--prompts-file", path, "--json", *flags]
            if n > 1:
                cmd += ["--barrier", f"{tmp}:{n}"]
            out, err = (open(os.path.join(tmp, f"{name}-{i}"), "w+") for name in ("out", "err"))
            with children_on(cores and cores[i]), out, err:
                procs.append((subprocess.Popen(cmd, stdout=out, stderr=err), out.name, err.name))
        while any(proc.poll() is None for proc, _, _ in procs):  # one that fails: the others stop too, not
            if any(proc.poll() for proc, _, _ in procs):  # waiting for it at the barrier
                for proc, _, _ in procs:
                    proc.kill()
            time.sleep(0.1)
        failed = sorted(((proc.returncode, Path(err).read_text()) for proc, _, err in procs if proc.returncode),
                        key=lambda f: f[0] < 0)  # the one that failed before those stopped for it
        if failed:
            raise RuntimeError(f"bench offline exited {failed[0][0]}: {failed[0][1][-2000:]}")
        reports = [json.loads(Path(out).read_text().strip().splitlines()[-1]) for _, out, _ in procs]
    if n == 1:
        return reports[0]
    longest = max(reports, key=lambda r: r["seconds"])
    tokens, prompts_run = sum(r["output_tokens"] for r in reports), sum(r["num_prompts"] for r in reports)
    return {"output_tokens_per_s": tokens / longest["seconds"], "output_tokens": tokens, "num_prompts": prompts_run,
            "mean_input_len": sum(r["mean_input_len"] * r["num_prompts"] for r in reports) / prompts_run,
            "prefix_cache_hit_tokens": sum(r["prefix_cache_hit_tokens"] for r in reports), "cpu": longest["cpu"],
            "engines": [{"seconds": r["seconds"], "output_tokens_per_s": r["output_tokens_per_s"]} for r in reports]}


def _compiles(url: str) -> tuple[float, float, float] | None:
    """From the stack's /metrics: step variants its workers compiled since their warm-up, the
    seconds their streams waited for them, and the oldest worker heartbeat's age (None: no answer)."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(url + "/metrics", timeout=10.0)
    if response.status_code != 200:
        return None
    found = {"redjax:step_compiles_total": 0.0, "redjax:step_compile_stall_seconds_total": 0.0}
    ages = [0.0]
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name] = sample.value
            elif sample.name == "redjax:worker_heartbeat_age_seconds":
                ages.append(sample.value)
    return (*found.values(), max(ages))


def _compiles_since(url: str, before: tuple[float, float, float] | None, ended: float) -> tuple[int | None, float | None]:
    """What the workers compiled between `before` and the run's end (`ended`, monotonic), once every
    worker has written a heartbeat since (they do every second); (None, None) without /metrics."""
    while before is not None:
        after = _compiles(url)
        if after is None:
            break
        if after[2] < time.monotonic() - ended or time.monotonic() - ended > 3 * HEARTBEAT_INTERVAL_S:
            return round(after[0] - before[0]), round(after[1] - before[1], 3)
        time.sleep(0.2)
    return None, None


def _wait_compiled(url: str) -> None:
    """Until no worker has step variants compiling or queued to compile while idle
    (`redjax:step_compiles_pending`): a worker compiles its idle queue after its warm-up while no
    request runs, and one compile under way when the load starts takes a core from the run."""
    from prometheus_client.parser import text_string_to_metric_families

    t0 = deadline = time.monotonic()
    deadline += READY_TIMEOUT_S
    while time.monotonic() < deadline:
        pending = sum(sample.value for family in text_string_to_metric_families(httpx.get(url + "/metrics").text)
                      for sample in family.samples if sample.name == "redjax:step_compiles_pending")
        if not pending:
            print(f"  workers' idle compiles done after {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
            return
        time.sleep(HEARTBEAT_INTERVAL_S)
    raise RuntimeError(f"the workers still had step variants to compile after {READY_TIMEOUT_S:.0f} s")


def _wait_ready(proc: subprocess.Popen, url: str, out, workers: int = 1) -> None:
    """Until /ready says `workers` workers serve the model; the stack's own output on failure."""
    def ready() -> bool:
        answer = httpx.get(url + "/ready", timeout=2.0)
        return answer.status_code == 200 and len(answer.json()["workers"]) >= workers

    wait_up(proc, out, "redjax serve", ready, READY_TIMEOUT_S)


def wait_up(proc: subprocess.Popen, out, name: str, ready, timeout_s: float) -> None:
    """Until `ready()` (an HTTP check; an HTTP error counts as not yet), for up to `timeout_s`;
    where the server `proc` exits first, an error with the end of its output (the file `out`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out.seek(0)
            raise RuntimeError(f"{name} exited {proc.returncode} before it was ready:\n{out.read()[-2000:]}")
        try:
            if ready():
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.5)
    raise RuntimeError(f"{name} was not ready within {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM: the stack stops its API, then its workers and Redis. The whole group if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
