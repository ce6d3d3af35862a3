"""Which compiled step variant's sampler serves a batch: the sampler switches (SamplerFlags) a
variant was compiled with against those a batch needs. A batch runs in a compiled variant that
serves it instead of stopping its worker to compile its own (runner._choose_shape)."""

from __future__ import annotations

from dataclasses import replace

from worker.engine.sampler import SamplerFlags


def serves(compiled: SamplerFlags, needed: SamplerFlags) -> bool:
    """Whether a variant compiled with `compiled` flags gives a batch that needs `needed` the same
    tokens: sampling handles greedy rows (temperature 0 takes the argmax), the top-k/top-p filter
    keeps every token of rows with top_k 0 and top_p 1 and min-p's of rows with min_p 0, and
    logprobs computed but not asked for are not read back. Penalties and logit bias size the
    batch's arrays: a batch with them runs in a variant that has them (a row without leaves them
    at no-ops: penalties 0 and 1, no ids, bias entries adding 0), at widths at least the batch's;
    a batch without either runs only in variants without (their scatters over [R, V] cost)."""
    if compiled.penalties or compiled.bias or needed.penalties or needed.bias:
        if (not (needed.penalties or needed.bias) or needed.penalties > compiled.penalties
                or needed.bias > compiled.bias or any(c < n for c, n in zip(compiled.widths, needed.widths))):
            return False
    if compiled.mask_words != needed.mask_words:  # a grammar's mask: only its own arrays serve it
        return False
    if compiled.apart and not needed.apart:  # (its float32 head draws a few rows apart: too few for more)
        return False
    return ((needed.all_greedy or not compiled.all_greedy) and compiled.needs_cut >= needed.needs_cut
            and compiled.top_p >= needed.top_p and compiled.min_p >= needed.min_p
            and compiled.logprobs >= needed.logprobs and compiled.num_logprobs >= needed.num_logprobs)


def wider(compiled: SamplerFlags, needed: SamplerFlags) -> bool:
    """The same flags, with penalty and bias arrays at least as wide as `needed`'s."""
    return (replace(compiled, widths=needed.widths) == needed
            and all(c >= n for c, n in zip(compiled.widths, needed.widths)))
