"""`redjax bench offline|serve|stack|attention|launch ...`: parse the mode's flags, run it, print the report."""

from __future__ import annotations

import argparse
import json
import os
import sys

from worker.bench import cpu_usage
from worker.cli import _engine_flags, _engine_overrides, log_to_stderr, resolve_model

MAX_LOGPROBS = 20  # --logprobs at most: OpenAI's top_logprobs limit, and the engine's default max_logprobs


def run(mode: str, argv: list[str]) -> int:
    if mode in ("attention", "launch"):
        from worker.bench import attention, launch

        return {"attention": attention, "launch": launch}[mode].run(argv)
    if mode == "stack":
        from worker.bench.stack_cli import stack

        return stack(argv)
    return {"offline": offline, "serve": serve}[mode](argv)


def offline_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="redjax bench offline", description="engine throughput on random or file prompts")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="local Hugging Face model directory")
    src.add_argument("--dummy", metavar="PRESET", help="random weights of a preset shape (llama-100m, llama3.2-1b, ...)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, help="random prompts: token ids each (default 128)")
    p.add_argument("--output-len", type=int, default=128, help="tokens out (of file prompts without their own)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="each request's input and output lengths drawn uniformly from [len * (1 - R), len * (1 + R)] "
                        "(default 0: fixed; the same lengths as bench serve's random prompts with the same seed)")
    p.add_argument("--prefix-len", type=int, default=0, help="random prompts: this many random ids before each, the "
                   "same in all of a round (a shared system prompt: exercises the prefix cache)")
    p.add_argument("--prompts-file", help="prompts instead of random ids, as bench serve reads them: one per line, "
                   "JSON lines with 'prompt' (and optionally 'max_tokens'), or a ShareGPT JSON file (each "
                   "conversation's first human turn, as many tokens out as its reply); cycled to --num-prompts")
    p.add_argument("--tokenizer", metavar="DIR", help="with --prompts-file: a local tokenizer (default: the "
                   "--model's; needed with --dummy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; else sampled, by both engines")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--options-every", type=int, default=1, metavar="N", help="--top-p, --logprobs, --prompt-logprobs and "
                   "the penalties on every N-th request only, the rest without them: mixed traffic (default 1: every request)")
    for name in ("frequency", "presence"):
        p.add_argument(f"--{name}-penalty", type=float, default=0.0, metavar="F", help=f"OpenAI's {name} penalty, in "
                       "[-2, 2] (default 0: none); not with --compare (transformers has no such penalty)")
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--logprobs", type=int, metavar="N", help="every request also asks for its tokens' logprobs and "
                   "the N most likely alternatives (0-20; default: none)")
    p.add_argument("--prompt-logprobs", type=int, metavar="N", help="every request also asks for its prompt tokens' "
                   "logprobs and the N most likely alternatives (0-20; default: none), as an echo request does; not "
                   "with --compare")
    p.add_argument("--compare", choices=["hf"], help="also run transformers generate on the same weights and prompts")
    p.add_argument("--hf-batch-size", type=_batch_size, default=None, metavar="N|auto",
                   help="transformers batch size, or auto (default): the fastest of 16/32/64 (up to the number of "
                        "prompts), tried on the first round's prompts")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat the run (and the baseline, alternating) on fresh prompts; report medians")
    p.add_argument("--profile", metavar="DIR", help="after the timed rounds, one more round with --profile-calls of "
                   "its calls holding prompt chunks and as many steady decode calls traced by the JAX profiler into "
                   "DIR/prefill and DIR/decode (Perfetto JSON); the report adds device time per prefill call and "
                   "per decode step by kernel and kind (attention, matmul, copy, scatter, other); on a GPU the traced "
                   "calls keep XLA's command buffers, as the timed ones run")
    p.add_argument("--profile-calls", type=int, default=8, metavar="N",
                   help="prefill calls and decode calls to trace (default 8 each)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text summary")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="stderr logging (info: each phase's duration and each step variant compiled)")
    p.add_argument("--barrier", type=_barrier, metavar="DIR:N", help="one of N processes of a data-parallel run "
                   "(bench stack --workers N starts them): all start and end their timed rounds together")
    _engine_flags(p)
    return p


