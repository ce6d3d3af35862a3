"""Greedy and sampled tokens of a float32 model's LM head at a third to a half of its cost, exactly
as float32 picks them.

A greedy step without logprobs, penalties or logit bias needs each row's first largest logit and
nothing else; a sampled row with nothing cut (no top-k, top-p or min-p) the first largest of its
logits plus its Gumbel noise (`sampler.gumbel_draw`), which the screen bounds alike; and a row cut
to its top k (up to sampler.SCREENED_TOP_K) the same among the tokens whose logits reach the k-th largest,
which the screen computes for the tokens whose bound can reach it (about 12k a row with random
weights through the int8 bound; fewer where the logits spread). On a CPU
with AVX512-BF16 the bfloat16 panel product runs at about twice the float32 one's speed (64 rows
x 768 x 32000, Zen 4: 8.4-8.7 against 15.8-16.6 ms), and its logits differ from the float32 ones
by at most c(K) |x| |W_j| (`cpu_kernels/screened_argmax.cc` derives it). With
AVX512-VNNI an int8 product (both operands quantized, a scale per row of x and per token) runs in
half the bfloat16 one's time again (4.1-4.3 ms), within |x - q(x)| |W_j| + |q(x)| |W_j - q(W_j)|
plus rounding of the float32 logit. The screen keeps the tokens the bound cannot rule out, narrows
them with float32 dot products, recomputes the rest as the float32 panel kernel computes them, bit
for bit, and returns the first largest: the token the float32 head and its argmax (or the
sampler's draw) give. The head is 12-20 % of a float32 decode step for the demo model and
llama-100m.

`attach` gives a packed float32 model a `greedy_head`: `ScreenedHead` (bfloat16 panels of the head,
its rows in float32, and their norms) or `Int8Head` (int8 panels beside those, for the steps whose
rows have no outliers); the step takes tokens from it for the rows it can serve (`serves`,
head_choice.py), from the full head and the sampler for the rest. Each takes (x f32[R, K], temperature f32[R],
noise keys u32[R, 2]) -> tokens i32[R].

A bfloat16 model's head is the bfloat16 panel product itself, so only the int8 screen can save on
it: `Int8Head` with `exact` set screens the int8 product of x rounded to bfloat16 and computes each
candidate's logit as the panel kernel's own VDPBF16PS chain over the head's panels (no float32 copy
of the weight), giving the bfloat16 head's tokens bit for bit. It serves greedy and plain sampled
rows; a top-k cut would need the narrowing that float32 rows give, so such steps take the head
itself (`cuts_top_k`).
"""

from __future__ import annotations

from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from worker.engine import cpu_build, cpu_matmul, cpu_sampling
from worker.engine.sampler import SamplerFlags, gumbel_draw, scale, top_k_top_p_cut
from worker.models.llama import LlamaForCausalLM

TARGET = "redjax_screened_argmax"
I8_MATMUL = "redjax_panel_matmul_i8"  # cpu_kernels/panel_matmul.cc's PanelMatmulI8
I8_TARGET = "redjax_screened_argmax_i8"
I8_BF16_TARGET = "redjax_screened_argmax_i8_bf16"  # a bfloat16 model's: ScreenedArgmaxI8Bf16
KINDS = ("screened-int8", "screened-bf16")  # the approximations, fastest first
# the int8 screen serves a step where each row's bound is at most this many times the bfloat16 one:
# 1.9x for Gaussian rows (int8 1.55x faster than bfloat16 at llama-100m's shape), about even at 4.4x
WIDEST_INT8 = 3.0


def load() -> bool:
    """The bfloat16 panel kernel (AVX512-BF16) and the screen, built and registered; False if either
    cannot be."""
    return cpu_matmul.load(jnp.bfloat16) and load_screen()


@lru_cache(maxsize=1)
def load_screen() -> bool:
    """The screen alone (any x86-64 CPU with a C++ compiler: it takes the approximate logits as given)."""
    return cpu_build.register("screened_argmax.cc", "ScreenedArgmax", TARGET)


@lru_cache(maxsize=1)
def load_int8() -> bool:
    """The int8 panel kernel (AVX512-VNNI) and its screen, built and registered; False if either
    cannot be. (The steps it leaves to another head take the bfloat16 one where `load()`, else the
    float32 head.)"""
    return (cpu_matmul.has_cpu_flag("avx512_vnni") and cpu_matmul.load()
            and cpu_build.register("panel_matmul.cc", "PanelMatmulI8", I8_MATMUL)
            and cpu_build.register("screened_argmax.cc", "ScreenedArgmaxI8", I8_TARGET))


