"""The on-device sampler on hand-made logits: masks against transformers' logits warpers,
penalties against the OpenAI/HF formulas, and sampled frequencies against the target law."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from worker.engine import cpu_sampling, sampler
from worker.engine.sampler import SamplerFlags, SamplingTensors

# jitted whole: op-by-op dispatch would compile every primitive separately
sample = jax.jit(sampler.sample, static_argnames=("flags", "kernels"))
filter_logits = jax.jit(sampler.filter_logits, static_argnames=("flags", "kernels"))
apply_penalties = jax.jit(sampler.apply_penalties)

CUTTING = SamplerFlags(all_greedy=False, needs_cut=True, min_p=True)
# chi-square quantile at 1 - 1e-6 by degrees of freedom (scipy.stats.chi2.ppf(1 - 1e-6, df))
CHI2_1E6 = {2: 27.631, 3: 30.665, 4: 33.377, 5: 35.888, 6: 38.258, 7: 40.522, 8: 42.701, 9: 44.811}


@pytest.fixture(params=["jnp", "kernel"])
def kernels(request):
    """How sampled rows are cut and drawn: jnp (bisections, Gumbel noise in jnp; accelerators) or the compiled
    CPU kernels (the CPU backend; CI installs the compiler they need, so they must build)."""
    if request.param == "jnp":
        return None
    assert cpu_sampling.load(), "the sampling kernels did not build"
    return cpu_sampling.KERNELS


def tensors(rows: int, **fields) -> SamplingTensors:
    """Neutral sampling tensors for `rows` rows, with `fields` overriding (numpy or lists)."""
    base = dict(
        temperature=np.ones(rows, np.float32), top_k=np.zeros(rows, np.int32), top_p=np.ones(rows, np.float32),
        min_p=np.zeros(rows, np.float32), seed=np.zeros(rows, np.uint32), choice=np.zeros(rows, np.int32),
        out_pos=np.zeros(rows, np.int32), presence=np.zeros(rows, np.float32), frequency=np.zeros(rows, np.float32),
        repetition=np.ones(rows, np.float32), bias_ids=np.zeros((rows, 1), np.int32),
        bias_vals=np.zeros((rows, 1), np.float32), output_ids=np.full((rows, 1), -1, np.int32),
        prompt_ids=np.full((rows, 1), -1, np.int32), pending=np.full(rows, -1, np.int32),
        full_head=np.zeros(rows, np.int32), allowed=np.full((rows, 0), -1, np.int32),
    )
    for name, value in fields.items():
        if name != "bias_until":
            base[name] = np.asarray(value, base[name].dtype)
    # bias entries apply at every output position unless the test says until when
    base["bias_until"] = np.asarray(fields.get("bias_until", np.full(base["bias_ids"].shape, 2**31 - 1)), np.int32)
    return SamplingTensors(**{k: jnp.asarray(v) for k, v in base.items()})


def random_logits(rows: int, vocab: int, seed: int = 0) -> np.ndarray:
    """Distinct values (no ties at a cut) spread like real logits."""
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * 3.0).astype(np.float32)


def hf_kept(warper, logits_row: np.ndarray) -> np.ndarray:
    """Mask of tokens a transformers warper keeps (finite) for one row."""
    out = warper(torch.zeros((1, 1), dtype=torch.long), torch.tensor(logits_row[None]))
    return torch.isfinite(out[0]).numpy()


def ours_kept(logits: np.ndarray, t: SamplingTensors, flags: SamplerFlags = CUTTING, kernels=None) -> np.ndarray:
    return np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), t, flags, kernels)))


def test_top_k_mask_matches_transformers(kernels):
    logits = random_logits(5, 64)
    ks = [1, 2, 7, 64, 0]  # 0: disabled
    kept = ours_kept(logits, tensors(5, top_k=ks), kernels=kernels)
    for row, k in enumerate(ks):
        expected = hf_kept(TopKLogitsWarper(k), logits[row]) if k else np.ones(64, bool)
        np.testing.assert_array_equal(kept[row], expected, err_msg=f"top_k={k}")
        assert kept[row].sum() == (k or 64)


def test_top_p_mask_matches_transformers(kernels):
    logits = random_logits(6, 64, seed=1)
    ps = [1e-6, 0.1, 0.5, 0.8, 0.95, 1.0]
    kept = ours_kept(logits, tensors(6, top_p=ps), kernels=kernels)
    for row, p in enumerate(ps):
        np.testing.assert_array_equal(kept[row], hf_kept(TopPLogitsWarper(p), logits[row]), err_msg=f"top_p={p}")
    assert kept[0].sum() == 1 and kept[0][logits[0].argmax()]  # the most likely token always survives


def test_top_p_keeps_the_smallest_set_reaching_the_mass(kernels):
    probs = np.array([[0.5, 0.25, 0.125, 0.075, 0.05]], np.float32)
    logits = np.log(probs)
    for p, count in [(0.4, 1), (0.6, 2), (0.8, 3), (0.9, 4)]:
        assert ours_kept(logits, tensors(1, top_p=[p]), kernels=kernels)[0].tolist() == [i < count for i in range(5)], p


def test_min_p_mask_matches_transformers():
    logits = random_logits(4, 64, seed=2)
    mins = [0.0, 0.05, 0.3, 1.0]
    kept = ours_kept(logits, tensors(4, min_p=mins), SamplerFlags(all_greedy=False, min_p=True))
    for row, m in enumerate(mins):
        expected = hf_kept(MinPLogitsWarper(m), logits[row]) if m else np.ones(64, bool)
        np.testing.assert_array_equal(kept[row], expected, err_msg=f"min_p={m}")


def test_temperature_top_k_top_p_min_p_together_match_the_transformers_chain(kernels):
    logits = random_logits(3, 64, seed=3) / 3.0
    temps, ks, ps, mins = [0.5, 1.0, 2.0], [20, 10, 40], [0.9, 0.7, 0.95], [0.02, 0.1, 0.05]
    t = tensors(3, temperature=temps, top_k=ks, top_p=ps, min_p=mins)
    kept = ours_kept(logits / np.array(temps, np.float32)[:, None], t, kernels=kernels)
    for row in range(3):
        scores = torch.tensor(logits[row][None])
        for warper in (TemperatureLogitsWarper(temps[row]), TopKLogitsWarper(ks[row]), TopPLogitsWarper(ps[row]),
                       MinPLogitsWarper(mins[row])):
            scores = warper(torch.zeros((1, 1), dtype=torch.long), scores)
        expected = torch.isfinite(scores[0]).numpy()
        np.testing.assert_array_equal(kept[row], expected, err_msg=f"row {row}")
        assert 1 < expected.sum() < 64  # each row really cuts something and keeps a choice


def test_presence_and_frequency_penalties_follow_the_openai_formula():
    vocab = 10
    logits = random_logits(2, vocab, seed=4)
    outputs = np.array([[3, 3, 3, 7, -1, -1], [1, 2, 2, -1, -1, -1]], np.int32)  # -1: padding
    prompts = np.array([[5, 5, 9], [0, -1, -1]], np.int32)  # presence/frequency ignore the prompt
    t = tensors(2, presence=[0.5, -1.0], frequency=[0.25, 2.0], output_ids=outputs, prompt_ids=prompts)
    ours = np.asarray(apply_penalties(jnp.asarray(logits), t))
    expected = logits.copy()
    for row, (pres, freq) in enumerate([(0.5, 0.25), (-1.0, 2.0)]):
        counts = np.bincount(outputs[row][outputs[row] >= 0], minlength=vocab)
        expected[row] -= freq * counts + pres * (counts > 0)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-6)


def test_repetition_penalty_matches_transformers_over_prompt_and_output():
    vocab = 12
    logits = random_logits(3, vocab, seed=5)
    prompts = np.array([[1, 4, 4, 9], [2, -1, -1, -1], [-1, -1, -1, -1]], np.int32)
    outputs = np.array([[6, -1], [2, 11], [-1, -1]], np.int32)
    penalties = [1.5, 0.7, 3.0]
    t = tensors(3, repetition=penalties, output_ids=outputs, prompt_ids=prompts)
    ours = np.asarray(apply_penalties(jnp.asarray(logits), t))
    for row, penalty in enumerate(penalties):
        seen = np.concatenate([prompts[row], outputs[row]])
        seen = torch.tensor(seen[seen >= 0][None], dtype=torch.long)
        ref = RepetitionPenaltyLogitsProcessor(penalty)(seen, torch.tensor(logits[row][None]))[0].numpy()
        np.testing.assert_allclose(ours[row], ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(ours[2], logits[2])  # nothing seen: untouched


def test_logit_bias_steers_greedy_choice_but_not_reported_logprobs():
    logits = random_logits(3, 16, seed=6)
    low = logits.argmin(axis=-1)
    bias_ids = np.array([[low[0], 0], [3, 5], [0, 0]], np.int32)
    bias_vals = np.array([[100.0, 0.0], [-100.0, 50.0], [0.0, 0.0]], np.float32)  # row 2: padding only
    t = tensors(3, temperature=[0.0] * 3, bias_ids=bias_ids, bias_vals=bias_vals)
    flags = SamplerFlags(all_greedy=True, bias=True, logprobs=True, num_logprobs=2)
    tokens, chosen, top_ids, top_lps = (np.asarray(x) for x in sample(jnp.asarray(logits), t, flags))
    expected = logits.copy()
    for row in range(3):
        for tok, val in zip(bias_ids[row], bias_vals[row]):
            expected[row, tok] += val
    assert tokens.tolist() == expected.argmax(-1).tolist()
    assert tokens[0] == low[0] and tokens[1] == 5 and tokens[2] == logits[2].argmax()
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    np.testing.assert_allclose(chosen, raw[np.arange(3), tokens], atol=1e-5)
    assert top_ids.tolist() == np.argsort(-raw, axis=-1)[:, :2].tolist()
    np.testing.assert_allclose(top_lps, np.sort(raw, axis=-1)[:, ::-1][:, :2], atol=1e-5)


def test_greedy_rows_stay_greedy_beside_sampled_rows(kernels):
    logits = random_logits(4, 32, seed=7)
    # (row 2 asks for a cut too: a greedy row's token is its argmax whatever the cut)
    t = tensors(4, temperature=[0.0, 1.5, 0.0, 1.5], seed=[1, 2, 3, 4], top_k=[0, 5, 3, 0], top_p=[1, 1, 0.2, 1],
                min_p=[0, 0, 0.5, 0])
    tokens = np.asarray(sample(jnp.asarray(logits), t, CUTTING, kernels)[0])
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    assert tokens[1] in np.argsort(-logits[1])[:5]


def draws(logits_row: np.ndarray, n: int, flags: SamplerFlags, kernels=None, **fields) -> np.ndarray:
    """`n` draws from one distribution: the same row at output positions 0..n-1."""
    t = tensors(n, out_pos=np.arange(n), **{k: np.repeat(np.asarray(v)[None], n, axis=0) for k, v in fields.items()})
    return np.asarray(sample(jnp.asarray(np.repeat(logits_row[None], n, 0)), t, flags, kernels)[0])


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize(
    "fields",
    [
        dict(temperature=0.7, top_k=6),
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=1.0, min_p=0.08),
        dict(temperature=0.9),
    ],
    ids=["top_k", "top_p", "min_p", "temperature"],
)
def test_sampled_frequencies_match_the_filtered_distribution(fields, kernels):
    logits = np.array([2.0, 1.5, 1.2, 0.9, 0.5, 0.2, -0.1, -0.6, -1.0, -2.0], np.float32)
    n = 6000
    flags = SamplerFlags(all_greedy=False, needs_cut="top_k" in fields or "top_p" in fields, min_p="min_p" in fields)
    tokens = draws(logits, n, flags, kernels, seed=11, **fields)
    counts = np.bincount(tokens, minlength=len(logits))
    # the target law, written out independently: temperature, then the cut, renormalised
    scaled = logits / fields["temperature"]
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if "top_k" in fields:
        keep = np.arange(len(logits)) < fields["top_k"]
    elif "top_p" in fields:
        keep = (np.cumsum(probs) - probs) < fields["top_p"]
    elif "min_p" in fields:
        keep = probs >= fields["min_p"] * probs.max()
    else:
        keep = np.ones(len(logits), bool)
    assert 2 < keep.sum() <= len(logits)
    assert counts[~keep].sum() == 0, "a filtered-out token was drawn"
    target = np.where(keep, probs, 0) / probs[keep].sum()
    stat = chi_square(counts[keep], target[keep])
    assert stat < CHI2_1E6[int(keep.sum()) - 1], f"chi-square {stat:.1f}: counts {counts}, target {target * n}"


def sorted_kept(logits: np.ndarray, top_k: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """The top-k/top-p rules written as a descending sort in numpy float32 (the jnp sampler's own
    code until session 51): bool[R, V], what each row keeps."""
    kept = np.zeros(logits.shape, bool)
    for row, (x, k, p) in enumerate(zip(logits, top_k, top_p)):
        ordered = np.sort(x)[::-1]
        k = min(k, len(x)) if k > 0 else len(x)
        top = np.where(np.arange(len(x)) < k, ordered, -np.inf).astype(np.float32)
        probs = np.exp(top - top[0]).astype(np.float32)
        probs /= probs.sum(dtype=np.float32)
        before = np.cumsum(probs, dtype=np.float32) - probs  # mass strictly above each sorted token
        keep = (before < p) | (p >= 1.0) | (np.arange(len(x)) == 0)
        p_cut = top[np.flatnonzero(keep).max()]
        kept[row] = (x >= ordered[k - 1]) & (x >= p_cut)
    return kept


def test_cutoffs_equal_a_descending_sort_with_ties_and_large_vocabularies(kernels):
    """Both paths keep exactly the tokens a descending sort keeps: rows with ties at the cut
    (rounded logits, -0.0 beside 0.0), flat and peaked rows, values past float32's resolution of
    their differences, top_k past the vocabulary, top_p 1, and vocabularies large enough for the
    kernel's every path: the top-k set kept in a buffer (top_k <= 256) or selected, and the top-p
    cut by value buckets (a flat row of 32000 keeps most of them)."""
    rng = np.random.default_rng(12)
    for trial in range(64):
        rows, vocab = 16, (7, 50, 4096, 32000)[trial % 4]
        scale = rng.choice([1e-3, 0.1, 1.0, 5.0, 30.0, 1e30])
        logits = (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)
        if trial % 2:
            logits = np.round(logits * rng.choice([1.0, 64.0])) if scale < 1e30 else logits + np.float32(3e37)  # ties
        top_k = rng.choice([0, 1, 2, 5, 40, 256, 300, 2000, vocab + 3], rows)
        top_p = rng.choice([1e-6, 0.3, 0.9, 0.95, 0.99, 1.0], rows)
        np.testing.assert_array_equal(ours_kept(logits, tensors(rows, top_k=top_k, top_p=top_p), kernels=kernels),
                                      sorted_kept(logits, top_k, top_p.astype(np.float32)), err_msg=f"trial {trial}")


def draw_fn(kernels):
    return jax.jit(kernels.draw if kernels is not None else sampler.gumbel_draw)


def random_keys(rng, rows: int) -> np.ndarray:
    return rng.integers(0, 2**32, (rows, 2), dtype=np.uint32)


def test_the_noise_is_gumbel_distributed_and_independent_across_tokens_and_keys():
    """The hashed noise against the Gumbel law (Kolmogorov-Smirnov distance over a million values),
    with no correlation between neighbouring tokens, between rows with neighbouring keys, or
    between a row's tokens j and j + 2^k."""
    keys = np.stack([np.arange(64, dtype=np.uint32), np.full(64, 7, np.uint32)], axis=1)  # neighbouring keys
    g = np.asarray(jax.jit(sampler.gumbel_noise, static_argnums=1)(jnp.asarray(keys), 16384), np.float64)
    assert np.isfinite(g).all() and g.max() < 17.4 and g.min() > -2.9  # 24-bit uniforms in (0, 1)
    values = np.sort(g.ravel())
    law = np.exp(-np.exp(-values))
    n = len(values)
    ks = max((np.arange(1, n + 1) / n - law).max(), (law - np.arange(n) / n).max())
    assert ks < 1.95 / np.sqrt(n), f"KS distance {ks:.2e}"  # p ~ 1e-3 for a true Gumbel
    assert abs(g.mean() - np.euler_gamma) < 0.01 and abs(g.std() - np.pi / np.sqrt(6)) < 0.01
    z = (g - g.mean()) / g.std()
    bound = 5 / np.sqrt(z.size)  # 5 standard errors of a correlation
    for shift in (1, 2, 16, 1024):
        assert abs((z[:, :-shift] * z[:, shift:]).mean()) < bound, shift
    assert abs((z[:-1] * z[1:]).mean()) < bound


