"""`redjax bench offline|serve|stack|attention|launch ...`: parse the mode's flags, run it, print the report."""

from __future__ import annotations

import argparse
import json
import os

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
    if mode == "serve":
        from worker.bench.serve_cli import serve

        return serve(argv)
    return offline(argv)


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
          f"attention, {r['matmul']} matmul{', ' + r['quantization'] if r['quantization'] else ''}, {r['greedy_head']} greedy head, KV {r['kv_cache_dtype']}, {r['decode_steps']} fused decode steps): {r['num_prompts']} prompts {_lengths(r)}, {sampling}")
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
          f"{r['matmul_gflops']:.1f} GFLOP/s matmul{which}"
          + (f", {r['matmul_gflops_int8']:.1f} GOP/s {r['quantization'].split()[0]} projections"
             if r.get("matmul_gflops_int8") else ""))
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
