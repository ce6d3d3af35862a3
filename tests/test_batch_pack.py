"""The batch's host arrays handed to the step as one i32 buffer (`batch.pack`) and recovered inside
it (`batch.unpack`): every array comes back with its shape, dtype and bits."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from worker.engine.batch import StepShape, empty_batch, pack, unpack
from worker.engine.sampler import SamplerFlags

SHAPE = StepShape(num_decode=8, num_prefill=2, prefill_len=16, pages=6, decode_steps=1, prompt_logprobs=True,
                  page_size=16, max_rows=64)
FLAGS = SamplerFlags(all_greedy=False, needs_cut=True, penalties=True, bias=True, num_logprobs=3, logprobs=True,
                     widths=(64, 40, 8))


def random_batch(rng: np.random.Generator):
    """A batch of SHAPE and FLAGS with random bits in every array (NaNs and seeds over 2**31 included)."""
    def fill(a: np.ndarray) -> np.ndarray:
        bits = rng.integers(0, 2**32, a.shape, dtype=np.uint64).astype(np.uint32)
        return bits.view(a.dtype)
    return jax.tree.map(fill, empty_batch(SHAPE, FLAGS))


def test_every_array_comes_back_bit_for_bit_from_the_jitted_unpack():
    db = random_batch(np.random.default_rng(0))
    buf = pack(db)
    leaves = jax.tree_util.tree_leaves(db)
    assert buf.dtype == np.int32 and buf.shape == (sum(a.size for a in leaves),)
    assert {a.dtype for a in leaves} == {np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.uint32)}
    back = jax.jit(unpack, static_argnums=(1, 2))(buf, SHAPE, FLAGS)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(db)
    for name, want, got in zip(_names(db), leaves, jax.tree_util.tree_leaves(back)):
        got = np.asarray(got)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=name)


def test_a_buffer_of_another_variant_is_refused_when_the_step_is_traced():
    buf = pack(random_batch(np.random.default_rng(1)))
    with pytest.raises(ValueError, match="a buffer of"):
        jax.jit(unpack, static_argnums=(1, 2))(buf[:-1], SHAPE, FLAGS)
    with pytest.raises(ValueError, match="a buffer of"):  # the same arrays, another page-table width
        jax.jit(unpack, static_argnums=(1, 2))(buf, StepShape(8, 2, 16, 7, 1, True, 16, 64), FLAGS)


def test_only_32_bit_arrays_are_packed():
    db = empty_batch(SHAPE, FLAGS)
    wide = jax.tree.map(lambda a: a, db)
    object.__setattr__(wide, "tokens", db.tokens.astype(np.int64))
    with pytest.raises(TypeError, match="32 bits"):
        pack(wide)


def _names(db) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(db)[0]]
