"""On-device sampling: penalties, logit bias, temperature, top-k, top-p, min-p, seeded draws.

Every row's random key is derived from (seed, choice index, output position) only, so a
request draws the same tokens whatever shares its batch and whichever step it joined, and a
request resumed on another worker continues identically. Nothing here waits on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp


# the largest top-k the screened head draws (screened_head.py). It reads the float32 rows of the
# tokens whose bound can reach the k-th largest logit: about 12k a row for llama-100m's random
# weights through the int8 bound (93 at k = 5, 595 at 50). 64 rows, the head alone: 7.6-8.6,
# 10.6-11.0, 12.5-13.7 and 14.7-17.2 ms at k = 5, 20, 32 and 50, against 17-19 for the float32 head
# and the sampler's cut; in the engine k = 50 was no faster. A larger k takes the float32 head.
SCREENED_TOP_K = 32
SPLIT_SHARE = 4  # a step draws rows apart from the screened head for at most 1 / SPLIT_SHARE of its rows


def has_penalties(p) -> bool:
    """Whether SamplingParams `p` ask for a presence, frequency or repetition penalty."""
    return p.penalised


def needs_logits(p) -> bool:
    """Whether a request's sampled rows need every logit of the float32 head (SamplingParams `p`):
    logprobs of the sampled token (a log-softmax over the row), penalties or a logit bias (they
    move logits the screened head does not see), a grammar (its mask does too), or, sampled, a top-p or min-p cut (its mass) or a
    top-k past SCREENED_TOP_K. Prompt logprobs come from the prompt's own logits, not these."""
    cut = p.temperature > 0.0 and (p.top_p < 1.0 or p.min_p > 0.0 or p.top_k > SCREENED_TOP_K)
    return cut or p.logprobs is not None or has_penalties(p) or biased(p) or p.grammar is not None


def biased(p) -> bool:
    """Whether a request's rows carry logit-bias entries: its own logit_bias, or min_tokens' bans
    (batch.bias_entries)."""
    return bool(p.logit_bias) or p.min_tokens > 0


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingTensors:
    """Per sampled row (one per scheduled sequence, padded to R rows)."""

    temperature: jax.Array  # f32[R]; 0 = greedy
    top_k: jax.Array  # i32[R]; 0 = off
    top_p: jax.Array  # f32[R]
    min_p: jax.Array  # f32[R]
    seed: jax.Array  # u32[R]
    choice: jax.Array  # i32[R]: choice index within the request
    out_pos: jax.Array  # i32[R]: index of the output token being sampled
    presence: jax.Array  # f32[R]
    frequency: jax.Array  # f32[R]
    repetition: jax.Array  # f32[R]
    bias_ids: jax.Array  # i32[R, B]
    bias_vals: jax.Array  # f32[R, B]; padding entries are 0
    bias_until: jax.Array  # i32[R, B]: an entry applies while out_pos < this (min_tokens' bans on EOS, stop tokens)
    output_ids: jax.Array  # i32[R, L]: generated tokens so far (-1 padding), for penalties
    prompt_ids: jax.Array  # i32[R, Lp]: prompt tokens (-1 padding), for the repetition penalty
    pending: jax.Array  # i32[R]: row of the previous step holding a generated token not yet on the host, or -1
    full_head: jax.Array  # i32[R]: 1 where the row needs every logit of the float32 head (needs_logits; head_choice.py)
    allowed: jax.Array  # i32[R, W]: structured output's bitmask of the tokens a row may take (grammar.py; all ones: any)


@dataclass(frozen=True)
class SamplerFlags:
    """Static switches: each combination is one compiled variant; all off is the cheap path."""

    all_greedy: bool = True
    needs_cut: bool = False  # some row uses top-k or top-p (the cutoffs kernel, or top_k_top_p_cut's passes)
    top_p: bool = False  # some row uses top-p (its mass needs every logit: the float32 head's, head_choice.py)
    min_p: bool = False  # some row uses min-p (a softmax over the kept logits)
    # some rows need every logit (needs_logits: logprobs, penalties, logit bias, top-p, min-p, a top-k
    # past SCREENED_TOP_K), at most 1 / SPLIT_SHARE of the step's rows: with a screened head, the
    # float32 head and the sampler draw those apart (head_choice.py)
    apart: bool = False
    penalties: bool = False
    bias: bool = False
    num_logprobs: int = 0  # top-N alternatives to return, sampled or prompt (0: the token's logprob alone)
    logprobs: bool = False  # some row asks for its sampled tokens' logprobs (prompt logprobs need no flag)
    # (output ids, prompt ids, logit-bias entries) per row: the widths of the penalty and bias arrays,
    # (1, 1, 1) without them. In the key, so a variant with penalties can be compiled ahead like any other
    widths: tuple[int, int, int] = (1, 1, 1)
    mask_words: int = 0  # W: some row follows a grammar (the `allowed` bitmask's words a row); 0: none does


