"""EngineConfig: the one frozen object that sizes an engine. Host side: no JAX import."""

from __future__ import annotations

from dataclasses import dataclass, replace

# Tokens per KV page when not configured: on the CPU backend longer pages keep each sequence's K/V
# in longer contiguous runs (the decode kernel streams them; measured 94 -> 76 ms per llama-100m
# decode step going from 16 to 64); accelerators keep the finer page of vLLM.
DEFAULT_PAGE_SIZE = {"cpu": 64}
ACCELERATOR_PAGE_SIZE = 16
# Fused decode steps of an engine whose decode_steps is auto, until its warm-up has timed a step
# (LLMEngine.calibrate_decode_steps), and the most auto ever picks.
DEFAULT_DECODE_STEPS = 8
MAX_AUTO_DECODE_STEPS = 16
MAX_SPECULATIVE_TOKENS = 16  # draft tokens per sequence and step at most


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 64  # sequences in one step at most
    max_num_batched_tokens: int = 1024  # tokens (prefill chunks + decodes) in one step at most
    page_size: int | None = None  # tokens per KV page; None: 64 on the CPU backend, 16 on accelerators
    num_pages: int | None = None  # KV pages per layer; None: derived from kv_cache_memory_fraction
    kv_cache_memory_fraction: float = 0.5  # share of free device (or host) memory given to KV pages
    max_model_len: int | None = None  # context limit; None: the model's max_position_embeddings
    enable_prefix_cache: bool = True  # reuse full prompt pages across requests (and n > 1 choices)
    decode_steps: int | None = None  # decode steps fused in one jitted call when no prefill is pending;
    # None: auto, as many as one call runs in decode_window_ms at a full batch (timed at warm-up)
    decode_window_ms: float = 100.0  # auto decode_steps: how long one fused call should take at most. A
    # request that arrives during a call waits for its end, and streams get their text this far apart;
    # 100 ms is about where a pause starts to be noticed. At light load (1-8 streams decoding, at most
    # one request waiting) a step also takes only the prompt tokens that run in about this long
    # (Scheduler.prompt_cap, timed by the engine)
    async_overlap: bool | None = None  # dispatch step k+1 before reading back step k. None: on accelerators
    # (and with speculation) always; on the CPU only while a request arriving now could not start at the
    # next step anyway (every sequence slot taken, or requests waiting). There the "device" is the host's
    # own cores, so the read-back hidden behind the next step is worth little (llama-100m: none measured
    # at 64 rows, sessions 63 and 77), while the step dispatched ahead is one more call a new arrival
    # waits for: served llama-100m at 1-4 Poisson requests/s gave p50 TTFT 10-58 ms longer (session 77)
    launch_thread: bool | None = None  # launch each step's jitted call from a helper thread, while the
    # engine thread reads back the step before and schedules the next; None: on accelerators, off on the
    # CPU. On an H200 the launch held the engine thread 4.4-7.8 ms a call (sessions 42, 46); on the thread,
    # 128/128's host share went 15 -> 6 % and batch 1's 11 -> 3 % (session 46). A CPU launch is ~0.3 ms
    min_decode_rows: int | None = None  # a decode step's rows are padded to a power of two at least this
    # (a compiled variant per rung). None: 1 on the CPU, where a step reads its weights from memory and
    # padded rows' products held batch 1-4 of llama-100m 9-23 % slower (session 68); 8 on accelerators,
    # where padding rows is free and each rung is another 25-60 s compile at warm-up
    max_logprobs: int = 20  # top-N alternatives computed on device
    dtype: str | None = None  # compute/param dtype override ("float32", "bfloat16"); None: checkpoint's
    kv_cache_dtype: str | None = None  # KV page dtype ("float32", "bfloat16", "int8"); None: the compute dtype.
    # bfloat16 pages with float32 compute: half the KV memory and traffic, attention inputs rounded;
    # int8: a quarter, each token's key and value by its own scale per KV head (kv_quant.py)
    quantization: str | None = None  # "int8": every layer's projections int8, weights quantized at load
    # by output column and activations at run time by token (W8A8, torchao's int8 dynamic scheme;
    # int8_linear.py); "int4": weights in 4 bits by groups of inputs, activations int8 by token with a
    # zero point (W4A8, torchao's 8da4w; int4_linear.py); the LM head and embeddings stay in the
    # model's dtype. None: off
    seed: int = 0  # seed for requests that carry none (offline API)
    tensor_parallel: int = 1  # devices one model spans (heads and MLP columns split over a mesh)
    attention: str = "auto"  # paged attention of decode and prefill rows: "auto": the compiled CPU kernel
    # on the CPU backend if it builds, the Pallas decode kernel on a GPU if it compiles there, else jnp;
    # "kernel" / "pallas": that kernel or an error; "jnp": pure jax.numpy (attention_choice.py)
    matmul: str = "auto"  # the projections and LM head: "auto": the compiled CPU panel kernel (weights
    # packed at startup) for a float32 model on the CPU backend of an AVX-512 CPU if it builds, else
    # XLA's dot; "kernel": that kernel or an error; "xla": XLA's dot
    greedy_head: str = "auto"  # greedy and plain sampled rows (no logprobs, penalties, bias, top-k, top-p
    # or min-p): "auto": a float32 model's head as an int8 product (AVX512-VNNI), else a bfloat16 one
    # (AVX512-BF16), screened for the float32 argmax or Gumbel-max draw (screened_head.py; the same
    # tokens) where the matmul kernel runs, else the float32 head; "screened": that or an error;
    # "screened-int8", "screened-bf16": that approximation or an error; "full": always the float32 head
    compile_threads: int | None = None  # step variants warm-up compiles at once (LLMEngine.compile_ahead),
    # and at most as many compiled in the background while serving; None: half the host's cores, at
    # most 8; 1: one after another
    sampler: str = "auto"  # sampled rows' top-k/top-p cutoffs and draws: "auto": the compiled CPU kernels
    # on the CPU backend of one device if they build, else jnp (bisections for the cut and hashed Gumbel
    # noise: fast on accelerators, slower on XLA's CPU backend); "kernel": those or an error; "jnp";
    # both keep the same tokens and draw the same ones for a seed
    pallas_tuning: str | None = None  # the Pallas decode kernel's work split, "PAGES:PROGRAMS:WARPS:STAGES"
    # (pages read per loop iteration, programs to aim for, Triton's warps and stages; gpu_attention.Tuning);
    # None: its defaults. `redjax bench attention` times settings on the GPU at hand
    pallas_prefill: bool | None = None  # prefill rows through the Pallas prefill kernel (gpu_prefill.py) instead
    # of the reference, with the Pallas decode kernel only. None: where it compiles (3.0x the reference's
    # attention on an H200, session 34); True: it or an error; False: the reference
    speculative_tokens: int = 0  # prompt-lookup speculation: a decode row may carry up to this many draft
    # tokens, the ones that followed the latest earlier match of its last tokens (speculation.py), all
    # checked in the same step; the same tokens as without, more of them a step where text repeats. Drafts
    # use rows the step has spare (a full batch gets none, and runs as without). Steps still overlap: the
    # next step's lookup takes the drafts in flight to stand. A decode batch that could fuse decode_steps
    # takes drafts only where they gave more tokens a second than fused steps (draft_gate.py). 0: off

    def __post_init__(self) -> None:
        checks = {
            "max_num_seqs must be >= 1": self.max_num_seqs >= 1,
            "max_num_batched_tokens must be >= max_num_seqs": self.max_num_batched_tokens >= self.max_num_seqs,
            "page_size must be a power of two in [1, 256]": self.page_size is None or self.page_size in {2**i for i in range(9)},
            "num_pages must be >= 2": self.num_pages is None or self.num_pages >= 2,
            "kv_cache_memory_fraction must be in (0, 1)": 0.0 < self.kv_cache_memory_fraction < 1.0,
            "max_model_len must be >= 1": self.max_model_len is None or self.max_model_len >= 1,
            "decode_steps must be >= 1": self.decode_steps is None or self.decode_steps >= 1,
            "min_decode_rows must be a power of two in [1, 64]":
                self.min_decode_rows is None or self.min_decode_rows in {2**i for i in range(7)},
            "decode_window_ms must be > 0": self.decode_window_ms > 0,
            "dtype must be float32 or bfloat16": self.dtype in (None, "float32", "bfloat16"),
            "kv_cache_dtype must be float32, bfloat16 or int8": self.kv_cache_dtype in (None, "float32", "bfloat16", "int8"),
            "quantization must be int8, int4 or None": self.quantization in (None, "int8", "int4"),
            "tensor_parallel must be >= 1": self.tensor_parallel >= 1,
            f"speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}]":
                0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS,
            "compile_threads must be >= 1": self.compile_threads is None or self.compile_threads >= 1,
            "attention must be auto, kernel, pallas or jnp": self.attention in ("auto", "kernel", "pallas", "jnp"),
            "matmul must be auto, kernel or xla": self.matmul in ("auto", "kernel", "xla"),
            "greedy_head must be auto, screened, screened-int8, screened-bf16 or full":
                self.greedy_head in ("auto", "screened", "screened-int8", "screened-bf16", "full"),
            "sampler must be auto, kernel or jnp": self.sampler in ("auto", "kernel", "jnp"),
            "pallas_tuning must be PAGES:PROGRAMS:WARPS:STAGES, positive integers, warps a power of two":
                self.pallas_tuning is None or parse_tuning(self.pallas_tuning) is not None,
        }
        for message, ok in checks.items():
            if not ok:
                raise ValueError(message)

    def tuning(self) -> tuple[int, int, int, int] | None:
        """pallas_tuning as numbers (None: the kernel's defaults)."""
        return None if self.pallas_tuning is None else parse_tuning(self.pallas_tuning)

    def for_backend(self, backend: str) -> "EngineConfig":
        """This config with the defaults that depend on the JAX backend ("cpu", "gpu", ...) filled in."""
        page_size = self.page_size or DEFAULT_PAGE_SIZE.get(backend, ACCELERATOR_PAGE_SIZE)
        launch_thread = backend != "cpu" if self.launch_thread is None else self.launch_thread
        min_rows = self.min_decode_rows or (1 if backend == "cpu" else 8)
        overlap = self.async_overlap
        if overlap is None and (backend != "cpu" or self.speculative_tokens):
            overlap = True  # (speculation: a step's drafts are looked up past the guess that the last ones stand)
        return replace(self, page_size=page_size, launch_thread=launch_thread, min_decode_rows=min_rows,
                       async_overlap=overlap)

    def fused_steps_for(self, step_s: float) -> int:
        """Auto decode_steps for a full-batch decode step of `step_s` seconds: as many as fit in the
        window, at least 1, at most MAX_AUTO_DECODE_STEPS."""
        fit = int(self.decode_window_ms / 1000.0 / step_s) if step_s > 0 else MAX_AUTO_DECODE_STEPS
        return max(1, min(MAX_AUTO_DECODE_STEPS, fit))

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)


def parse_tuning(text: str) -> tuple[int, int, int, int] | None:
    """"4:2048:4:2" -> (4, 2048, 4, 2); None if malformed."""
    try:
        values = tuple(int(x) for x in text.split(":"))
    except ValueError:
        return None
    if len(values) != 4 or min(values) < 1 or values[2] & (values[2] - 1):
        return None
    return values  # type: ignore[return-value]