def _barrier(text: str):
    from worker.bench.barrier import Barrier

    try:
        return Barrier.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _checked_overrides(parser: argparse.ArgumentParser, args) -> dict:
    """The engine flags; values the engine would refuse are usage errors before anything loads."""
    from worker.engine.config import EngineConfig

    overrides = _engine_overrides(args)
    try:
        EngineConfig(**overrides)
    except ValueError as exc:
        parser.error(str(exc))
    return overrides


def _batch_size(text: str) -> int | None:
    """--hf-batch-size: a positive number, or auto -> None."""
    if text == "auto":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError("expected a positive number or auto")
    return int(text)


def offline(argv: list[str]) -> int:
    parser = offline_parser()
    args = parser.parse_args(argv)
    log_to_stderr(args.log_level)
    if args.profile:
        from worker.bench.profile import trace_as_timed

        trace_as_timed(os.environ)
    from worker.bench.offline import Workload, WorkloadError, bench_offline
    from worker.engine.attention_choice import AttentionUnavailable
    from worker.models.config import ModelConfig, ModelConfigError

    if args.dummy:
        try:
            ModelConfig.preset(args.dummy)
        except (ModelConfigError, OSError) as exc:
            parser.error(str(exc))
    if min(args.num_prompts, args.input_len or 1, args.output_len, args.profile_calls) < 1:
        parser.error("--num-prompts, --input-len, --output-len and --profile-calls must be at least 1")
    if not 0 <= args.range_ratio < 1:
        parser.error("--range-ratio must be in [0, 1)")
    _check_logprobs(parser, args)
    _check_prompt_source(parser, args)
    if args.barrier and args.compare:
        parser.error("--barrier times the engine alone: not with --compare")
    if args.options_every < 1 or (args.options_every > 1 and args.compare):
        parser.error("--options-every must be at least 1, and 1 with --compare (transformers samples a batch alike)")
    penalties = (args.frequency_penalty, args.presence_penalty)
    if not all(-2 <= x <= 2 for x in penalties) or (any(penalties) and args.compare):
        parser.error("--frequency-penalty and --presence-penalty must be in [-2, 2], and 0 with --compare")
    if args.prompt_logprobs is not None and (not 0 <= args.prompt_logprobs <= MAX_LOGPROBS or args.compare):
        parser.error(f"--prompt-logprobs must be in [0, {MAX_LOGPROBS}], and not with --compare")
    overrides = _checked_overrides(parser, args)

    model = resolve_model(args.model) if args.model else None
    work = Workload(args.num_prompts, args.input_len or 128, args.output_len, args.seed, args.temperature, args.top_p,
                    args.top_k, args.range_ratio, _offline_requests(parser, args, model), args.prompts_file,
                    args.prefix_len, args.logprobs, args.options_every, *penalties, args.prompt_logprobs)
    try:
        report = bench_offline(model, args.dummy, overrides, work, args.compare == "hf", args.hf_batch_size,
                               args.rounds, (args.profile, args.profile_calls) if args.profile else None, args.barrier)
    except (WorkloadError, AttentionUnavailable) as exc:
        parser.error(str(exc))
    if args.json:
        print(json.dumps(report))
        return 0
    r = report
    s = r["sampling"]
    every = "" if s["options_every"] == 1 else f" on every {s['options_every']}th request"
    sampling = (f"sampled (temperature {s['temperature']:g}, top-p {s['top_p']:g}{every if s['top_p'] < 1 else ''}, top-k {s['top_k']}, "
                f"{r['sampler']} sampler)" if s["temperature"] else "greedy")
    sampling += "" if s["logprobs"] is None else f", logprobs {s['logprobs']}{every}"
    if s["frequency_penalty"] or s["presence_penalty"]:
        sampling += f", frequency penalty {s['frequency_penalty']:g}, presence {s['presence_penalty']:g}{every}"
    sampling += "" if s["prompt_logprobs"] is None else f", prompt logprobs {s['prompt_logprobs']}{every}"
    print(f"model {r['model']} ({r['num_params'] / 1e6:.1f}M params, {r['dtype']}, {r['attention']} "
          f"attention, {r['matmul']} matmul, {r['greedy_head']} greedy head, KV {r['kv_cache_dtype']}, {r['decode_steps']} fused decode steps): {r['num_prompts']} prompts {_lengths(r)}, {sampling}")
    print(f"  {r['requests_per_s']:.2f} requests/s, {r['output_tokens_per_s']:.1f} output tokens/s, "
          f"{r['total_tokens_per_s']:.1f} total tokens/s ({r['seconds']:.2f} s, "
          f"{r['compiles_during_run']} compiles during the run)")
    if r["prefix_cache_hit_tokens"]:
        print(f"  the prefix cache served {r['prefix_cache_hit_tokens']} of the first round's "
              f"{r['prompt_tokens']} prompt tokens ({r['prefix_cache_hit_tokens'] / r['prompt_tokens']:.1%})")
    if r["engine"]["speculative_tokens"]:
        stood = r["accepted_tokens"] / r["draft_tokens"] if r["draft_tokens"] else 0.0
        print(f"  speculation (up to {r['engine']['speculative_tokens']} draft tokens): the first round's steps checked "
              f"{r['draft_tokens']} drafts, {r['accepted_tokens']} stood ({stood:.1%}), "
              f"{r['accepted_tokens'] / r['output_tokens']:.1%} of its output tokens")
    kernel = r.get("matmul_gflops_kernel")
    which = (f" (the better of XLA's {r['matmul_gflops_xla']:.1f} and the engine kernel's {kernel:.1f})"
             if kernel else "")
    print(f"  machine: {r['device_name']}; {r['memory_bandwidth_gbs']:.1f} GB/s memory bandwidth, "
          f"{r['matmul_gflops']:.1f} GFLOP/s matmul{which}")
    up = r["startup"]
    print(f"  startup: calibration {up['calibration_s']:.1f} s, {up['variants_compiled_ahead']} step variants "
          f"compiled ahead in {up['compile_ahead_s']:.1f} s, warm-up {up['warmup_s']:.1f} s")
    if "decode_step_ms" in r:
        print(f"  decode: {r['decode_step_ms']:.2f} ms/step at batch {r['decode_mean_batch']:.1f} (ideal "
              f"{r['decode_ideal_step_ms']:.2f} ms = max of {r['decode_memory_step_ms']:.2f} ms memory, "
              f"{r['decode_compute_step_ms']:.2f} ms compute): roofline {r['decode_roofline_fraction']:.1%}, "
              f"host {r['decode_host_fraction']:.1%} of step time ({_host_parts(r['decode_phase'])})")
        if r["decode_shared_kv_fraction"]:
            print(f"  ({r['decode_shared_kv_fraction']:.1%} of the context decode read sits in pages the prefix cache "
                  "shares: counted once a step in the memory ideal)")
    if "prefill_token_us" in r:
        print(f"  prefill: {r['prefill_token_us']:.1f} us/token (ideal {r['prefill_ideal_token_us']:.1f} us): "
              f"roofline {r['prefill_roofline_fraction']:.1%}, host {r['prefill_host_fraction']:.1%} "
              f"({_host_parts(r['prefill_phase'])})")
    if "roofline_fraction" in r:
        print(f"  the run against its roofline: {r['ideal_prefill_s']:.2f} s of prefill + {r['ideal_decode_s']:.2f} s of "
              f"decode at the ideal, {r['measured_s']:.2f} s measured (all rounds): {r['roofline_fraction']:.2f}x")
        if "decode_serial_step_ms" in r:
            print(f"  with products and attention one after another, each at its roofline: decode "
                  f"{r['decode_serial_step_ms']:.2f} ms/step ({r['decode_serial_fraction']:.1%} of it), "
                  f"the run {r['serial_roofline_fraction']:.2f}x")
    if r["cpu"] is not None:
        print(f"  CPU of the first round, {cpu_usage.describe(r['cpu'])}")
    if "ratio" in r:
        same = (f" (greedy outputs identical for {r['greedy_match_fraction']:.0%} of prompts, the first token for "
                f"{r['greedy_first_token_match_fraction']:.0%}, the same for {r['greedy_mean_common_tokens']:.1f} tokens "
                "on average)" if "greedy_match_fraction" in r else "")
        print(f"  {r['baseline']}: {r['baseline_output_tokens_per_s']:.1f} output tokens/s -> ratio {r['ratio']:.2f}x{same}")
        if "ratio_at_roofline" in r:
            print(f"  transformers against the same roofline: {r['baseline_roofline_fraction']:.2f}x, so at the roofline "
                  f"the ratio would be {r['ratio_at_roofline']:.2f}x ({r['ratio_at_serial_roofline']:.2f}x with "
                  "products and attention one after another)")
        if len(r["baseline_batch_trials"]) > 1:
            tried = ", ".join(f"{b}: {t:.1f}" for b, t in r["baseline_batch_trials"].items())
            print(f"  transformers batch sizes tried on round 1 (output tokens/s): {tried}")
    for i, f in enumerate(r.get("per_round", [])):
        base = f" vs {f['baseline_output_tokens_per_s']:.1f} -> {f['ratio']:.2f}x" if "ratio" in f else ""
        print(f"  round {i + 1}: {f['output_tokens_per_s']:.1f} output tokens/s{base}")
    if r["rounds"] > 1:
        print(f"  (medians over {r['rounds']} rounds)")
    if "profile" in r:
        from worker.bench.profile import table

        print("\n".join("  " + line for line in table(r["profile"])))
    if "profile_error" in r:
        print(f"  profile: failed ({r['profile_error']}); the figures above stand")
    return 0