@pytest.mark.parametrize("vocab", [300, 4096, 7])  # a partial last vector; whole vectors; less than one
def test_the_draw_is_the_first_largest_logit_plus_scaled_noise(kernels, vocab):
    """Each row takes the first largest of logit_j + T g_j (g from the jnp noise, the same hash; the
    kernel's logarithm may differ by an ulp, so a row whose two largest are within rounding may
    take either); masked (-inf) entries are never drawn; T = 0 takes the argmax; a NaN gives V - 1."""
    rng = np.random.default_rng(3)
    rows = 64
    logits = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    logits[rng.random(logits.shape) < 0.3] = -np.inf  # masked by a cut
    logits[np.arange(rows), rng.integers(0, vocab, rows)] = 1.0  # every row keeps one
    temperature = rng.choice([0.0, 0.1, 0.7, 1.0, 3.0], rows).astype(np.float32)
    keys = random_keys(rng, rows)
    logits[5, 3] = np.nan
    got = np.asarray(draw_fn(kernels)(jnp.asarray(logits), jnp.asarray(temperature), jnp.asarray(keys)))
    noise = np.asarray(sampler.gumbel_noise(jnp.asarray(keys), vocab), np.float64)
    noisy = np.where(np.isinf(logits), -np.inf, logits + temperature[:, None].astype(np.float64) * noise)
    ordered = np.sort(np.nan_to_num(noisy, nan=-np.inf), axis=1)
    close = ordered[:, -1] - ordered[:, -2] < 1e-5 * (1 + np.abs(ordered[:, -1]))
    want = np.nan_to_num(noisy, nan=-np.inf).argmax(axis=1)
    assert got[5] == vocab - 1
    ok = np.arange(rows) != 5
    assert np.isfinite(logits[ok, got[ok]]).all()
    assert ((got == want) | close)[ok].all(), np.flatnonzero((got != want) & ~close & ok)
    greedy = ok & (temperature == 0)
    np.testing.assert_array_equal(got[greedy], np.nan_to_num(logits, nan=-np.inf)[greedy].argmax(axis=1))


