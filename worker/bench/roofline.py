"""What this machine can do at best (copy bandwidth, matmul speed) and how close a run came.

Only the weights that enter products count: the layers' projections and the LM head (the
embedding lookup reads a row per token; a tied table is counted once, as the head). decode: an
ideal step reads those weights once plus the KV of every running sequence, and does 2 FLOPs per
weight per sequence plus the attention over its context; its floor is the larger of bytes /
bandwidth and FLOPs / matmul speed (small batches are bandwidth-bound, large ones on a CPU
compute-bound). prefill: an ideal prompt token costs 2 FLOPs per projection weight (the LM head
runs only for the last token of a prompt, and attention over short prompts is ignored), so its
floor is that / matmul speed. Matmul speed is the better of XLA's product and, on a CPU, the
engine's own kernel's. A fraction of 1.0 means the step ran at the machine's measured limit.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp

from worker.models.config import ModelConfig


def _best(fn, *args, repeats: int = 10) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times)


def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"


# instruction sets the CPU kernels choose between (worker/engine/cpu_matmul.py, cpu_build.py)
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def device_name() -> str:
    """What ran the figures: an accelerator's kind, or the CPU's model (with its family and model
    number, which name a generation where the model string does not), cores, and the instruction
    sets the kernels use. Figures of different hosts differ by more than their runs do."""
    if not _on_cpu():
        return str(jax.devices()[0].device_kind)
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    flags = set(info.get("flags", "").split())
    return (f"{info.get('model name', 'CPU')} (family {info.get('cpu family', '?')} model {info.get('model', '?')}), "
            f"{os.cpu_count()} cores, {' '.join(f for f in CPU_FEATURES if f in flags) or 'no AVX'}")


def memory_bandwidth_gbs(mib: int | None = None) -> float:
    """The machine's read rate over a large f32 array, in GB/s: decode reads (weights, KV).

    On a CPU, a jitted read (a sum) of 256 MiB, well past its caches. A copy (x + 1) is not used
    there: its fresh output either faults its pages in (8-11 GB/s on the 2-core VM) or, when the
    allocator hands back pages the process already holds, reads and writes at 64-67 GB/s counted
    together, while the read alone gives 38-45; which one a run got depended on what it had
    allocated before. On an accelerator, the better of the read and the copy (read + write
    counted; a reduction there can understate the read rate), over 2 GiB, where a smaller array
    leaves the launch a visible share of the time (H100: 256 MiB copies in ~0.17 ms)."""
    mib = mib or (256 if _on_cpu() else 2048)
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    read = x.nbytes / _best(jax.jit(jnp.sum), x)
    copy = 0.0 if _on_cpu() else 2 * x.nbytes / _best(jax.jit(lambda a: a + 1.0), x)
    del x
    return max(copy, read) / 1e9


def matmul_gflops(n: int | None = None, dtype=jnp.float32) -> float:
    """One [n, n] @ [n, n] product accumulated in float32 (as the model's projections are), in
    GFLOP/s: n 2048 on a CPU, 8192 on an accelerator (a 2048 product takes ~25 us on an H100, about
    its launch cost)."""
    n = n or (2048 if _on_cpu() else 8192)
    a = jnp.ones((n, n), dtype)
    seconds = _best(jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32)), a, a)
    return 2 * n**3 / seconds / 1e9


def kernel_matmul_gflops(n: int = 2048, dtype=jnp.float32) -> float | None:
    """The same product through the engine's CPU matmul kernel (float32 x, the weight packed into
    panels as the engine holds it), in GFLOP/s; None off the CPU or where the kernel is not built.
    On the hosts measured it beats XLA's product by 2-15 % (session 53, Zen 4: 211 against 192-208
    float32, 423 against 390 bfloat16), so a roofline from XLA's figure alone is not a ceiling."""
    if not _on_cpu():
        return None
    from worker.engine import cpu_matmul

    if not cpu_matmul.load(dtype):
        return None
    x = jnp.ones((n, n), jnp.float32)
    panels = cpu_matmul.pack(jnp.ones((n, n), dtype))
    seconds = _best(jax.jit(lambda a, w: cpu_matmul.matmul(a, w, n)), x, panels)
    return 2 * n**3 / seconds / 1e9


