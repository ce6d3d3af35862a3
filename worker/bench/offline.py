"""`redjax bench offline`: random prompts (token ids) of fixed lengths, of lengths drawn around
them (`--range-ratio`), or a file's prompts, all submitted at once to one LLMEngine.

Reports throughput, the host's share of each step (`probe.py`), roofline fractions against this
machine's measured bandwidth and matmul speed (`roofline.py`), and optionally the same prompts
through Hugging Face transformers (`hf_baseline.py`) on the same weights.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from worker.bench import cpu_usage, roofline
from worker.bench.barrier import Barrier
from worker.bench.probe import StepProbe
from worker.bench.prompts import draw_lengths
from worker.bench.tokenizer import IdTokenizer
from worker.engine import gpu_prefill, projections
from worker.engine.batch import sampler_flags
from worker.engine.config import EngineConfig
from worker.engine.kv_cache import RESERVED_PAGES
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.heap import freeze_startup_heap
from worker.host_memory import loading
from worker.models.config import ModelConfig
from worker.models.loader import DTYPES, build_model, load_model, load_tokenizer, save_checkpoint

log = logging.getLogger(__name__)


class WorkloadError(ValueError):
    """A workload this engine cannot run as asked (a request past the model's length or vocabulary)."""


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    seed: int = 0
    temperature: float = 0.0  # 0: greedy (outputs comparable with the baseline's token for token)
    top_p: float = 1.0
    top_k: int = 0
    range_ratio: float = 0.0  # 0: every request input_len in, output_len out
    # a file's requests: each one's token ids and output length (input_len and range_ratio unused)
    requests: tuple[tuple[tuple[int, ...], int], ...] | None = None
    prompts_file: str | None = None  # where `requests` came from (the report's label)
    prefix_len: int = 0  # random prompts: ids shared by all of a round, before each one's input_len
    logprobs: int | None = None  # every request's logprobs (the sampled token's and this many alternatives)
    options_every: int = 1  # top_p, logprobs, prompt logprobs and penalties on every N-th request only, the rest without: mixed traffic
    frequency_penalty: float = 0.0  # OpenAI's (0: none)
    presence_penalty: float = 0.0
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs and this many alternatives (echo, as lm-eval asks)

    def params(self, max_tokens: int, seed: int) -> SamplingParams:
        """Request number `seed`'s sampling."""
        chosen = seed % self.options_every == 0
        return SamplingParams(temperature=self.temperature, top_p=self.top_p if chosen else 1.0, top_k=self.top_k,
                              max_tokens=max_tokens, ignore_eos=True, seed=seed, logprobs=self.logprobs if chosen else None,
                              frequency_penalty=self.frequency_penalty if chosen else 0.0,
                              presence_penalty=self.presence_penalty if chosen else 0.0,
                              prompt_logprobs=self.prompt_logprobs if chosen else None)

    @cached_property
    def sizes(self) -> list[tuple[int, int]]:
        """Each request's (input, output) length: the file's, or drawn once from the workload's
        seed; every round (and the warm-up's plan) has the same lengths."""
        if self.requests is not None:
            return [(len(ids), out) for ids, out in self.requests]
        drawn = draw_lengths(self.num_prompts, self.input_len, self.output_len, self.range_ratio, self.seed)
        return [(self.prefix_len + i, o) for i, o in drawn]

    @property
    def output_lens(self) -> list[int]:
        return [out for _, out in self.sizes]

    @property
    def longest(self) -> int:
        """The most tokens one request holds: its prompt and its whole output."""
        return max(i + o for i, o in self.sizes)

    def round_prompts(self, vocab_size: int, r: int) -> list[list[int]]:
        """Round r's prompts: the file's (the same every round), or fresh random ids (round 0: the
        workload's own seed)."""
        return self.like_prompts(vocab_size, seed=self.seed + 1000 * r)

    def like_prompts(self, vocab_size: int, seed: int) -> list[list[int]]:
        """Prompts that run as a round runs: the file's own (what they share, the prefix cache serves
        in the same places), or random ids of a round's lengths and shared prefix from `seed`."""
        if self.requests is not None:
            return [list(ids) for ids, _ in self.requests]
        return self.prompts(vocab_size, seed=seed)

    def check(self, vocab_size: int, max_model_len: int) -> None:
        """WorkloadError unless every request fits the engine: its prompt and whole output within
        max_model_len (the engine would stop it short, the baseline would not), its ids in the vocabulary."""
        for i, (n, out) in enumerate(self.sizes):
            if n == 0:
                raise WorkloadError(f"request {i}: the prompt has no tokens")
            if n + out > max_model_len:
                raise WorkloadError(f"request {i}: {n} prompt + {out} output tokens; the engine allows {max_model_len} "
                                    "(--max-model-len, up to the model's)")
        top = max((max(ids) for ids, _ in self.requests or ()), default=0)
        if top >= vocab_size:
            raise WorkloadError(f"the prompts hold token id {top}; the model's vocabulary has {vocab_size} "
                                "(is the tokenizer the model's?)")

    def prompts(self, vocab_size: int, seed: int | None = None, lengths: list[int] | None = None) -> list[list[int]]:
        """Random token ids (uniform over the vocabulary) of each request's input length, or of
        `lengths`; the first prefix_len of each are the same in all."""
        rng = np.random.default_rng(self.seed if seed is None else seed)
        lengths = lengths or [n for n, _ in self.sizes]
        prefix = rng.integers(0, vocab_size, min([self.prefix_len, *lengths])).tolist()
        return [prefix + rng.integers(0, vocab_size, n - len(prefix)).tolist() for n in lengths]


def make_engine(model_dir: str | None, preset: str | None, overrides: dict, work: Workload,
                save_to: Path | None = None):
    """-> (engine, directory with the weights for transformers, or None if they exist only in memory).
    Dummy weights are written to `save_to` if given, before the engine packs them for its kernels."""
    t0 = time.perf_counter()
    with loading():  # what making the model frees goes back to the OS (host_memory.py)
        engine, path = _engine(model_dir, preset, overrides, work, save_to)
    log.info("model and engine ready in %.1f s (%s KV pages)", time.perf_counter() - t0, engine.config.num_pages)
    return engine, path


def _engine(model_dir: str | None, preset: str | None, overrides: dict, work: Workload, save_to: Path | None):
    """make_engine's work: -> (engine, weights directory or None)."""
    config = EngineConfig(**overrides).for_backend(jax.default_backend())
    if preset:
        cfg = ModelConfig.preset(preset)
        # quantized as it is made, unless transformers needs the float weights written first (or the
        # engine shards the weights over devices before it quantizes them)
        project, head = projections.load_forms(config, cfg) if save_to is None and config.tensor_parallel == 1 else (None, None)
        model, tokenizer, path = build_model(cfg, config.dtype, 0, project, head), IdTokenizer(cfg.vocab_size), None
        if save_to is not None:
            save_checkpoint(model, save_to, overrides.get("dtype"))
            path = save_to
    else:
        cfg = ModelConfig.from_dir(model_dir)
        project, head = projections.load_forms(config, cfg) if config.tensor_parallel == 1 else (None, None)
        model, path = load_model(model_dir, config.dtype, None, project, head), model_dir
        try:
            tokenizer = load_tokenizer(model_dir)
        except FileNotFoundError:
            tokenizer = IdTokenizer(model.cfg.vocab_size)
    if "num_pages" not in overrides:  # enough for every sequence that can run at once, no more
        page_size = config.page_size
        per_seq = -(-work.longest // page_size)
        running = min(work.num_prompts, overrides.get("max_num_seqs", 64))
        overrides = {**overrides, "num_pages": running * per_seq + RESERVED_PAGES}
    return LLMEngine(model, tokenizer, EngineConfig(**overrides)), path


def run_engine(engine: LLMEngine, prompts: list[list[int]], output_len: int | list[int],
               probe: StepProbe | None = None, tag: str = "bench",
               work: Workload | None = None) -> tuple[float, list[list[int]]]:
    """Submit every prompt at once and step until all finish; -> (seconds, output ids per prompt).
    `output_len`: one for all, or each prompt's. Greedy unless `work` says how to sample (request i
    then has seed i)."""
    t0 = time.perf_counter()
    outputs = submit(engine, prompts, output_len, work, tag)
    while engine.has_unfinished():
        for out in probe.step(engine) if probe else engine.step():
            outputs[out.request_id] += out.token_ids
    return time.perf_counter() - t0, list(outputs.values())


def submit(engine: LLMEngine, prompts: list[list[int]], output_len: int | list[int], work: Workload | None,
           tag: str) -> dict[str, list[int]]:
    """Add every prompt as a request -> an empty output list per request id, in prompt order."""
    lens = [output_len] * len(prompts) if isinstance(output_len, int) else output_len
    work = work or Workload(len(prompts), 0, max(lens, default=0))
    outputs: dict[str, list[int]] = {}
    for i, (ids, n) in enumerate(zip(prompts, lens, strict=True)):
        outputs[f"{tag}-{i}"] = []
        engine.add_request(f"{tag}-{i}", ids, work.params(n, i))
    return outputs


def warmup(engine: LLMEngine, work: Workload, vocab: int) -> None:
    """Compile what the run will use: the same prefill batches, then decode at the longest context
    (one long prompt among short ones sets the page-table width). Shapes missed here show up as
    `compiles_during_run`."""
    # outputs long enough that the first sequences still decode while the last prompts prefill (the
    # run's mixed shapes), and past two fused windows
    budget = engine.config.max_num_batched_tokens
    inputs = [n for n, _ in work.sizes]
    prefill_steps = -(-sum(inputs[:engine.config.max_num_seqs]) // budget)
    short = min(max(work.output_lens), max(2 * engine.decode_steps, prefill_steps) + 2)
    engine.allocator.uncache(engine.allocator.cache_entries())  # from where a round starts
    run_engine(engine, work.like_prompts(vocab, seed=work.seed + 1), short, tag="warm-a", work=work)
    long = work.longest - short
    if long > max(inputs):
        lengths = inputs[:-1] + [long]
        run_engine(engine, work.prompts(vocab, seed=work.seed + 2, lengths=lengths), short, tag="warm-b", work=work)


def bench_offline(model_dir: str | None, preset: str | None, overrides: dict, work: Workload,
                  compare_hf: bool = False, hf_batch_size: int | None = None, rounds: int = 1,
                  profile: tuple[str, int] | None = None, barrier: Barrier | None = None) -> dict:
    """Run the workload `rounds` times (each round on fresh prompts from an empty prefix cache, which
    serves only what the round's prompts share), with --compare hf transformers right after each
    round on the same prompts.
    Throughputs are medians over rounds and the ratio the median of the per-round ratios: on a
    shared VM a neighbour's burst then moves one round, not the answer. `profile` (directory,
    calls): one more round afterwards, with that many of its steady decode calls traced (profile.py).
    `barrier`: this process is one of a data-parallel run's, whose timed rounds start and end
    together (barrier.py); the CPU figures then cover all of them."""
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    with tempfile.TemporaryDirectory(prefix="redjax-bench-") as tmp:
        # dummy weights: written once so transformers reads the same tensors
        save_to = Path(tmp) / "model" if compare_hf and preset else None
        engine, weights_dir = make_engine(model_dir, preset, overrides, work, save_to)
        work.check(engine.model_config.vocab_size, engine.max_model_len)
        report, probe = _bench(engine, weights_dir, model_dir, preset, work, compare_hf, hf_batch_size, rounds,
                               barrier)
        if profile:
            from worker.bench.profile import profile_decode

            engine.allocator.uncache(engine.allocator.cache_entries())
            prompts = work.round_prompts(engine.model_config.vocab_size, rounds)
            try:
                report["profile"] = profile_decode(engine, probe, prompts, work.output_lens, work, *profile)
            except WorkloadError:
                raise
            except Exception as exc:  # noqa: BLE001: the timed figures stand without a trace (a GPU call's worth)
                log.warning("the profile failed: %s: %s", type(exc).__name__, exc)
                report["profile_error"] = f"{type(exc).__name__}: {exc}"
        return report


def _bench(engine: LLMEngine, weights_dir, model_dir, preset, work: Workload, compare_hf: bool, hf_batch_size: int | None,
           rounds: int, barrier: Barrier | None) -> tuple[dict, StepProbe]:
    cfg = engine.model_config
    dtype = engine.config.dtype or cfg.dtype
    itemsize = jnp.dtype(DTYPES[dtype]).itemsize
    engine.runner.compile_after = 1  # compile exactly the shapes the warmup meets: the run then reuses them
    t0 = time.perf_counter()
    engine.calibrate_decode_steps()  # as a worker's warm-up does
    t1 = time.perf_counter()
    def plan() -> None:  # the warm-up, then the run itself: its tail steps (the last rows' last
        # fused steps) take shapes the warm-up's shorter requests need not meet
        warmup(engine, work, cfg.vocab_size)
        engine.allocator.uncache(engine.allocator.cache_entries())
        run_engine(engine, work.like_prompts(cfg.vocab_size, seed=work.seed + 3), work.output_lens, tag="plan",
                   work=work)
        # speculation: a step's rows follow which drafts stand, which the plan's zeros do not foretell
        # (3 compiles in llama-100m's 8 x 128/128 timed round): every rung, as a worker's warm-up
        mixes = [[work.params(1, 0)], [work.params(1, 1)], [work.params(1, 0), work.params(1, 1)]]
        for flags in {sampler_flags(mix, engine.config.max_logprobs) for mix in mixes}:
            for shape in engine.speculation_shapes():
                engine.runner.precompile(shape, flags)

    ahead = engine.compile_ahead(plan)  # their variants, compiled together
    t2 = time.perf_counter()
    warmup(engine, work, cfg.vocab_size)
    startup = {"calibration_s": t1 - t0, "compile_ahead_s": t2 - t1, "variants_compiled_ahead": ahead,
               "warmup_s": time.perf_counter() - t2}
    log.info("calibration %.1f s, compiles %.1f s (%d step variants planned and compiled), warm-up %.1f s",
             *startup.values())
    freeze_startup_heap()  # as a worker does after its warm-up (and the baseline runs after it too)
    compiled = len(engine.runner.compiled) + len(engine.runner.ready)
    probe = StepProbe().install(engine)
    engines = barrier.meet("start") if barrier else [os.getpid()]  # the processes whose CPU the figures count
    per_round: list[dict] = []
    first_trials: dict[int, float] = {}  # transformers output tokens/s by batch size, first round
    for r in range(rounds):
        prompts = work.round_prompts(cfg.vocab_size, r)
        # each round from an empty prefix cache: a file's prompts repeat, and the warm-up ran them before
        engine.allocator.uncache(engine.allocator.cache_entries())
        before, hits = cpu_usage.take({"engine": engines}), engine.scheduler.num_hit_tokens
        drafted, stood = engine.num_draft_tokens, engine.num_accepted_tokens
        seconds, outputs = run_engine(engine, prompts, work.output_lens, probe, work=work)
        cpu = cpu_usage.between(before, cpu_usage.take({"engine": engines}))
        out_tokens = sum(len(o) for o in outputs)
        log.info("round %d: %d output tokens in %.2f s", r, out_tokens, seconds)
        fig = {"seconds": seconds, "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / seconds,
               "total_tokens_per_s": (sum(map(len, prompts)) + out_tokens) / seconds, "cpu": cpu,
               # prompt tokens the prefix cache served (a file's repeated prompts within the round)
               "prefix_cache_hit_tokens": engine.scheduler.num_hit_tokens - hits,
               # speculation: draft tokens the steps checked, and those the model's draws confirmed
               "draft_tokens": engine.num_draft_tokens - drafted, "accepted_tokens": engine.num_accepted_tokens - stood}
        if compare_hf:
            sizes = [hf_batch_size] if hf_batch_size else auto_batch_sizes(work.num_prompts)
            hf_seconds, hf_outputs, hf_batch_size, trials = _fastest_baseline(weights_dir, prompts, work, dtype, sizes,
                                                                              engine.config.quantization)
            # torch and transformers stay imported: out of the collector's walks in the engine's next rounds,
            # as a worker, which never holds them, would be (a walk of them took ~50 ms a collection)
            freeze_startup_heap()
            if r == 0:
                first_trials = trials
            base = sum(len(o) for o in hf_outputs) / hf_seconds
            fig |= {"baseline_seconds": hf_seconds, "baseline_output_tokens_per_s": base,
                    "ratio": fig["output_tokens_per_s"] / base}
            if not work.temperature:  # sampled outputs differ by construction (other random streams)
                fig |= greedy_agreement(outputs, hf_outputs)
        per_round.append(fig)
    if barrier:
        barrier.meet("end")  # none goes on to the machine probes while another still times its rounds
    median = lambda key: float(np.median([f[key] for f in per_round]))  # noqa: E731
    seconds = median("seconds")
    report = {
        "model": preset or str(model_dir), "dtype": dtype, "num_params": cfg.num_params,
        "num_prompts": work.num_prompts, "input_len": work.input_len, "output_len": work.output_len,
        "range_ratio": work.range_ratio, "prompts_file": work.prompts_file, "prefix_len": work.prefix_len,
        "prompt_tokens": sum(i for i, _ in work.sizes),
        "mean_input_len": float(np.mean([i for i, _ in work.sizes])), "mean_output_len": float(np.mean(work.output_lens)),
        "sampling": {"temperature": work.temperature, "top_p": work.top_p, "top_k": work.top_k,
                     "logprobs": work.logprobs, "options_every": work.options_every,
                     "frequency_penalty": work.frequency_penalty, "presence_penalty": work.presence_penalty,
                     "prompt_logprobs": work.prompt_logprobs},
        "sampler": engine.sampler,
        "engine": {k: v for k, v in vars(engine.config).items()}, "attention": engine.attention,
        "pallas_prefill_kernel": engine.runner.attention.prefill is gpu_prefill.pallas_prefill_attention,
        "matmul": engine.matmul, "quantization": engine.quantization, "greedy_head": engine.greedy_head,
        "decode_steps": engine.decode_steps,
        "rounds": rounds, "seconds": seconds, "output_tokens": per_round[0]["output_tokens"],
        "prefix_cache_hit_tokens": per_round[0]["prefix_cache_hit_tokens"],
        "draft_tokens": per_round[0]["draft_tokens"], "accepted_tokens": per_round[0]["accepted_tokens"],
        "requests_per_s": work.num_prompts / seconds, "output_tokens_per_s": median("output_tokens_per_s"),
        "total_tokens_per_s": median("total_tokens_per_s"),
        "compiles_during_run": len(engine.runner.compiled) + len(engine.runner.ready) - compiled,
        "startup": startup,  # before the measured run: seconds, and the variants compiled ahead
        "cpu": per_round[0]["cpu"],  # the first round's core-seconds by thread group, and idle
    }
    kv_itemsize = engine.runner.kv.bytes_per_element  # int8 pages: a byte and their scales' share
    report["kv_cache_dtype"] = str(engine.runner.kv.dtype)
    report |= _host_and_roofline(probe, cfg, itemsize, dtype, kv_itemsize, engine.quantization)
    if compare_hf:
        report |= {
            "baseline": f"transformers generate (torch {hf_baseline_device().upper()}, batch {hf_batch_size}"
                        + (f", torchao {engine.config.quantization} projections" if engine.config.quantization else "")
                        # transformers keeps its KV in the model's dtype: int8 pages are the engine's alone
                        + (f", {dtype} KV)" if report["kv_cache_dtype"] == "int8" else ")"),
            "baseline_batch_size": hf_batch_size, "baseline_batch_trials": first_trials,
            "baseline_seconds": median("baseline_seconds"),
            "baseline_output_tokens_per_s": median("baseline_output_tokens_per_s"), "ratio": median("ratio"),
        }
        if not work.temperature:
            report |= {key: min(f[key] for f in per_round) for key in per_round[0] if key.startswith("greedy_")}
        if report.get("roofline_fraction"):
            # transformers against the engine's roofline: how much of the machine the baseline uses,
            # and so the highest ratio this machine allows (the engine's calls all at the ideal)
            ideal_round_s = (report["ideal_decode_s"] + report["ideal_prefill_s"]) / rounds
            serial_round_s = (report["serial_decode_s"] + report["ideal_prefill_s"]) / rounds
            report |= {"baseline_roofline_fraction": ideal_round_s / report["baseline_seconds"],
                       "ratio_at_roofline": report["baseline_seconds"] / ideal_round_s,
                       "ratio_at_serial_roofline": report["baseline_seconds"] / serial_round_s}
    if rounds > 1:
        report["per_round"] = per_round
    return report, probe  # the probe: for a profiled round after this


def auto_batch_sizes(num_prompts: int) -> list[int]:
    """Batch sizes `--hf-batch-size auto` tries: 16, 32 and 64, none past the number of prompts.
    Which is fastest depends on the host (batch 32 on the AMD VM of sessions 1-12, 64 on the Intel
    one of session 13), so the baseline is measured at its best on the machine at hand."""
    return sorted({min(b, num_prompts) for b in (16, 32, 64)})


def greedy_agreement(outputs: list[list[int]], baseline: list[list[int]]) -> dict:
    """How far two engines' greedy tokens agree, prompt by prompt: the share identical throughout,
    the share whose first token is the same (the prompt's own logits: a wrong kernel or weight
    shows there), and the mean number of tokens before the first difference (random weights leave
    near ties that rounding splits sooner or later)."""
    common = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in zip(outputs, baseline)]
    n = len(common)
    return {"greedy_match_fraction": sum(a == b for a, b in zip(outputs, baseline)) / n,
            "greedy_first_token_match_fraction": sum(c > 0 for c in common) / n,
            "greedy_mean_common_tokens": float(np.mean(common))}


def _fastest_baseline(weights_dir, prompts, work: Workload, dtype: str, sizes: list[int], quantization: str | None):
    """transformers on `prompts` at each batch size (quantized as the engine is) -> (seconds, outputs,
    size) of the fastest, and {size: output tokens/s} of every size tried."""
    best, trials = None, {}
    for size in sizes:
        seconds, outputs = run_hf_baseline(weights_dir, prompts, work.output_lens, size, dtype, work.temperature,
                                           work.top_p, work.top_k, work.logprobs, quantization)
        trials[size] = sum(len(o) for o in outputs) / seconds
        if best is None or seconds < best[0]:
            best = (seconds, outputs, size)
    return (*best, trials)


def run_hf_baseline(*args, **kwargs):
    from worker.bench.hf_baseline import run_hf

    return run_hf(*args, **kwargs)


def hf_baseline_device() -> str:
    from worker.bench.hf_baseline import hf_device

    return hf_device()


def _host_and_roofline(probe: StepProbe, cfg: ModelConfig, itemsize: int, dtype: str, kv_itemsize: float,
                       quantization: str | None = None) -> dict:
    """The machine's probes and the run against its roofline. With quantized projections
    (`quantization` "int8 (kernel)", "int4 (xla)"...) their weights count a byte each (int4: half a
    byte and the scales) and their products run at that scheme's probe's speed; the LM head and
    attention keep the model dtype's."""
    t0 = time.perf_counter()
    bandwidth = roofline.memory_bandwidth_gbs()
    xla = roofline.matmul_gflops(dtype=DTYPES[dtype])
    kernel = roofline.kernel_matmul_gflops(dtype=DTYPES[dtype])
    gflops = max(xla, kernel or 0.0)  # the machine's best measured product is the ceiling
    int8 = roofline.int8_matmul_gflops("kernel" in quantization, scheme=quantization.split()[0]) if quantization else None
    projection_itemsize = roofline.quantized_itemsize(quantization, cfg)
    log.info("machine probes: %.0f GB/s, %.0f GFLOP/s (%.1f s)", bandwidth, gflops, time.perf_counter() - t0)
    d, p = probe.decode, probe.prefill
    out: dict = {"device_name": roofline.device_name(), "memory_bandwidth_gbs": bandwidth, "matmul_gflops": gflops,
                 # (the quantized projections' probe, int4's too: the key kept from when int8 was the only one)
                 "matmul_gflops_xla": xla, "matmul_gflops_kernel": kernel, "matmul_gflops_int8": int8,
                 "decode_phase": d.as_dict(), "prefill_phase": p.as_dict()}
    if d.decode_steps:
        batch, context = d.batch_rows / d.decode_steps, d.context_tokens / max(d.batch_rows, 1)
        unique = (d.context_tokens - d.shared_tokens) / max(d.batch_rows, 1)  # shared prefix pages read once
        step_s = d.wall_s / d.decode_steps
        memory = roofline.decode_step_bytes(cfg, itemsize, batch, unique, kv_itemsize, projection_itemsize) / (bandwidth * 1e9)
        compute = (roofline.product_s(cfg, batch, gflops, int8)
                   + batch * roofline.attention_flops(cfg, context) / (gflops * 1e9))
        ideal = max(memory, compute)
        # never below the overlapped ideal (so in real numbers; the two sums round differently, and a
        # CI run met the serial one an ulp below)
        serial = max(ideal, roofline.decode_serial_step_s(cfg, itemsize, kv_itemsize, batch, context, unique,
                                                          bandwidth, gflops, projection_itemsize, int8))
        out |= {"decode_step_ms": step_s * 1e3, "decode_mean_batch": batch, "decode_mean_context": context,
                "decode_shared_kv_fraction": d.shared_tokens / max(d.context_tokens, 1.0),
                "decode_memory_step_ms": memory * 1e3, "decode_compute_step_ms": compute * 1e3,
                "decode_ideal_step_ms": ideal * 1e3, "decode_roofline_fraction": ideal / step_s,
                "decode_serial_step_ms": serial * 1e3, "decode_serial_fraction": serial / step_s,
                "decode_host_fraction": d.host_s / d.wall_s}
    if p.prefill_tokens:
        per_token = p.wall_s / p.prefill_tokens
        context = p.context_tokens / p.prefill_tokens
        ideal = roofline.prefill_token_s(cfg, context, gflops, int8)
        out |= {"prefill_token_us": per_token * 1e6, "prefill_ideal_token_us": ideal * 1e6, "prefill_mean_context": context,
                "prefill_roofline_fraction": ideal / per_token, "prefill_host_fraction": p.host_s / p.wall_s}
    total = d.wall_s + p.wall_s
    out["host_fraction"] = (d.host_s + p.host_s) / total if total else 0.0
    # the whole run against its roofline: every decode step and prompt token at its ideal, over the
    # time the engine's calls took (issue 7's GPU target for 64 x 1024/1024)
    ideal_decode = out.get("decode_ideal_step_ms", 0.0) / 1e3 * d.decode_steps
    ideal_prefill = out.get("prefill_ideal_token_us", 0.0) / 1e6 * p.prefill_tokens
    serial_decode = out.get("decode_serial_step_ms", 0.0) / 1e3 * d.decode_steps
    if total:
        out |= {"ideal_decode_s": ideal_decode, "ideal_prefill_s": ideal_prefill, "measured_s": total,
                "roofline_fraction": (ideal_decode + ideal_prefill) / total,
                "serial_decode_s": serial_decode, "serial_roofline_fraction": (serial_decode + ideal_prefill) / total}
    return out