def test_jnp_and_kernel_draw_the_same_token_for_a_seed():
    """One rule on both paths: for the same keys, the accelerators' jnp draw and the CPU kernel's give
    the same token, unless the row's two largest noisy logits are within rounding (then either is
    right). So a request keeps its seeded tokens on any worker of a fleet."""
    assert cpu_sampling.load(), "the sampling kernels did not build"
    rng = np.random.default_rng(21)
    rows, vocab = 512, 4096
    logits = (rng.standard_normal((rows, vocab)) * rng.choice([0.5, 2.0, 6.0], (rows, 1))).astype(np.float32)
    logits[rng.random(logits.shape) < 0.2] = -np.inf
    args = (jnp.asarray(logits), jnp.asarray(rng.choice([0.3, 1.0, 1.7], rows).astype(np.float32)),
            jnp.asarray(random_keys(rng, rows)))
    jnp_tokens = np.asarray(draw_fn(None)(*args))
    kernel_tokens = np.asarray(draw_fn(cpu_sampling.KERNELS)(*args))
    noisy = np.asarray(args[0]) + np.asarray(args[1])[:, None] * np.asarray(sampler.gumbel_noise(args[2], vocab))
    ordered = np.sort(noisy, axis=1)
    gap = ordered[:, -1] - ordered[:, -2]
    differ = np.flatnonzero(jnp_tokens != kernel_tokens)
    assert (gap[differ] < 1e-5).all(), f"rows {differ}: gaps {gap[differ]}"
    assert len(differ) <= 5, f"{len(differ)} of {rows} rows differ"