def _offline_requests(parser: argparse.ArgumentParser, args, model: str | None):
    """--prompts-file as token ids and output lengths (None without one): the file's text through
    --tokenizer or the model's own; a ShareGPT reply's tokens set that request's output length."""
    from worker.bench.prompts import is_sharegpt

    if not args.prompts_file:
        if args.tokenizer:
            parser.error("--tokenizer needs --prompts-file")
        return None
    if not (args.tokenizer or model):
        parser.error("--prompts-file with --dummy needs --tokenizer DIR to turn its text into token ids")
    try:
        tokenizer = _load_tokenizer(args.tokenizer or model)
    except (OSError, ValueError) as exc:
        parser.error(f"tokenizer: {str(exc).splitlines()[0]}")
    try:
        sharegpt = is_sharegpt(args.prompts_file)
    except OSError as exc:
        parser.error(f"--prompts-file: {exc}")
    prompts = _read_prompts_file(parser, args, tokenizer if sharegpt else None)
    return tuple((tuple(tokenizer.encode(p.text)), p.output_len or args.output_len) for p in prompts)


def _host_parts(phase: dict) -> str:
    """Host milliseconds per call, by part."""
    calls = max(phase["calls"], 1)
    parts = ", ".join(f"{part} {phase[part + '_s'] / calls * 1e3:.2f}" for part in ("schedule", "build", "launch",
                                                                                   "postprocess"))
    if phase.get("launch_thread_s"):  # --launch-thread: the launches ran beside the engine thread
        parts += f"; on the launch thread {phase['launch_thread_s'] / calls * 1e3:.2f}"
    return f"per call, ms: {parts}"


