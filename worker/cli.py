"""`redjax`: one CLI for every process. Subcommands import what they need lazily, so
`redjax api` and `redjax dashboard` never import JAX."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from worker.engine.config import MAX_AUTO_DECODE_STEPS

DEMO_MODEL = Path(__file__).parent / "demo_model"


def resolve_model(arg: str | None) -> str:
    """`None` or "demo" -> the demo model shipped with redjax; anything else is a local directory."""
    if arg in (None, "", "demo"):
        if not (DEMO_MODEL / "config.json").is_file():
            sys.exit(f"redjax: the demo model is missing from {DEMO_MODEL}; pass --model DIR")
        return str(DEMO_MODEL)
    if not Path(arg).is_dir():
        sys.exit(f"redjax: model directory {arg!r} does not exist (no model is downloaded at run time)")
    return arg


def _engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--max-num-seqs", type=int, help="sequences per step at most (default 64)")
    g.add_argument("--max-num-batched-tokens", type=int, help="tokens per step at most (default 1024)")
    g.add_argument("--page-size", type=int, help="tokens per KV page (default 64 on CPU, 16 on accelerators)")
    g.add_argument("--num-pages", type=int, help="KV pages (default: from free memory)")
    g.add_argument("--kv-cache-memory-fraction", type=float, help="share of free memory for KV pages (default 0.5)")
    g.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute dtype (default: the checkpoint's)")
    g.add_argument("--kv-cache-dtype", choices=["float32", "bfloat16", "int8"],
                   help="KV page dtype (default: the compute dtype); bfloat16 halves KV memory and traffic, int8 "
                        "quarters it (each token's key and value by its own scale per KV head)")
    g.add_argument("--quantization", choices=["int8", "int4"],
                   help="int8: the layers' projections in int8, weights quantized at load by output column and "
                        "activations by token as each step runs (W8A8, torchao's int8 dynamic scheme); int4: "
                        "weights in 4 bits by groups of 128 inputs (or 64, 32), activations int8 by token (W4A8, "
                        "torchao's 8da4w), half int8's weight bytes; faster, outputs near but not equal to the "
                        "unquantized model's. Default: off")
    g.add_argument("--decode-steps", type=_decode_steps,
                   help="decode steps fused per call when nothing waits: a number, or auto (default): as many "
                        f"as one call runs in --decode-window-ms, timed at warm-up, at most {MAX_AUTO_DECODE_STEPS}")
    g.add_argument("--decode-window-ms", type=float,
                   help="auto decode steps: the longest one fused call should take (default 100); a longer "
                        f"window fuses no more than {MAX_AUTO_DECODE_STEPS} steps (give --decode-steps a number for more)")
    g.add_argument("--async-overlap", dest="async_overlap", action="store_const", const=True,
                   help="always dispatch the next step before reading back the one in flight (default on "
                        "accelerators; on the CPU only while a new request could not start at once anyway)")
    g.add_argument("--no-async-overlap", dest="async_overlap", action="store_const", const=False,
                   help="read each step back before dispatching the next")
    g.add_argument("--launch-thread", action="store_const", const=True,
                   help="launch each step from a helper thread while the engine thread reads back and schedules "
                        "(default on accelerators, where a launch costs the host milliseconds; off on the CPU)")
    g.add_argument("--no-launch-thread", dest="launch_thread", action="store_const", const=False,
                   help="launch each step from the engine thread, also on an accelerator")
    g.add_argument("--no-prefix-cache", dest="enable_prefix_cache", action="store_const", const=False)
    g.add_argument("--speculative-tokens", type=int, metavar="N",
                   help="prompt-lookup speculation: up to N draft tokens a sequence and step, taken from where its "
                        "last tokens occurred before in its prompt or output and checked in the same step (the same "
                        "output, more tokens a step where text repeats; only rows a step has spare). Default 0: off")
    g.add_argument("--tensor-parallel", type=int, help="devices one model spans (default 1)")
    g.add_argument("--attention", choices=["auto", "kernel", "pallas", "jnp"],
                   help="paged attention: the backend's kernel where it applies (auto: compiled C++ on CPU, "
                        "Pallas/Triton decode on GPU), required (kernel: CPU, pallas: GPU), or jnp")
    g.add_argument("--matmul", choices=["auto", "kernel", "xla"],
                   help="projections: compiled CPU kernel on packed float32 weights when available (auto), "
                        "required (kernel), or XLA's dot")
    g.add_argument("--greedy-head", choices=["auto", "screened", "screened-int8", "screened-bf16", "full"],
                   help="greedy rows' tokens: a float32 model's LM head as an int8 (AVX512-VNNI) or else bfloat16 "
                        "(AVX512-BF16) product screened for the float32 argmax, the same tokens at about half the "
                        "head's cost (auto), required (screened, or one approximation), or the float32 head (full)")
    g.add_argument("--compile-threads", type=int,
                   help="step variants warm-up compiles at once, and the most compiled in the background at once "
                        "while serving (default: half the host's cores, at most 8)")
    g.add_argument("--sampler", choices=["auto", "kernel", "jnp"],
                   help="sampled rows' top-k/top-p cutoffs and draws: compiled CPU kernels when available (auto), "
                        "required (kernel), or jnp")
    g.add_argument("--pallas-tuning", metavar="PAGES:PROGRAMS:WARPS:STAGES",
                   help="the GPU decode kernel's work split (default 4:1024:4:2; `redjax bench attention` times "
                        "settings); only with the Pallas kernel")
    g.add_argument("--pallas-prefill", action="store_const", const=True,
                   help="prefill rows through the Pallas prefill kernel, or fail (default: with the Pallas decode "
                        "kernel, where it compiles; `redjax bench attention` times it against the reference)")
    g.add_argument("--no-pallas-prefill", dest="pallas_prefill", action="store_const", const=False,
                   help="prefill rows through the reference attention, also with the Pallas decode kernel")


ENGINE_KEYS = ("max_num_seqs", "max_num_batched_tokens", "page_size", "num_pages", "kv_cache_memory_fraction",
               "max_model_len", "dtype", "kv_cache_dtype", "quantization", "decode_steps", "decode_window_ms", "async_overlap", "launch_thread", "enable_prefix_cache", "tensor_parallel",
               "attention", "matmul", "greedy_head", "sampler", "compile_threads", "pallas_tuning", "pallas_prefill",
               "speculative_tokens")


def _decode_steps(value: str) -> int | None:
    """--decode-steps: a positive number, or auto (None: the engine's default)."""
    if value.strip().lower() == "auto":
        return None
    steps = int(value)
    if steps < 1:
        raise argparse.ArgumentTypeError("decode steps must be >= 1 or auto")
    return steps


def _engine_overrides(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ENGINE_KEYS if getattr(args, k, None) is not None}


def usage_error(command: str, message: str) -> None:
    """Exit as argparse does on a bad flag (status 2), before anything starts."""
    print(f"redjax {command}: error: {message}", file=sys.stderr)
    sys.exit(2)


def worker_config(command: str, overrides: dict):
    """The WorkerConfig that flags (`overrides`) and REDJAX_* variables give a worker; one they
    make invalid (e.g. --max-num-batched-tokens under --max-num-seqs) is a usage error."""
    from worker.service.config import WorkerConfig

    try:
        return WorkerConfig.from_env(overrides)
    except (ValueError, TypeError) as exc:
        usage_error(command, str(exc))


def engine_argv(overrides: dict) -> list[str]:
    """The engine flags that give `overrides` (from `_engine_overrides`) to a child process."""
    argv: list[str] = []
    for key, value in overrides.items():
        if isinstance(value, bool):  # a flag that gives the value other than the default
            flag = {("async_overlap", False): "--no-async-overlap", ("async_overlap", True): "--async-overlap",
                    ("enable_prefix_cache", False): "--no-prefix-cache",
                    ("pallas_prefill", True): "--pallas-prefill", ("pallas_prefill", False): "--no-pallas-prefill",
                    ("launch_thread", True): "--launch-thread", ("launch_thread", False): "--no-launch-thread"}.get((key, value))
            if flag:
                argv.append(flag)
        else:
            argv += ["--" + key.replace("_", "-"), str(value)]
    return argv


SAMPLING_HELP = ("sampling fields a request leaves out: model, the checkpoint's generation_config.json values where it "
                 "sets any (temperature, top_p, top_k, min_p, repetition_penalty; as vLLM and transformers do), or "
                 "openai, the OpenAI API's (temperature 1, no truncation) (default: model)")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="redjax", description="LLM serving on JAX/Flax with a Redis Streams queue")
    sub = top.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="the whole stack on this machine: Redis, API + dashboard, workers")
    p.add_argument("--model", help="local Hugging Face model directory (default: the demo model)")
    p.add_argument("--redis", help="Redis URL (default: an embedded Redis)")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--workers", type=int, default=1,
                   help="worker processes, each pinned to its own share of this machine's cores and taking its "
                        "share of the KV memory fraction (default 1: one worker over all cores)")
    p.add_argument("--worker-restarts", type=int, default=3, metavar="N",
                   help="workers that crash while serving are started again, up to N times in 10 minutes "
                        "(default 3; 0: never, a crashed worker stays down)")
    p.add_argument("--served-model-name")
    p.add_argument("--sampling-defaults", choices=["model", "openai"], help=SAMPLING_HELP)
    _engine_flags(p)

    p = sub.add_parser("api", help="the OpenAI-compatible API alone")
    p.add_argument("--model", help="model directory (its tokenizer and config.json)")
    p.add_argument("--redis")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--served-model-name")
    p.add_argument("--sampling-defaults", choices=["model", "openai"], help=SAMPLING_HELP)
    p.add_argument("--dashboard", action="store_true", help="also mount the dashboard at /dashboard and /metrics")

    p = sub.add_parser("worker", help="one engine worker pulling from Redis")
    p.add_argument("--model")
    p.add_argument("--redis")
    p.add_argument("--name", help="worker name, unique in the fleet (default host-pid)")
    p.add_argument("--served-model-name")
    p.add_argument("--drain-timeout", type=float, dest="drain_timeout_s")
    p.add_argument("--backlog", type=int, help="requests held beyond --max-num-seqs, queued in the engine (default 16)")
    p.add_argument("--stream-interval-ms", type=float,
                   help="least time between two deltas of a stream, its first and last excepted (default 50; 0: every step)")
    _engine_flags(p)

    p = sub.add_parser("dashboard", help="the dashboard alone")
    p.add_argument("--redis")
    p.add_argument("--host")
    p.add_argument("--port", type=int)

    p = sub.add_parser("generate", help="offline generation through the engine (no Redis)")
    p.add_argument("--model")
    p.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, in order")
    _engine_flags(p)

    p = sub.add_parser("bench", help="benchmarks: the offline engine, a serving endpoint, the stack against the engine, "
                                     "one layer's decode attention, or a compiled step's launch")
    p.add_argument("mode", choices=["offline", "serve", "stack", "attention", "launch"],
                   help="offline: engine throughput (--compare hf: against transformers); serve: a load generator "
                        "against any OpenAI-compatible URL; stack: serving against offline, alternating; attention: "
                        "one layer's decode attention; launch: what a step's launch costs")
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="...",
                   help="the mode's own options: redjax bench MODE --help")
    return top


