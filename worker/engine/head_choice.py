"""Which LM head draws each row of a step: the screened head (screened_head.py) where it can, the
float32 head and the sampler for the rows it cannot.

The screened head draws greedy rows, plainly sampled rows and rows cut to a top-k of at most
SCREENED_TOP_K from a third of the float32 head's cost. A row needs every logit of its own
(sampler.needs_logits) for a top-p or min-p cut (its mass) or a larger top-k, for the logprobs of
its token (a log-softmax over the row), and for penalties or a logit bias (they move logits the
screen does not see). Until session 59 one such row sent the whole step to the float32 head: with
mixed traffic (some clients greedy or plain, some with top-p or logprobs), every step paid it. Now
a step where such rows are at most 1 / SPLIT_SHARE of its rows (`SamplerFlags.apart`, set on the
host where the model has a screened head) takes the screened head for all rows and the float32
head and the sampler for those rows alone, gathered: at llama-100m's shape 10.1 ms against 16.5
for the float32 head over 64 rows, 8 of them with top-p. Their tokens and logprobs replace the
screened ones. A step with more such rows takes the float32 head for all, as before. Either way
each row gets the token the float32 head and the sampler give it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from worker.engine import screened_head
from worker.engine.sampler import (SPLIT_SHARE, SamplerFlags, SamplingKernels, SamplingTensors,
                                  noise_keys, sample)


def next_tokens(model, rows: jax.Array, st: SamplingTensors, flags: SamplerFlags,
                kernels: SamplingKernels | None):
    """rows f32[R, hidden] -> (tokens i32[R], logprobs f32[R], top ids i32[R, N], top logprobs
    f32[R, N]) as sampler.sample gives them over the float32 head's logits; from the model's
    screened head (`greedy_head`) where it has one and the step's flags allow (`screened_head.serves`)."""
    head = getattr(model, "greedy_head", None)
    if (head is None or not (flags.apart or screened_head.serves(flags))
            or (flags.needs_cut and not head.cuts_top_k)):  # (a bfloat16 head's screen: no top-k)
        return sample(model.logits(rows), st, flags, kernels)
    r = rows.shape[0]
    keys = (jnp.zeros((r, 2), jnp.uint32) if flags.all_greedy  # (no row takes noise)
            else noise_keys(st.seed, st.choice, st.out_pos))
    if flags.apart:  # the few rows that need their logits drawn apart, the rest screened
        need = st.full_head != 0  # bool[R]
        at = jnp.nonzero(need, size=r // SPLIT_SHARE, fill_value=0)[0]  # i32[R / 4]: those rows, then row 0 again
        drawn = draw_apart(model, rows, at, st, flags, kernels)
        screened = head(rows, st.temperature, keys, jnp.where(need, 0, st.top_k) if flags.needs_cut else None)
        tokens = screened.at[at].set(jnp.where(need[at], drawn[0], screened[at]))  # (a repeated row 0: its own token)
        # logprobs only for the rows drawn apart (every row asking for them is one); a repeated row 0
        # writes its own values again, or values nobody reads back
        return tokens, *(jnp.zeros((r, *a.shape[1:]), a.dtype).at[at].set(a) for a in drawn[1:])
    if not (flags.needs_cut or flags.min_p):
        tokens = head(rows, st.temperature, keys)
    elif flags.top_p or flags.min_p:
        return sample(model.logits(rows), st, flags, kernels)
    else:  # a top-k cut: the screen computes about k logits a row, so a larger k takes the sampler
        tokens = jax.lax.cond(jnp.any(st.full_head != 0),
                              lambda: sample(model.logits(rows), st, flags, kernels)[0],
                              lambda: head(rows, st.temperature, keys, st.top_k))
    return tokens, jnp.zeros((r,)), jnp.zeros((r, 0), jnp.int32), jnp.zeros((r, 0))


def draw_apart(model, rows: jax.Array, at: jax.Array, st: SamplingTensors, flags: SamplerFlags,
               kernels: SamplingKernels | None):
    """Rows `at` i32[N] of rows f32[R, hidden] through the float32 head and the sampler -> (tokens
    i32[N], logprobs f32[N], top ids i32[N, M], top logprobs f32[N, M]) as sampler.sample gives them."""
    return sample(model.logits(rows[at]), jax.tree.map(lambda a: a[at], st), flags, kernels)