@dataclass(frozen=True)
class SamplingKernels:
    """Compiled stand-ins for the costly parts of sampling (engine/cpu_sampling.py)."""

    cutoffs: Callable  # (logits f32[R, V], top_k i32[R], top_p f32[R]) -> f32[R]: mask the logits below
    draw: Callable  # (logits f32[R, V] with -inf for masked, temperature f32[R], keys u32[R, 2]) -> i32[R]: gumbel_draw
    argmax: Callable  # (logits f32[R, V]) -> i32[R]: first_argmax
    top_n: Callable  # (x f32[R, V], n) -> (f32[R, n], i32[R, n]): jax.lax.top_k


def sample(logits: jax.Array, t: SamplingTensors, flags: SamplerFlags, kernels: SamplingKernels | None = None):
    """logits f32[R, V] -> (tokens i32[R], logprobs f32[R], top_ids i32[R, N], top_logprobs f32[R, N]).

    Logprobs are of the model's own distribution (raw log-softmax), as OpenAI reports them.
    `kernels`: compiled cutoffs and draws (the CPU backend), or None: `top_k_top_p_cut` and `gumbel_draw`.
    """
    r, v = logits.shape
    raw = logits  # the model's own logits, for logprobs
    if flags.penalties:
        logits = apply_penalties(logits, t)
    if flags.bias:
        rows = jnp.arange(r)[:, None]
        logits = logits.at[rows, t.bias_ids].add(jnp.where(t.out_pos[:, None] < t.bias_until, t.bias_vals, 0.0))
    if flags.mask_words:
        logits = jnp.where(allowed_tokens(t.allowed, v), logits, -jnp.inf)
    if flags.all_greedy:
        tokens = kernels.argmax(logits) if kernels is not None else first_argmax(logits)
    else:  # (greedy rows among them: the draw's argmax at T = 0, which a cut never changes: it keeps the largest)
        if flags.needs_cut or flags.min_p:  # the cut on the temperature-scaled logits; the draw scales its noise instead
            cut = filter_logits(scale(logits, t.temperature), t, flags, kernels)
            logits = jnp.where(cut == -jnp.inf, -jnp.inf, logits)
        draw = kernels.draw if kernels is not None else gumbel_draw
        tokens = draw(logits, t.temperature, noise_keys(t.seed, t.choice, t.out_pos))
    if not flags.logprobs:
        zeros = jnp.zeros((r, 0))
        return tokens, jnp.zeros((r,)), zeros.astype(jnp.int32), zeros
    return tokens, *log_probs(raw, tokens, flags.num_logprobs, kernels)


def log_probs(logits: jax.Array, ids: jax.Array, n: int, kernels: SamplingKernels | None = None):
    """logits f32[R, V], ids i32[R] -> (the log-softmax at ids f32[R], top ids i32[R, n], top logprobs
    f32[R, n]). The n largest logits are the n largest logprobs (a row's log-softmax is its logits
    less their logsumexp), so neither the top-n nor the pick reads a [R, V] array of logprobs:
    writing and reading one took three quarters of the time at V = 32000."""
    r = logits.shape[0]
    norm = jax.nn.logsumexp(logits, axis=-1)  # f32[R]
    chosen = jnp.take_along_axis(logits, ids[:, None], axis=-1)[:, 0] - norm
    if not n:
        return chosen, jnp.zeros((r, 0), jnp.int32), jnp.zeros((r, 0))
    top = kernels.top_n if kernels is not None else jax.lax.top_k
    top_logits, top_ids = top(logits, n)
    return chosen, top_ids.astype(jnp.int32), top_logits - norm[:, None]