def main(argv: list[str] | None = None) -> int:
    quiet_missing_torch_notice()
    args = parser().parse_args(argv)
    if args.command in ("worker", "generate", "bench"):  # before JAX is imported (see host_memory.py)
        from worker.host_memory import retain_freed_memory

        retain_freed_memory()
    return {
        "serve": cmd_serve, "api": cmd_api, "worker": cmd_worker, "dashboard": cmd_dashboard,
        "generate": cmd_generate, "bench": cmd_bench,
    }[args.command](args) or 0


def cmd_generate(args) -> int:
    from tqdm import tqdm

    from worker.engine.attention_choice import AttentionUnavailable
    from worker.engine.config import EngineConfig
    from worker.engine.llm import LLM
    from worker.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
    except ValueError as exc:
        sys.exit(f"redjax generate: {exc}")
    try:
        config = EngineConfig(**_engine_overrides(args))
    except ValueError as exc:
        usage_error("generate", str(exc))
    try:
        llm = LLM(resolve_model(args.model), config)
    except AttentionUnavailable as exc:
        usage_error("generate", str(exc))
    bar = tqdm(total=len(args.prompt), desc="generating", unit="prompt", file=sys.stderr,
               disable=len(args.prompt) < 8 or not sys.stderr.isatty())
    results = llm.generate(args.prompt, params, progress=lambda done, total: bar.update(1))
    bar.close()
    for r in results:
        c = r.outputs[0]
        if args.json:
            print(json.dumps({"prompt": r.prompt, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason, "prompt_tokens": len(r.prompt_token_ids)}))
        else:
            print(f"{r.prompt}{c.text}\n[{c.finish_reason}, {len(c.token_ids)} tokens]")
    return 0