@lru_cache(maxsize=1)
def load_int8_bf16() -> bool:
    """The int8 screen of a bfloat16 model's head (AVX512-VNNI and AVX512-BF16), built and registered."""
    return (load_int8() and cpu_matmul.load(jnp.bfloat16)
            and cpu_build.register("screened_argmax.cc", "ScreenedArgmaxI8Bf16", I8_BF16_TARGET))


def screen(approx: jax.Array, x: jax.Array, rows: jax.Array, norms: jax.Array, temperature: jax.Array,
           keys: jax.Array, top_k: jax.Array | None = None):
    """approx f32[R, V] (a bfloat16 product of x and the head), x f32[R, K], rows f32[V, K] (the
    head's weight, a row per token), norms f32[V] (each row's 2-norm, rounded up), temperature
    f32[R] (0: greedy), keys u32[R, 2] (sampled rows' noise), top_k i32[R] (sampled rows' cut; None
    or 0: none) -> (tokens i32[R], their float32 logits f32[R], tokens whose exact logit was
    computed i32[R])."""
    r = approx.shape[0]
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct((r,), jnp.int32), jax.ShapeDtypeStruct((r,), jnp.float32),
                                     jax.ShapeDtypeStruct((r,), jnp.int32)))
    return call(approx, x.astype(jnp.float32), rows, norms, *_sampling(temperature, keys, top_k))


def _sampling(temperature: jax.Array, keys: jax.Array, top_k: jax.Array | None):
    """The screens' sampling arguments: temperature f32[R], keys u32[R, 2], top_k i32[R]."""
    top_k = jnp.zeros(temperature.shape, jnp.int32) if top_k is None else top_k.astype(jnp.int32)
    return temperature.astype(jnp.float32), keys.astype(jnp.uint32), top_k


def row_norms(rows: jax.Array) -> jax.Array:
    """f32[V, K] -> f32[V]: each row's 2-norm, summed in float64 and rounded up to float32 (4096
    rows at a time: a float64 copy of a large vocabulary's head would be gigabytes)."""
    # a block at a time from the device array (bfloat16 rows: each block as float32), never a whole host copy
    norms = np.concatenate([np.sqrt(np.square(np.asarray(rows[i:i + 4096], np.float32), dtype=np.float64).sum(axis=1))
                            for i in range(0, rows.shape[0], 4096)])
    return jnp.asarray(np.nextafter(norms.astype(np.float32), np.float32(np.inf)))


def quantize(rows: np.ndarray):
    """f32[V, K] -> (q i8[V, K], scales f32[V], totals i32[V], lost f32[V]): each token's row to int8
    by its own scale (its largest |w| / 127), the quantized row's sum, and |W_j - scale_j q_j|_2
    (rounded up), which the int8 screen's bound takes. 4096 rows at a time, as `row_norms`."""
    v = rows.shape[0]
    q, scales, lost = np.empty(rows.shape, np.int8), np.empty(v, np.float32), np.empty(v, np.float64)
    for i in range(0, v, 4096):
        part = np.asarray(rows[i:i + 4096], np.float32)  # (bfloat16 rows: a block at a time as float32)
        scale = (np.abs(part).max(axis=1) / np.float32(127)).astype(np.float32)
        q[i:i + 4096] = np.clip(np.rint(part / np.where(scale > 0, scale, 1)[:, None]), -127, 127)
        error = part - scale[:, None].astype(np.float64) * q[i:i + 4096]  # exact: 24 bits times 8
        scales[i:i + 4096], lost[i:i + 4096] = scale, np.sqrt(np.square(error).sum(axis=1))
    lost = np.nextafter((lost * (1 + 2.0**-40)).astype(np.float32), np.float32(np.inf))
    return q, scales, q.sum(axis=1, dtype=np.int32), lost