def test_draws_depend_on_seed_choice_and_position_only(kernels):
    logits = np.zeros(64, np.float32)  # uniform: any correlation between streams would show
    flags = SamplerFlags(all_greedy=False)
    base = draws(logits, 256, flags, kernels, seed=5)
    assert np.array_equal(base, draws(logits, 256, flags, kernels, seed=5))
    for other in (draws(logits, 256, flags, kernels, seed=6), draws(logits, 256, flags, kernels, seed=5, choice=1)):
        assert (other == base).mean() < 0.1  # chance agreement is 1/64
    # one row's draw does not depend on which row it sits in or on its neighbours
    t = tensors(3, seed=[5, 9, 5], out_pos=[17, 17, 40], choice=[0, 0, 0])
    mixed = np.asarray(sample(jnp.asarray(np.zeros((3, 64), np.float32)), t, flags, kernels)[0])
    assert mixed[0] == base[17] and mixed[2] == base[40]


def test_a_rows_draw_ignores_what_its_neighbours_ask_for(kernels):
    """Penalties, bias, top-k/top-p and greedy rows beside it (a different compiled variant) leave a
    plain sampled row's draw unchanged."""
    logits = np.repeat(random_logits(1, 32, seed=8), 4, axis=0)  # one distribution; only row settings differ
    alone = int(sample(jnp.asarray(logits[:1]), tensors(1, seed=[21], out_pos=[3], temperature=[0.8]),
                       SamplerFlags(all_greedy=False), kernels)[0][0])
    busy = tensors(
        4, seed=[21] * 4, out_pos=[3] * 4, temperature=[0.8, 0.8, 0.0, 0.8], top_k=[0, 3, 0, 0],
        top_p=[1.0, 1.0, 0.5, 1.0], presence=[0, 0, 1.0, 0], repetition=[1, 1.5, 1, 1],
        output_ids=[[-1, -1], [4, 4], [9, -1], [-1, -1]], prompt_ids=[[-1], [2], [-1], [-1]],
        bias_ids=[[0], [7], [0], [0]], bias_vals=[[0.0], [5.0], [0.0], [0.0]],
    )
    flags = SamplerFlags(all_greedy=False, needs_cut=True, penalties=True, bias=True, logprobs=True, num_logprobs=3)
    tokens = np.asarray(sample(jnp.asarray(logits), busy, flags, kernels)[0])
    assert tokens[0] == alone and tokens[3] == alone
    assert tokens[2] == logits[2].argmax()