def quiet_missing_torch_notice() -> None:
    """transformers warns at import that without PyTorch "Models won't be available". redjax takes only
    its tokenizers and configs and runs the models in JAX (torch is a test reference, the dev extra),
    so on a serving install that line is noise that reads like a failure. Dropped by a filter on
    transformers' logger, installed before transformers is imported; its other warnings stay."""
    import logging

    logging.getLogger("transformers").addFilter(_not_the_missing_torch_notice)  # once: the same filter is kept once


def _not_the_missing_torch_notice(record) -> bool:
    return "PyTorch was not found" not in record.getMessage()


def log_to_stderr(level: str) -> None:
    """Timestamped logging to stderr at `level` (jax's own loggers stay at warning or above)."""
    import logging

    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(max(logging.WARNING, logging.getLogger().level))  # backend probing chatter


def cmd_worker(args) -> int:
    import redis

    from worker.engine.attention_choice import AttentionUnavailable
    from worker.engine.llm_engine import LLMEngine
    from worker.service.loading_beat import LoadingBeat
    from worker.service.worker import Worker

    overrides = {"model_dir": args.model and resolve_model(args.model), "redis_url": args.redis, "name": args.name,
                 "served_model_name": args.served_model_name, "drain_timeout_s": args.drain_timeout_s,
                 "backlog": args.backlog, "stream_interval_ms": args.stream_interval_ms,
                 "engine": _engine_overrides(args)}
    import os

    if not overrides["model_dir"] and not os.environ.get("REDJAX_MODEL_DIR"):
        overrides["model_dir"] = resolve_model(None)
    config = worker_config("worker", overrides)
    log_to_stderr(config.log_level)
    if config.compile_cache_dir:
        import jax

        jax.config.update("jax_compilation_cache_dir", config.compile_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    client = redis.Redis.from_url(config.redis_url)
    try:
        with LoadingBeat(config, client):  # in the fleet as "starting" while the weights load
            engine = LLMEngine.from_path(config.model_dir, config.engine)
    except AttentionUnavailable as exc:
        usage_error("worker", str(exc))
    return Worker(config, engine, client).run()


def cmd_api(args) -> int:
    import os

    from api.config import ApiConfig
    from api.server import run_api

    model = args.model or os.environ.get("REDJAX_MODEL_DIR") or None
    config = ApiConfig.from_env({"model_dir": resolve_model(model), "redis_url": args.redis, "host": args.host,
                                 "port": args.port, "served_model_name": args.served_model_name,
                                 "sampling_defaults": args.sampling_defaults})
    mounts = _dashboard_mounts(config.redis_url, config.api_key) if args.dashboard else ()
    run_api(config, mounts=mounts)
    return 0


def cmd_dashboard(args) -> int:
    from dashboard.config import DashboardConfig
    from dashboard.server import run_dashboard

    run_dashboard(DashboardConfig.from_flags({"redis_url": args.redis, "host": args.host, "port": args.port}))
    return 0


def cmd_serve(args) -> int:
    from worker.service.cores import kv_share
    from worker.service.stack import serve

    import os

    model_dir = resolve_model(args.model or os.environ.get("REDJAX_MODEL_DIR"))
    overrides = _engine_overrides(args)
    if args.workers < 1:
        usage_error("serve", "--workers must be at least 1")
    if args.worker_restarts < 0:
        usage_error("serve", "--worker-restarts must be at least 0")
    engine = worker_config("serve", {"model_dir": model_dir, "engine": overrides}).engine  # what workers will build
    return serve(args, model_dir, kv_share(overrides, args.workers, engine))


def cmd_bench(args) -> int:
    from worker.bench.cli import run

    return run(args.mode, args.rest)


def _dashboard_mounts(redis_url: str, api_key: str | None):
    from starlette.routing import Mount

    from dashboard import DashboardConfig, create_dashboard, metrics_route

    cfg = DashboardConfig.from_flags({"redis_url": redis_url, "api_key": api_key})
    return [Mount("/dashboard", create_dashboard(cfg)), metrics_route(cfg)]


if __name__ == "__main__":
    sys.exit(main())