def pack_int8(q: jax.Array) -> jax.Array:
    """i8[V, K] (a row per token) -> PanelMatmulI8's panels i8[ceil(V / PANEL), ceil(K / 4), 4 *
    PANEL]: a panel row holds each of its PANEL tokens' k .. k + 3 in turn (zeros past V and K).
    Traceable (jnp): inside a jitted program it is one copy of q."""
    v, k = q.shape
    panels, steps, panel = -(-v // cpu_matmul.PANEL), -(-k // 4), cpu_matmul.PANEL
    if (v, k) != (panels * panel, 4 * steps):  # (a large head's rows divide evenly: no padded copy)
        q = jnp.pad(q, ((0, panels * panel - v), (0, 4 * steps - k)))
    return q.reshape(panels, panel, steps, 4).transpose(0, 2, 1, 3).reshape(panels, steps, 4 * panel)


def pack_int8_host(q: np.ndarray, block: int = 4096) -> np.ndarray:
    """`pack_int8` into host memory, `block` rows (a multiple of PANEL) at a time: no padded or
    device copy of a whole head."""
    v, k = q.shape
    panel = cpu_matmul.PANEL
    out = np.empty((-(-v // panel), -(-k // 4), 4 * panel), np.int8)
    for i in range(0, v, block):
        out[i // panel:-(-min(i + block, v) // panel)] = jax.jit(pack_int8)(q[i:i + block])
    return out


class PanelRows:
    """A bfloat16 head's rows bf16[V, K] read from its panels a block of rows at a time (`rows[i:j]`,
    as `quantize` and `row_norms` read them), never unpacked whole: for llama3-8b a 1 GB copy fewer
    while its int8 screen is made."""

    def __init__(self, panels: jax.Array, v: int, k: int):  # panels bf16[P, ceil(K / 2), 2 * PANEL]
        self.panels, self.shape = panels, (v, k)

    def __getitem__(self, rows: slice) -> jax.Array:
        start, stop = rows.start or 0, min(rows.stop, self.shape[0])
        if rows.step not in (None, 1) or start % cpu_matmul.PANEL:
            raise IndexError("PanelRows reads runs of rows starting at a panel's first")
        first, last = start // cpu_matmul.PANEL, -(-stop // cpu_matmul.PANEL)
        return _unpack_bf16(self.panels[first:last], stop - start, self.shape[1])


class FullHead(nnx.Module):
    """The model's own head, the sampler's top-k cut and its draw (`sampler.gumbel_draw`: the first
    argmax for greedy rows): the int8 head's fallback on a CPU without AVX512-BF16, and for a
    bfloat16 model."""

    cuts_top_k = True

    def __init__(self, head: cpu_matmul.PanelLinear):  # the model's own (shared, not copied)
        self.head = head

    def __call__(self, x: jax.Array, temperature: jax.Array, keys: jax.Array,
                 top_k: jax.Array | None = None) -> jax.Array:  # -> i32[R]
        kernels = cpu_sampling.KERNELS if cpu_sampling.load() else None
        logits = self.head(x)  # f32[R, V]
        if top_k is not None:  # as sampler.sample cuts: on the scaled logits, the draw over the rest
            cutoffs = kernels.cutoffs if kernels is not None else top_k_top_p_cut
            scaled = scale(logits, temperature)
            logits = jnp.where(scaled < cutoffs(scaled, top_k, jnp.ones_like(temperature))[:, None], -jnp.inf, logits)
        draw = kernels.draw if kernels is not None else gumbel_draw
        return draw(logits, temperature.astype(jnp.float32), keys.astype(jnp.uint32))


class Int8Head(nnx.Module):
    """The LM head for greedy and plain sampled rows: int8 panels with their scales, the float32 rows, their norms; and
    the bfloat16 head (or `fallback`) for steps whose rows int8 would screen poorly (`takes_int8`)."""

    def __init__(self, rows: jax.Array, fallback: nnx.Module | None = None, exact: jax.Array | None = None):
        # rows f32[V, K], a row per token; or a bfloat16 model's bf16[V, K] (`PanelRows`) with `exact` its head's
        # panels bf16[P, K / 2, 2 * PANEL] (shared, not a copy), whose product the tokens must be, and
        # its `fallback`
        q, scales, totals, lost = quantize(rows)  # (a block at a time: no host copy of the head)
        packed = pack_int8_host(q)
        del q  # (the head's int8 values: held once on the host, then once on the device)
        self.panels = nnx.Param(jnp.asarray(packed))  # i8[P, K / 4, 4 * PANEL]
        del packed
        pad = self.panels.shape[0] * cpu_matmul.PANEL - rows.shape[0]  # columns past V: zeros
        self.scales = nnx.Param(jnp.asarray(np.pad(scales, (0, pad))))  # f32[P * PANEL]
        self.totals = nnx.Param(jnp.asarray(np.pad(totals, (0, pad))))  # i32[P * PANEL]
        self.norms = nnx.Param(row_norms(rows))  # f32[V]
        self.rows = nnx.Param(rows) if exact is None else None  # f32[V, K] (not a copy)
        self.exact = nnx.Param(exact) if exact is not None else None
        if exact is not None and fallback is None:
            raise ValueError("a bfloat16 head's int8 screen needs the head itself as its fallback")
        self.fallback = fallback if fallback is not None else ScreenedHead(rows, self.norms[...])
        self.lost = nnx.Param(jnp.asarray(lost))  # f32[V]
        # the weights' share of the int8 bound, |W_j - q(W_j)| / |W_j| over the tokens (a Python float)
        norms = np.asarray(self.norms[...], np.float64)
        self.weight_loss = float(np.mean(lost / np.where(norms > 0, norms, 1.0)))
        self.vocab = rows.shape[0]

    def __call__(self, x: jax.Array, temperature: jax.Array, keys: jax.Array,
                 top_k: jax.Array | None = None) -> jax.Array:  # -> i32[R]
        return jax.lax.cond(self.takes_int8(x), lambda *a: self.screen(*a)[0], self.fallback, x, temperature, keys,
                            top_k)

    @property
    def cuts_top_k(self) -> bool:
        """Whether it draws rows cut to a top-k: not over a bfloat16 head (no float32 rows narrow the
        ~12k candidates such a row keeps)."""
        return self.exact is None

    def takes_int8(self, x: jax.Array) -> jax.Array:
        """Whether the int8 screen serves this step's rows x f32[R, K] (a bool on the device): the
        bound of every row within WIDEST_INT8 times the bfloat16 one. A row with outlier values
        quantizes coarsely: its int8 bound widens with its largest |x_k| and its candidates with it
        (4 channels at 10x the others' scale: 1.8x the bfloat16 head's time at llama-100m's shape)."""
        # estimated, in one pass over x: rounding to a step of max|x| / 127 loses about a uniform
        # error's sqrt(K / 12) steps (the screen computes its bound exactly; this only chooses)
        x = x.astype(jnp.float32)
        norm = jnp.sqrt(jnp.sum(x * x, axis=1))  # [R]
        int8 = jnp.max(jnp.abs(x), axis=1) / 127 * (x.shape[1] / 12) ** 0.5 + self.weight_loss * norm
        return jnp.all(int8 <= WIDEST_INT8 * 2.0**-7 * norm)

    def screen(self, x: jax.Array, temperature: jax.Array, keys: jax.Array, top_k: jax.Array | None = None):
        """x f32[R, K], temperature f32[R], keys u32[R, 2], top_k i32[R] (None: no cut) -> (tokens
        i32[R], their float32 logits f32[R], exact logits computed i32[R])."""
        r, x = x.shape[0], x.astype(jnp.float32)
        product = jax.ffi.ffi_call(I8_MATMUL, (jax.ShapeDtypeStruct((r, self.vocab), jnp.float32),
                                               jax.ShapeDtypeStruct((r, 3), jnp.float32)))
        # a bfloat16 head multiplies x rounded to bfloat16: the int8 product approximates that
        screened = x if self.exact is None else x.astype(jnp.bfloat16).astype(jnp.float32)
        approx, stats = product(screened, self.panels[...], self.scales[...], self.totals[...])  # f32[R, V], f32[R, 3]
        results = (jax.ShapeDtypeStruct((r,), jnp.int32), jax.ShapeDtypeStruct((r,), jnp.float32),
                   jax.ShapeDtypeStruct((r,), jnp.int32))
        target, weights = (I8_TARGET, self.rows) if self.exact is None else (I8_BF16_TARGET, self.exact)
        return jax.ffi.ffi_call(target, results)(approx, stats, x, weights[...], self.norms[...], self.lost[...],
                                                 *_sampling(temperature, keys, top_k))


class ScreenedHead(nnx.Module):
    """The LM head for greedy and plain sampled rows: bfloat16 panels, the float32 rows, their norms."""

    cuts_top_k = True

    def __init__(self, rows: jax.Array, norms: jax.Array | None = None):  # f32[V, K]: a row per token
        self.panels = nnx.Param(cpu_matmul.pack(rows.T.astype(jnp.bfloat16)))  # bf16[P, K / 2, 2 * PANEL]
        self.rows = nnx.Param(rows)
        self.norms = nnx.Param(row_norms(rows) if norms is None else norms)  # f32[V] (`row_norms`)
        self.vocab = rows.shape[0]

    def __call__(self, x: jax.Array, temperature: jax.Array, keys: jax.Array,
                 top_k: jax.Array | None = None) -> jax.Array:  # -> i32[R]
        approx = cpu_matmul.matmul(x, self.panels[...], self.vocab)  # f32[R, V]
        return screen(approx, x, self.rows[...], self.norms[...], temperature, keys, top_k)[0]


def choose(mode: str, matmul: str, model: LlamaForCausalLM) -> str:
    """`EngineConfig.greedy_head` for an engine whose projections run on `matmul` ("kernel": `model`
    is packed): "auto" or "screened" attach the fastest greedy head the CPU and compiler allow to a
    float32 model (int8, or bfloat16 where that runs on AMX; "screened" fails if none), "screened-int8" / "screened-bf16" that one or fail,
    "full" never; -> "screened-int8", "screened-bf16" or "full"."""
    if mode == "full":
        return "full"
    # with AMX the bfloat16 product runs on its tiles (cpu_matmul.amx: 600-1100 GFLOP/s on the Intel
    # VM, where VPDPBUSD's int8 would reach about twice the AVX-512 bfloat16 kernel's 120-170)
    fastest = KINDS[::-1] if cpu_matmul.amx() else KINDS
    for kind in fastest if mode in ("auto", "screened") else (mode,):
        if matmul == "kernel" and attach(model, kind):
            return kind
    if mode != "auto":
        raise ValueError(f"greedy_head={mode!r} needs a float32 model on the CPU matmul kernel and a CPU with "
                         "AVX512-VNNI (screened-int8) or AVX512-BF16 (screened-bf16): the product it screens; "
                         "or a bfloat16 model there and a CPU with both (screened-int8)")
    return "full"


def attach(model: LlamaForCausalLM, kind: str = "screened-bf16") -> bool:
    """Give `model` (packed by cpu_matmul.pack_model, float32) a `greedy_head` of `kind` (KINDS), in
    place, where the CPU and compiler allow; -> whether it has one. A tied head's rows are the
    embedding table itself. A bfloat16 model takes the int8 screen alone (`attach_bf16`)."""
    if cpu_matmul.kernel_dtype(model) == jnp.dtype(jnp.bfloat16):
        return kind == KINDS[0] and attach_bf16(model)
    if cpu_matmul.kernel_dtype(model) != jnp.dtype(jnp.float32) or not (load_int8() if kind == KINDS[0] else load()):
        return False
    if model.lm_head.bias is not None:
        return False
    if model.cfg.tie_word_embeddings:
        rows = model.model.embed_tokens.weight[...]  # f32[V, K], shared with the embedding
    else:
        panels = model.lm_head.panels[...]  # f32[P, K, PANEL]
        rows = panels.transpose(0, 2, 1).reshape(-1, panels.shape[1])[: model.cfg.vocab_size]  # f32[V, K]
    if kind != KINDS[0]:
        model.greedy_head = nnx.data(ScreenedHead(rows))
    else:  # steps with outlier rows: the bfloat16 head, or without AVX512-BF16 the float32 one
        model.greedy_head = nnx.data(Int8Head(rows, None if load() else FullHead(model.lm_head)))
    return True


def attach_bf16(model: LlamaForCausalLM) -> bool:
    """Give `model` (packed, bfloat16) the int8 screen of its head (`Int8Head` with `exact`), where
    the CPU has AVX512-VNNI and AVX512-BF16, the head's product runs on the bfloat16 panel kernel
    (not on AMX tiles, whose sums run in another order) and its panels hold under 2^31 pairs (the
    screen's gather offsets); -> whether it has it."""
    head = model.lm_head
    k = model.cfg.hidden_size
    if head.bias is not None or not load_int8_bf16() or (k % cpu_matmul.AMX_K == 0 and cpu_matmul.amx()):
        return False
    panels = head.panels[...]  # bf16[P, ceil(K / 2), 2 * PANEL]
    p, steps, _ = panels.shape
    if p * steps * cpu_matmul.PANEL >= 2**31:
        return False
    rows = PanelRows(panels, model.cfg.vocab_size, k)  # bf16[V, K], a block at a time
    model.greedy_head = nnx.data(Int8Head(rows, FullHead(head), exact=panels))
    return True


@partial(jax.jit, static_argnames=("v", "k"))
def _unpack_bf16(panels: jax.Array, v: int, k: int) -> jax.Array:
    """bfloat16 panels bf16[P, steps, 2 * PANEL] -> the head's rows bf16[v, k] (a row per token)."""
    p, steps, _ = panels.shape
    rows = panels.reshape(p, steps, cpu_matmul.PANEL, 2).transpose(0, 2, 1, 3).reshape(p * cpu_matmul.PANEL, 2 * steps)
    return rows[:v, :k]


def serves(flags: SamplerFlags) -> bool:
    """Whether a step of these sampler flags may take every row's token from the screened head:
    nothing that needs every logit of a row (logprobs, penalties, logit bias, a grammar's mask). A top-k cut needs
    only the few logits that can reach the k-th largest; rows needing every logit take the float32
    head apart where they are few (`SamplerFlags.apart`, head_choice.py)."""
    return not (flags.logprobs or flags.penalties or flags.bias or flags.mask_words)
