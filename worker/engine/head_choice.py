"""Which LM head draws each row of a step: the screened head (screened_head.py) where it can, the
float32 head and the sampler for the rows it cannot.

The screened head draws greedy rows, plainly sampled rows and rows cut to a top-k of at most
SCREENED_TOP_K from a third of the float32 head's cost. A top-p or min-p cut needs every logit of
its row (its mass), and so does a larger top-k. Until session 59 one such row sent the whole step
to the float32 head: with mixed traffic (some clients greedy or plain, some with top-p), every
step paid it. Now a step where such rows are at most 1 / SPLIT_SHARE of its rows
(`SamplerFlags.apart`, set on the host where the model has a screened head) takes the screened
head for all rows and the float32 head and the sampler for those rows alone, gathered: at
llama-100m's shape 10.1 ms against 16.5 for the float32 head over 64 rows, 8 of them with top-p.
Their tokens replace the screened ones. A step with more such rows takes the float32 head for all,
as before. Either way each row gets the token the float32 head and the sampler give it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from worker.engine import screened_head
from worker.engine.sampler import (SCREENED_TOP_K, SPLIT_SHARE, SamplerFlags, SamplingKernels, SamplingTensors,
                                  noise_keys, sample)


def needs_logits(st: SamplingTensors, vocab: int) -> jax.Array:
    """bool[R]: the sampled rows the screened head cannot draw (a top-p or min-p cut, or a top-k
    past SCREENED_TOP_K short of the vocabulary: sampler.needs_logits on the device)."""
    wide_k = (st.top_k > SCREENED_TOP_K) & (st.top_k < vocab)
    return (st.temperature > 0) & ((st.top_p < 1.0) | (st.min_p > 0.0) | wide_k)


def next_tokens(model, rows: jax.Array, st: SamplingTensors, flags: SamplerFlags,
                kernels: SamplingKernels | None):
    """rows f32[R, hidden] -> (tokens i32[R], logprobs f32[R], top ids i32[R, N], top logprobs
    f32[R, N]) as sampler.sample gives them over the float32 head's logits; from the model's
    screened head (`greedy_head`) where it has one and the step's flags allow (`screened_head.serves`)."""
    head = getattr(model, "greedy_head", None) if screened_head.serves(flags) else None
    if head is None:
        return sample(model.logits(rows), st, flags, kernels)
    r = rows.shape[0]
    keys = (jnp.zeros((r, 2), jnp.uint32) if flags.all_greedy  # (no row takes noise)
            else noise_keys(st.seed, st.choice, st.out_pos))
    if not (flags.needs_cut or flags.min_p):
        tokens = head(rows, st.temperature, keys)
    elif flags.apart:  # the few rows that need their logits drawn apart, the rest screened
        need = needs_logits(st, head.vocab)  # bool[R]
        at = jnp.nonzero(need, size=r // SPLIT_SHARE, fill_value=0)[0]  # i32[R / 4]: those rows, then row 0 again
        drawn = draw_apart(model, rows, at, st, flags, kernels)
        screened = head(rows, st.temperature, keys, jnp.where(need, 0, st.top_k))  # (those rows' tokens replaced)
        tokens = screened.at[at].set(jnp.where(need[at], drawn, screened[at]))  # (a repeated row 0: its own token)
    elif flags.top_p or flags.min_p:
        return sample(model.logits(rows), st, flags, kernels)
    else:  # a top-k cut: the screen computes about k logits a row, so a larger k takes the sampler
        tokens = jax.lax.cond(jnp.any(needs_logits(st, head.vocab)),
                              lambda: sample(model.logits(rows), st, flags, kernels)[0],
                              lambda: head(rows, st.temperature, keys, st.top_k))
    return tokens, jnp.zeros((r,)), jnp.zeros((r, 0), jnp.int32), jnp.zeros((r, 0))


def draw_apart(model, rows: jax.Array, at: jax.Array, st: SamplingTensors, flags: SamplerFlags,
               kernels: SamplingKernels | None) -> jax.Array:
    """The tokens of rows `at` i32[N] of rows f32[R, hidden] from the float32 head and the sampler
    -> i32[N]."""
    return sample(model.logits(rows[at]), jax.tree.map(lambda a: a[at], st), flags, kernels)[0]