@pytest.mark.parametrize("v", [1000, 32000, 7])  # a tail past the 16-lane blocks; a row shorter than one
def test_greedy_argmax_equals_numpy_including_ties_infinities_and_nans(kernels, v):
    from worker.engine.sampler import first_argmax

    argmax = jax.jit(kernels.argmax if kernels is not None else first_argmax)
    rng = np.random.default_rng(5)
    x = rng.integers(-3, 3, (64, v)).astype(np.float32)  # many ties: the first maximum wins
    x[7] = -1e30  # all equal
    x[8] = -np.inf  # all masked
    x[9, -1] = np.inf
    x[10, v // 2] = np.inf  # two infinite maxima: the first
    x[10, -1] = np.inf
    x[11, -1] = 100.0  # the maximum in the tail
    x[12] = rng.standard_normal(v).astype(np.float32)  # no ties
    want = x.argmax(-1)
    x[13, v // 3] = np.nan  # a NaN anywhere: the last index, on both paths
    want[13] = v - 1
    np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(x))), want)


@pytest.mark.parametrize("v,n", [(1000, 20), (32000, 5), (7, 7), (17, 1)])  # tails past the 16-lane blocks
def test_kernel_top_n_equals_lax_top_k_including_ties_and_infinities(v, n):
    """Logprobs' alternatives on the CPU come from the top-N kernel: the same values and ids as
    jax.lax.top_k, in its order (descending, equal values by lower index)."""
    assert cpu_sampling.load(), "the sampling kernels did not build"
    rng = np.random.default_rng(6)
    x = rng.integers(-3, 3, (64, v)).astype(np.float32)  # many ties
    x[7] = -1e30  # all equal
    x[8] = -np.inf  # all masked
    x[9, : v // 2] = -np.inf  # half masked
    x[10, -1] = np.inf
    x[11, -1] = 100.0  # the largest in the tail
    x[12] = rng.standard_normal(v).astype(np.float32)  # no ties
    x[13] = np.sort(x[12])  # ascending: every value a new largest
    got = jax.jit(lambda a: cpu_sampling.top_n(a, n))(jnp.asarray(x))
    want = jax.jit(lambda a: jax.lax.top_k(a, n))(jnp.asarray(x))
    for ours, theirs in zip(got, want):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_reported_logprobs_are_the_raw_log_softmax_and_its_top_n(kernels):
    """Each row's logprob of its token and its 5 most likely tokens (ties by lower id), greedy and
    sampled rows alike, on the jnp path and through the CPU kernels."""
    logits = random_logits(4, 300, seed=8)
    logits[1, [3, 50, 200]] = logits[1].max() + 1.0  # three equal largest
    t = tensors(4, temperature=[0.0, 0.0, 1.0, 0.7], seed=[1, 2, 3, 4])
    flags = SamplerFlags(all_greedy=False, logprobs=True, num_logprobs=5)
    tokens, chosen, top_ids, top_lps = (np.asarray(x) for x in sample(jnp.asarray(logits), t, flags, kernels))
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    np.testing.assert_allclose(chosen, raw[np.arange(4), tokens], atol=1e-6)
    order = np.argsort(-raw, axis=-1, kind="stable")[:, :5]
    assert top_ids.tolist() == order.tolist() and order[1, :3].tolist() == [3, 50, 200]
    np.testing.assert_allclose(top_lps, np.take_along_axis(raw, order, -1), atol=1e-6)


def test_min_tokens_bans_hold_until_their_output_position_as_transformers_min_new_tokens():
    """Bias entries with an `until` (min_tokens' bans on EOS and stop ids) against transformers'
    MinNewTokensLengthLogitsProcessor, over output positions before, at and after the limit."""
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    logits = random_logits(4, 16, seed=8)
    eos = [int(logits[0].argmax()), int(np.argsort(logits[0])[-2])]  # the two likeliest tokens of every row
    logits[1:] = logits[0]
    prompt_len, min_new = 5, 3
    out_pos = np.array([0, 2, 3, 7], np.int32)
    keep = 2**31 - 1
    plain = int(logits[0].argmin())  # a plain logit_bias entry, too small to win
    bias_ids = np.array([[eos[0], eos[1], plain]] * 4, np.int32)
    bias_vals = np.array([[-np.inf, -np.inf, 2.0]] * 4, np.float32)
    bias_until = np.array([[min_new, min_new, keep]] * 4, np.int32)
    t = tensors(4, temperature=[0.0] * 4, out_pos=out_pos, bias_ids=bias_ids, bias_vals=bias_vals,
                bias_until=bias_until)  # fmt: skip
    tokens = np.asarray(sample(jnp.asarray(logits), t, SamplerFlags(all_greedy=True, bias=True))[0])
    reference = MinNewTokensLengthLogitsProcessor(prompt_len, min_new, eos)
    for row, pos in enumerate(out_pos):
        seen = torch.zeros((1, prompt_len + int(pos)), dtype=torch.long)
        expected = reference(seen, torch.tensor(logits[row][None]))[0].numpy().copy()
        expected[plain] += 2.0
        assert tokens[row] == expected.argmax(), row
    assert tokens[0] not in eos and tokens[1] not in eos and tokens[2] == eos[0] and tokens[3] == eos[0]


@pytest.mark.parametrize("v", [64, 100])  # (100: a last word only part used)
def test_a_grammar_mask_limits_greedy_and_sampled_rows_to_its_tokens(kernels, v):
    """Bitmask rows as llguidance writes them (token t: bit t % 32 of word t // 32): greedy rows
    take the likeliest allowed token, sampled rows draw only allowed ones, an all-ones row is
    unconstrained, and the reported logprobs stay the model's own."""
    import llguidance.numpy

    rng = np.random.default_rng(3)
    allowed = [rng.choice(v, size=k, replace=False) for k in (1, 5, 17)] + [np.arange(v)]
    words = -(-v // 32)
    masks = np.zeros((4, words), np.int32)
    for row, ids in enumerate(allowed):
        for t in ids:
            masks[row, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    reference = np.zeros((4, v), np.float32)
    llguidance.numpy.apply_token_bitmask_inplace(reference, masks)  # the bit layout is llguidance's own
    np.testing.assert_array_equal(np.isfinite(reference), [np.isin(np.arange(v), ids) for ids in allowed])
    logits = random_logits(4, v, seed=4)
    for greedy in (True, False):
        flags = SamplerFlags(all_greedy=greedy, logprobs=True, mask_words=words)
        for draw in range(1 if greedy else 20):
            t = tensors(4, temperature=[0.0 if greedy else 1.0] * 4, seed=[draw] * 4, allowed=masks)
            tokens, lps, _, _ = sampler.sample(jnp.asarray(logits), t, flags, kernels)
            for row, ids in enumerate(allowed):
                assert int(tokens[row]) in ids
                if greedy:
                    assert int(tokens[row]) == ids[np.argmax(logits[row, ids])]
            raw = jax.nn.log_softmax(logits, axis=-1)[np.arange(4), np.asarray(tokens)]
            np.testing.assert_allclose(np.asarray(lps), raw, rtol=1e-5)

