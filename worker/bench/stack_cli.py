"""`redjax bench stack`: its command line (the runs themselves are in stack.py)."""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile

from worker.bench.cli import _checked_overrides
from worker.bench.serve_cli import _summary
from worker.cli import _engine_flags, engine_argv, resolve_model


def stack_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="redjax bench stack",
        description="serving through Redis and the API (redjax serve, saturated) against the engine alone "
                    "(bench offline), or against transformers' own server (--compare hf), in alternating pairs on "
                    "this machine; prints the ratio")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="local Hugging Face model directory (default: the demo model)")
    src.add_argument("--dummy", metavar="PRESET", help="random weights of a preset shape (llama-100m, ...) or of a "
                     "config.json, with a word-level tokenizer, written to a temporary directory and served like "
                     "any model")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=100, help="words per random prompt; the offline run gets the "
                   "same prompts, tokenized as the API tokenizes them")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="each request's words in and tokens out drawn "
                   "uniformly from [len * (1 - R), len * (1 + R)] (default 0: fixed)")
    p.add_argument("--prefix-len", type=int, default=0, help="this many random words before each prompt, the same "
                   "in all (a shared system prompt: both halves' prefix caches serve it)")
    p.add_argument("--pairs", type=int, default=3, help="serving/baseline pairs, alternating which goes first")
    p.add_argument("--workers", type=int, default=1, help="redjax serve's workers, each on its own share of the "
                   "cores; the offline half then runs as many engines on the same shares at once (default 1)")
    p.add_argument("--compare", choices=["offline", "hf"], default="offline",
                   help="the baseline half of each pair: offline, the engine alone on the same prompts (default); "
                        "hf, Hugging Face's own server (transformers serve --continuous-batching, PyTorch on the "
                        "CPU) on the same model, sent the same load by the same load generator")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text summary")
    _engine_flags(p)
    return p


def _hf_serve_available() -> bool:
    import importlib.util

    from transformers.utils import is_serve_available

    return is_serve_available() and importlib.util.find_spec("torch") is not None


def stack(argv: list[str]) -> int:
    parser = stack_parser()
    args = parser.parse_args(argv)
    if min(args.pairs, args.num_prompts, args.input_len, args.output_len, args.workers) < 1:
        parser.error("--pairs, --num-prompts, --input-len, --output-len and --workers must be >= 1")
    if args.workers > args.num_prompts:
        parser.error("--workers must not exceed --num-prompts (each offline engine runs its share)")
    if not 0 <= args.range_ratio < 1:
        parser.error("--range-ratio must be in [0, 1)")
    if args.prefix_len < 0:
        parser.error("--prefix-len must be >= 0")
    if args.compare == "hf" and args.quantization:
        parser.error("--compare hf serves the checkpoint's weights through transformers serve, which has no CPU "
                     "counterpart of --quantization; compare without it")
    if args.compare == "hf" and not _hf_serve_available():
        parser.error("--compare hf runs transformers serve, which needs PyTorch and transformers' serving extra: "
                     "pip install 'transformers[serving]' torch (redjax's dev extra has them)")
    from worker.bench.stack import StackRun, bench_stack
    from worker.engine.config import EngineConfig
    from worker.service.cores import kv_share

    overrides = _checked_overrides(parser, args)
    with tempfile.TemporaryDirectory(prefix="redjax-dummy-") if args.dummy else contextlib.nullcontext() as tmp:
        if args.dummy:
            from worker.bench.prompts import WORDS
            from worker.models.config import ModelConfigError
            from worker.models.dummy_model import write_dummy_model

            try:
                write_dummy_model(args.dummy, tmp, list(WORDS), overrides.get("dtype"))
            except ModelConfigError as exc:
                parser.error(str(exc))
        # the offline engines take what each worker takes: its share of the KV memory fraction
        shared = kv_share(overrides, args.workers, EngineConfig(**overrides))
        run = StackRun(tmp or resolve_model(args.model), args.num_prompts, args.input_len,
                       args.output_len, args.pairs, args.seed, tuple(engine_argv(overrides)), args.range_ratio,
                       args.prefix_len, args.workers, tuple(engine_argv(shared)), args.compare)
        report = bench_stack(run, log=(lambda *a: None) if args.json else print)
    if args.dummy:
        report["model"] = f"dummy:{args.dummy}"
    if args.json:
        print(json.dumps(report))
    else:
        from worker.bench.stack import BASELINES

        base = args.compare
        workers = (f", {args.workers} workers{' and engines' if base == 'offline' else ''}, each on its own cores"
                   if args.workers > 1 else "")
        print(f"{args.num_prompts} requests x ~{report['prompt_tokens_per_request']} prompt tokens / "
              f"{args.output_len}{f' +-{args.range_ratio:.0%}' if args.range_ratio else ''} out, {args.pairs} pairs"
              f"{workers}: serving {report['serve_output_tokens_per_s']:.1f}, {BASELINES[base]} "
              f"{report[f'{base}_output_tokens_per_s']:.1f} output tok/s (medians); "
              f"median ratio {report['median_ratio']:.3f}x")
        print("last serving run, " + _summary(report["last_serve_report"]))
        if base == "hf":
            print("last transformers serve run, " + _summary(report["last_hf_report"]))
    return 0 if report["failed"] == 0 else 1