def int8_matmul_gflops(kernel: bool, n: int = 2048, scheme: str = "int8") -> float:
    """The same product through a quantized projection (`scheme` "int8": int8_linear.py, "int4":
    int4_linear.py; x quantized a row at a time, then the VNNI kernel or, without `kernel`, XLA),
    counted as 2 n^3 operations."""
    from flax import nnx

    from worker.engine import int4_linear, int8_linear
    from worker.models.llama import Linear

    linear = Linear(n, n, False, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    layer = (int8_linear.Int8Linear(linear, kernel) if scheme == "int8"
             else int4_linear.Int4Linear(linear, int4_linear.group_size([n]), kernel))
    seconds = _best(jax.jit(lambda a: layer(a)), jnp.ones((n, n), jnp.float32))
    return 2 * n**3 / seconds / 1e9


def quantized_itemsize(quantization: str | None, cfg: ModelConfig) -> float | None:
    """Bytes a projection weight takes under `quantization` (an engine's "int8 (kernel)", "int4
    (xla)"...; None: unquantized): int8 a byte, int4 half a byte and its group's float32 scale."""
    if not quantization:
        return None
    if quantization.startswith("int4"):
        from worker.engine import int4_linear

        inputs = [cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size]  # q/k/v/gate/up, o, down
        return 0.5 + 4 / int4_linear.group_size(inputs)
    return 1


def kv_bytes_per_token(cfg: ModelConfig, itemsize: float) -> float:
    """Keys and values of one token across all layers (`itemsize`: bytes an element, int8 pages'
    scales included)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def projection_params(cfg: ModelConfig) -> int:
    """Weights of the layers' q/k/v/o and MLP products."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return cfg.num_layers * (2 * h * q + 2 * h * kv + 3 * h * cfg.intermediate_size)


def matmul_params(cfg: ModelConfig) -> int:
    """Weights a decode step multiplies by: the projections and the LM head."""
    return projection_params(cfg) + cfg.vocab_size * cfg.hidden_size


def weight_bytes(cfg: ModelConfig, itemsize: int, projection_itemsize: float | None = None) -> float:
    """Bytes of the weights a decode step multiplies by: the projections at `projection_itemsize`
    (int8 ones: 1) or `itemsize`, the LM head at `itemsize`."""
    return projection_params(cfg) * (projection_itemsize or itemsize) + (matmul_params(cfg) - projection_params(cfg)) * itemsize


def product_s(cfg: ModelConfig, rows: float, gflops: float, projection_gflops: float | None = None) -> float:
    """`rows` rows through every product: the projections at `projection_gflops` (int8 ones' measured
    speed) or `gflops`, the LM head at `gflops`."""
    head = matmul_params(cfg) - projection_params(cfg)
    return 2.0 * rows * (projection_params(cfg) / (projection_gflops or gflops) + head / gflops) / 1e9


def prefill_token_s(cfg: ModelConfig, mean_context: float, gflops: float, projection_gflops: float | None = None) -> float:
    """`prefill_token_flops` at the measured speeds (the projections' own where they are int8)."""
    projections = 2.0 * projection_params(cfg) / (projection_gflops or gflops)
    return (projections + attention_flops(cfg, mean_context) / gflops) / 1e9


def decode_step_bytes(cfg: ModelConfig, itemsize: int, batch: float, mean_context: float,
                      kv_itemsize: float | None = None, projection_itemsize: float | None = None) -> float:
    """Bytes an ideal decode step reads: the weights of its products once, plus each sequence's KV."""
    return (weight_bytes(cfg, itemsize, projection_itemsize)
            + batch * mean_context * kv_bytes_per_token(cfg, kv_itemsize or itemsize))


def decode_serial_step_s(cfg: ModelConfig, itemsize: int, kv_itemsize: float, batch: float, context: float,
                         unique_context: float, bandwidth_gbs: float, gflops: float,
                         projection_itemsize: float | None = None, projection_gflops: float | None = None) -> float:
    """The ideal decode step when its products and its attention run one after another, as the
    calls of a step do (XLA runs them in turn; a kernel reading the KV does not multiply weights
    meanwhile): the products at the larger of reading their weights and computing their FLOPs, then
    the attention at the larger of reading each sequence's KV (`unique_context`: shared prefix
    pages once) and computing its FLOPs (over the whole `context`). `decode_step_bytes` and
    `decode_step_flops` give the step where the two overlap perfectly: the larger of their
    totals, never more than this."""
    bandwidth, speed = bandwidth_gbs * 1e9, gflops * 1e9
    products = max(weight_bytes(cfg, itemsize, projection_itemsize) / bandwidth,
                   product_s(cfg, batch, gflops, projection_gflops))
    attention = max(batch * unique_context * kv_bytes_per_token(cfg, kv_itemsize) / bandwidth,
                    batch * attention_flops(cfg, context) / speed)
    return products + attention


def attention_flops(cfg: ModelConfig, context: float) -> float:
    """One query token's scores and weighted values over `context` keys, in every layer."""
    return 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context


def decode_step_flops(cfg: ModelConfig, batch: float, mean_context: float) -> float:
    """2 per product weight per sequence plus attention (scores and weighted values) over its context."""
    return batch * (2.0 * matmul_params(cfg) + attention_flops(cfg, mean_context))


def prefill_token_flops(cfg: ModelConfig, mean_context: float = 0.0) -> float:
    """2 per projection weight plus attention over the keys a prompt token sees (its position + 1,
    cached prefix pages included); the LM head's once-per-prompt cost is left out."""
    return 2.0 * projection_params(cfg) + attention_flops(cfg, mean_context)