def _lengths(r: dict) -> str:
    """The workload's lengths: "x 128 in / 128 out", with a shared prefix, a range ratio or a file the means."""
    if r["prompts_file"]:
        return f"from {r['prompts_file']} (means {r['mean_input_len']:.1f} in / {r['mean_output_len']:.1f} out)"
    prefix = f"{r['prefix_len']} shared + " if r["prefix_len"] else ""
    if not r["range_ratio"]:
        return f"x {prefix}{r['input_len']} in / {r['output_len']} out"
    return (f"x {prefix}{r['input_len']} in / {r['output_len']} out +-{r['range_ratio']:.0%} (means "
            f"{r['mean_input_len']:.1f} / {r['mean_output_len']:.1f})")


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
    p.add_argument("--json-out", help="write the report (a list of reports with a sweep) here")
    p.add_argument("--plot", help="with a sweep: PNG of latency against load")
    return p


def serve(argv: list[str]) -> int:
    parser = serve_parser()
    args = parser.parse_args(argv)
    args.url = args.url.rstrip("/").removesuffix("/v1")  # the paths below start with /v1
    import httpx

    from worker.bench.serve import Load, bench_serve, served_model

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
    try:
        model = args.model or served_model(args.url, args.api_key)
    except (httpx.HTTPError, LookupError, ValueError) as exc:
        print(f"redjax bench serve: cannot read the served model from {args.url}/v1/models ({exc}); "
              "is the server up, and is its key in --api-key or $OPENAI_API_KEY?", file=sys.stderr)
        return 1
    if sweep and args.prompts_file:
        print("redjax bench serve: every run of the sweep sends the file's prompts again, so a prefix cache on the "
              "server may serve later runs from earlier ones (each run's 'prefix cache' line says how much)",
              file=sys.stderr)
    reports = []
    for index, (rate, concurrency) in enumerate(runs):
        if index and not args.prompts_file:  # fresh words, the same lengths: nothing cached by an earlier run
            prompts = _serve_prompts(parser, args, draw=index)
        load = Load(args.num_prompts, rate, concurrency, args.output_len, args.seed, args.burstiness,
                    args.endpoint, args.ignore_eos, args.temperature, args.top_p, args.top_k, args.min_p, args.logprobs)
        reports.append(bench_serve(args.url, model, prompts, load, args.api_key, slo, percentiles))
        print(_summary(reports[-1]))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(reports if sweep else reports[0], f, indent=2)
    if args.plot:
        from worker.bench.plot import plot_sweep

        plot_sweep(reports, args.plot)
    return 0 if all(r["failed"] == 0 for r in reports) else 1


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