def allowed_tokens(allowed: jax.Array, v: int) -> jax.Array:
    """Bitmask rows i32[R, W] -> bool[R, V]: token t is bit t % 32 of word t // 32."""
    ids = jnp.arange(v)
    return ((jnp.take(allowed, ids // 32, axis=1) >> (ids % 32)) & 1) == 1


def token_ranks(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """logits f32[R, V], ids i32[R] -> i32[R]: each id's rank in its row, 1 for the likeliest
    (1 + the tokens strictly likelier; tied ones share the better rank), as vLLM reports it."""
    chosen = jnp.take_along_axis(logits, ids[:, None], axis=-1)  # f32[R, 1]
    return 1 + jnp.sum(logits > chosen, axis=-1, dtype=jnp.int32)


def scale(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """logits f32[R, V] / temperature f32[R] (at least 1e-5), as XLA computes a division by a
    broadcast value anyway: times the float32 reciprocal. Written out, so the screened head
    (cpu_kernels/screened_argmax.cc), which scales the logits of a top-k row's candidates alike,
    does not depend on that rewrite."""
    return logits * (1.0 / jnp.maximum(temperature, 1e-5))[:, None]


def apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Presence/frequency on generated tokens (OpenAI), repetition on prompt + generated (HF)."""
    r, v = logits.shape
    rows = jnp.arange(r)[:, None]
    counts = jnp.zeros((r, v + 1), jnp.float32).at[rows, jnp.where(t.output_ids < 0, v, t.output_ids)].add(1.0)[:, :v]
    in_prompt = jnp.zeros((r, v + 1), bool).at[rows, jnp.where(t.prompt_ids < 0, v, t.prompt_ids)].set(True)[:, :v]
    seen = in_prompt | (counts > 0)
    rep = t.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - t.frequency[:, None] * counts - t.presence[:, None] * (counts > 0)


def filter_logits(logits: jax.Array, t: SamplingTensors, flags: SamplerFlags,
                  kernels: SamplingKernels | None = None) -> jax.Array:
    """Mask (to -inf) what top-k and top-p (with `flags.needs_cut`) and min-p (with `flags.min_p`)
    exclude; logits already temperature-scaled.

    Each row's top-k/top-p cut comes from `kernels.cutoffs` (a selection in C++) or
    `top_k_top_p_cut` (bisections in jnp): the same rules, and neither sorts the vocabulary."""
    if flags.needs_cut:
        cutoffs = kernels.cutoffs if kernels is not None else top_k_top_p_cut
        logits = jnp.where(logits < cutoffs(logits, t.top_k, t.top_p)[:, None], -jnp.inf, logits)
    if not flags.min_p:  # (its softmax over [R, V] cost 1-2 ms a llama-100m step whether a row asked or not)
        return logits
    probs = jax.nn.softmax(logits, axis=-1)
    floor = t.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(probs < floor, -jnp.inf, logits)


CUT_PASSES = 32  # bisection steps to a cut: one per bit of a float32


def top_k_top_p_cut(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits f32[R, V] (temperature applied), top_k i32[R] (0: off), top_p f32[R] in (0, 1] -> f32[R]:
    each row keeps the logits at or above its value. The rules of a descending sort: the top-k set
    is the k largest (its last value's ties all kept), and top-p keeps the sorted tokens whose mass
    strictly before them, within the top-k set, is under top_p; so the cut is the k-th largest
    value or, if larger, the smallest value whose strictly larger logits weigh under top_p.

    Without the sort (a bitonic network on accelerators, a comparison sort on XLA's CPU): two
    bisections over the logits' bits as ordered integer keys, one masked pass a step each."""
    v = logits.shape[1]
    keys = _order_keys(logits)  # u32[R, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)  # i32[R]
    # the k-th largest: the largest key K with at least k keys >= K
    top_key = keys.max(axis=-1)  # u32[R]
    lo, hi = keys.min(axis=-1), top_key  # u32[R]
    for _ in range(CUT_PASSES):
        d = hi - lo
        mid = lo + (d >> 1) + (d & 1)  # the upper middle: lo < mid <= hi until lo == hi
        ok = jnp.sum(keys >= mid[:, None], axis=-1) >= k
        lo, hi = jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)
    kth = lo
    # the top-k set's weight as the sort counts it: every logit above the k-th, and k minus those of its ties
    top = _key_value(top_key)  # f32[R]: the row's largest logit
    w = jnp.exp(logits - top[:, None])  # f32[R, V]
    above = keys > kth[:, None]
    z = jnp.sum(jnp.where(above, w, 0.0), axis=-1) + (k - jnp.sum(above, axis=-1)) * jnp.exp(_key_value(kth) - top)
    target = top_p * z
    # the smallest key K from the k-th up whose strictly larger keys weigh under top_p (true at the largest)
    lo, hi = kth, top_key  # lo only rises
    for _ in range(CUT_PASSES):
        mid = lo + ((hi - lo) >> 1)  # the lower middle
        ok = jnp.sum(jnp.where(keys > mid[:, None], w, 0.0), axis=-1) < target
        lo, hi = jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)
    return _key_value(jnp.where(top_p >= 1.0, kth, lo))


def _order_keys(x: jax.Array) -> jax.Array:
    """f32[...] -> u32[...] in the floats' order (-0.0 as 0.0, so a tie at zero stays one)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _key_value(key: jax.Array) -> jax.Array:
    """The inverse of _order_keys: u32[...] -> f32[...]."""
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def first_argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (first index of the maximum) as two plain reductions: XLA's
    CPU backend runs argmax's (value, index) reduction unvectorized, 5.0 vs 1.1 ms on [64, 32000]."""
    v = x.shape[-1]
    top = x.max(axis=-1, keepdims=True)
    first = jnp.min(jnp.where(x == top, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
    # a row with a NaN (a broken model) gives the last index on every backend, as the CPU kernel does
    return jnp.where(jnp.isnan(x).any(axis=-1), v - 1, first)


def row_key(seed: jax.Array, choice: jax.Array, out_pos: jax.Array) -> jax.Array:
    key = jax.random.fold_in(jax.random.key(seed), choice)
    return jax.random.fold_in(key, out_pos)


def noise_keys(seed: jax.Array, choice: jax.Array, out_pos: jax.Array) -> jax.Array:
    """u32[R] x3 -> u32[R, 2]: each row's noise key (`gumbel_noise`), from its threefry key."""
    return jax.vmap(lambda *row: jax.random.bits(row_key(*row), (2,), jnp.uint32))(seed, choice, out_pos)


def _mix32(x: jax.Array) -> jax.Array:
    """cpu_kernels/gumbel_noise.h's integer hash, on u32 arrays (multiplications wrap)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x21F0AAAD)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x735A2D97)
    return x ^ (x >> 15)


def gumbel_noise(keys: jax.Array, v: int) -> jax.Array:
    """keys u32[R, 2] -> f32[R, V]: token j's Gumbel noise in each row, as cpu_kernels/gumbel_noise.h
    computes it (the same hash bit for bit; the library's logarithm, within an ulp or two of the
    kernel's), a function of the row's key and j alone."""
    j = jnp.arange(v, dtype=jnp.uint32)[None, :]
    h = _mix32(_mix32((j * jnp.uint32(0x9E3779B9)) ^ keys[:, :1]) ^ keys[:, 1:])  # u32[R, V]
    u = ((h >> 8).astype(jnp.int32).astype(jnp.float32) + 0.5) * 2.0**-24  # (0, 1), 24 bits
    return -jnp.log(-jnp.log(u))


def gumbel_draw(logits: jax.Array, temperature: jax.Array, keys: jax.Array) -> jax.Array:
    """logits f32[R, V] (-inf: cut), temperature f32[R], keys u32[R, 2] -> i32[R]: each row's first
    largest of logit_j + T g_j (g: `gumbel_noise`), a draw from softmax(logits / T) by the Gumbel-max
    property; at T = 0 the first largest logit. The CPU kernel's rule (cpu_kernels/sampling.cc), and
    the screened heads' (cpu_kernels/screened_argmax.cc), so one seed draws the same tokens on every
    path, up to noise within rounding of a tie."""
    return first_argmax(logits + temperature[:, None] * gumbel_noise(keys, logits.shape[1]))