def _check_logprobs(parser: argparse.ArgumentParser, args) -> None:
    if args.logprobs is not None and not 0 <= args.logprobs <= MAX_LOGPROBS:
        parser.error(f"--logprobs must be in [0, {MAX_LOGPROBS}]")


def _check_prompt_source(parser: argparse.ArgumentParser, args) -> None:
    """Flags that shape random prompts are usage errors with --prompts-file (before any loading)."""
    if args.prompts_file and (args.input_len is not None or args.range_ratio or args.prefix_len):
        parser.error("--input-len, --range-ratio and --prefix-len shape random prompts, not --prompts-file")
    if args.prefix_len < 0:
        parser.error("--prefix-len must be >= 0")


def _read_prompts_file(parser: argparse.ArgumentParser, args, tokenizer) -> list:
    """--prompts-file cycled to --num-prompts (ShareGPT reply lengths through `tokenizer`); a
    file that cannot be read is a usage error."""
    from worker.bench.prompts import file_prompts

    try:
        return file_prompts(args.prompts_file, args.num_prompts, tokenizer)
    except (OSError, ValueError) as exc:
        parser.error(f"--prompts-file: {exc}")


def _load_tokenizer(path: str):
    """A local Hugging Face tokenizer directory (nothing is downloaded)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.model_max_length = 1 << 30  # it only counts and cuts: no warning about texts past the model's context
    return tokenizer


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
    if r["completed"] and r["prompt_tokens"]:  # what the server counted, special tokens included
        lines.append(f"  prompt tokens: {r['prompt_tokens'] / r['completed']:.1f} a request, as the server counted them")
    if r["cached_prompt_tokens"] is not None:
        share = r["cached_prompt_tokens"] / max(1, r["prompt_tokens"])
        lines.append(f"  prefix cache: {r['cached_prompt_tokens']} of {r['prompt_tokens']} prompt tokens ({share:.1%})")
    if r["errors"]:
        lines.append(f"  errors: {r['errors']}")
    return "\n".join(lines)
