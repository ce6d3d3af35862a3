"""The paged attention reference against dense attention (torch), and a paged forward of the model
(chunked prefill, then decodes, pages scattered) against the plain forward."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from worker.engine import paged_attention as pa
from worker.models.config import ModelConfig
from worker.models.loader import build_model

PAGE = 4
write_kv = jax.jit(pa.write_kv)
write_keys = jax.jit(pa.write_keys)
# page shapes the kernel tests run on: plain loops (page size not a multiple of 16, head_dim 8) and
# the vector path (16-key runs; head_dim 32, and 80: an odd number of 16-lane vectors)
# (page size, head dim): plain loops; vectors with 16-key runs; an odd head dim; 64-key runs (the
# CPU default page size)
KERNEL_SHAPES = {"loops": (4, 8), "vectors": (16, 32), "vectors-80": (16, 80), "pages-64": (64, 64)}
paged_attention = jax.jit(pa.paged_attention, static_argnames="window")


def dense_reference(q, k, v, window):
    """torch SDPA over one whole sequence: q [L, H, D], k/v [L, KV, D] -> [L, H, D]."""
    length, heads, _ = q.shape
    group = heads // k.shape[1]
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    mask = (j <= i) & ((i - j) < window if window else True)
    as_heads = lambda x: torch.tensor(x).transpose(0, 1)  # [H, L, D]
    out = torch.nn.functional.scaled_dot_product_attention(
        as_heads(q), as_heads(k).repeat_interleave(group, 0), as_heads(v).repeat_interleave(group, 0),
        attn_mask=torch.tensor(mask),
    )
    return out.transpose(0, 1).numpy()


@pytest.mark.parametrize("window", [None, 3, 1])
def test_paged_attention_equals_dense_causal_attention(window):
    rng = np.random.default_rng(0)
    heads, kv_heads, dim, num_pages = 4, 2, 8, 16
    lengths = [13, 6, 16]
    queried = [range(9, 13), range(0, 6), range(15, 16)]  # a later prefill chunk, a whole prompt, a decode
    width, q_len = 4, 6  # page-table width, query rows per sequence (padded)
    # pages start full of garbage: only what the page tables and context lengths name may be read
    k_pages = jnp.asarray(rng.standard_normal((kv_heads, num_pages, dim, PAGE)), jnp.float32) * 50
    v_pages = jnp.asarray(rng.standard_normal((kv_heads, num_pages, PAGE, dim)), jnp.float32) * 50
    free = list(rng.permutation(np.arange(1, num_pages)))  # page 0 stays reserved
    tables = np.zeros((3, width), np.int32)
    seqs, q = [], np.zeros((3, q_len, heads, dim), np.float32)
    positions = np.zeros((3, q_len), np.int32)
    for s, length in enumerate(lengths):
        pages = [int(free.pop()) for _ in range(-(-length // PAGE))]
        tables[s, : len(pages)] = pages
        sq = rng.standard_normal((length, heads, dim)).astype(np.float32)
        sk = rng.standard_normal((length, kv_heads, dim)).astype(np.float32)
        sv = rng.standard_normal((length, kv_heads, dim)).astype(np.float32)
        pos = np.arange(length)
        slots = jnp.asarray(np.asarray(pages)[pos // PAGE] * PAGE + pos % PAGE, jnp.int32)
        k_pages, v_pages = write_keys(k_pages, jnp.asarray(sk), slots), write_kv(v_pages, jnp.asarray(sv), slots)
        rows = list(queried[s])
        q[s, : len(rows)], positions[s, : len(rows)] = sq[rows], rows
        seqs.append((sq, sk, sv, rows))
    out = np.asarray(paged_attention(jnp.asarray(q), k_pages, v_pages, jnp.asarray(tables), jnp.asarray(positions),
                                     jnp.asarray(lengths, jnp.int32), window))
    for s, (sq, sk, sv, rows) in enumerate(seqs):
        ref = dense_reference(sq, sk, sv, window)[rows]
        np.testing.assert_allclose(out[s, : len(rows)], ref, rtol=1e-5, atol=1e-5, err_msg=f"sequence {s}")


def test_write_kv_puts_each_token_in_its_slot():
    pages = jnp.zeros((2, 5, PAGE, 2), jnp.float32)  # [KV, pages, page_size, D]
    new = jnp.arange(12, dtype=jnp.float32).reshape(3, 2, 2) + 1  # [T, KV, D]
    out = np.asarray(write_kv(pages, new, jnp.asarray([3 * PAGE + 2, 1 * PAGE + 0, 4 * PAGE + 3], jnp.int32)))
    for t, (page, offset) in enumerate([(3, 2), (1, 0), (4, 3)]):
        for head in range(2):
            assert out[head, page, offset].tolist() == np.asarray(new[t, head]).tolist()
    assert np.count_nonzero(out) == 12


def test_write_keys_puts_each_token_in_its_column_of_the_transposed_page():
    pages = jnp.zeros((2, 5, 3, PAGE), jnp.float32)  # [KV, pages, D, page_size]
    new = jnp.arange(18, dtype=jnp.float32).reshape(3, 2, 3) + 1  # [T, KV, D]
    out = np.asarray(write_keys(pages, new, jnp.asarray([3 * PAGE + 2, 1 * PAGE + 0, 4 * PAGE + 3], jnp.int32)))
    for t, (page, offset) in enumerate([(3, 2), (1, 0), (4, 3)]):
        for head in range(2):
            assert out[head, page, :, offset].tolist() == np.asarray(new[t, head]).tolist()
    assert np.count_nonzero(out) == 18
    bits = write_keys(jnp.zeros((2, 5, 3, PAGE), pa.BF16_BITS), new, jnp.asarray([2, 5, 9], jnp.int32))
    assert np.asarray(pa.key_rows(bits[:, 0])[:, 2]).astype(np.float32).tolist() == np.asarray(new[0]).tolist()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_padding_tokens_write_nothing_and_the_scatters_promise_distinct_indices(dtype):
    rng = np.random.default_rng(7)
    kv, n, d = 2, 6, 3
    store = pa.storage_dtype(dtype)
    k_pages = pa.stored(jnp.asarray(rng.standard_normal((kv, n, d, PAGE), np.float32)), store)
    v_pages = pa.stored(jnp.asarray(rng.standard_normal((kv, n, PAGE, d), np.float32)), store)
    k, v = (jnp.asarray(rng.standard_normal((7, kv, d), np.float32)) for _ in range(2))  # [T, KV, D]
    # three padding tokens (slot 0) among real ones, and one real token in the last slot of the cache
    slots = jnp.asarray([0, 2 * PAGE + 1, 0, 5 * PAGE + 3, 1 * PAGE, 0, 2 * PAGE + 2], jnp.int32)
    got_k, got_v = (np.asarray(a) for a in jax.jit(pa.write_pages)(k_pages, v_pages, k, v, slots))
    want_k, want_v = np.asarray(k_pages).copy(), np.asarray(v_pages).copy()
    for t, slot in enumerate(np.asarray(slots)):
        if slot:
            want_k[:, slot // PAGE, :, slot % PAGE] = np.asarray(pa.stored(k[t], store))
            want_v[:, slot // PAGE, slot % PAGE] = np.asarray(pa.stored(v[t], store))
    np.testing.assert_array_equal(got_k, want_k)  # page 0 included: left as it was
    np.testing.assert_array_equal(got_v, want_v)
    # XLA may then write without atomics (a compare-and-swap loop per 16-bit element on a GPU)
    hlo = jax.jit(pa.write_pages).lower(k_pages, v_pages, k, v, slots).as_text()
    assert hlo.count("unique_indices = true") == 2, hlo


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_page_writes_equal_the_jnp_scatters_in_place(dtype):
    from worker.engine import cpu_attention

    assert cpu_attention.load(), "the CPU attention kernels did not build"
    rng = np.random.default_rng(4)
    kv, n, d, ps = 3, 9, 8, 4
    store = pa.storage_dtype(dtype)
    k_pages = pa.stored(jnp.asarray(rng.standard_normal((kv, n, d, ps), np.float32)), store)
    v_pages = pa.stored(jnp.asarray(rng.standard_normal((kv, n, ps, d), np.float32)), store)
    k, v = (jnp.asarray(rng.standard_normal((6, kv, d), np.float32)) for _ in range(2))  # [T, KV, D]
    # distinct slots across pages, a padding token (slot 0, the reserved page), one past the cache
    slots = jnp.asarray([5 * ps + 3, 1 * ps, 8 * ps + 1, 0, 5 * ps + 2, n * ps + 1], jnp.int32)
    want_k, want_v = jax.jit(pa.write_pages)(k_pages, v_pages, k, v, slots)
    write = jax.jit(cpu_attention.write_pages, donate_argnums=(0, 1))
    got_k, got_v = write(jnp.array(k_pages), jnp.array(v_pages), k, v, slots)
    np.testing.assert_array_equal(np.asarray(got_k), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    # not donated: the operands are left as they were (XLA copies them for the aliased results)
    kept = jnp.array(k_pages)
    again_k, _ = jax.jit(cpu_attention.write_pages)(kept, v_pages, k, v, slots)
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(k_pages))
    np.testing.assert_array_equal(np.asarray(again_k), np.asarray(want_k))


def test_kernel_writes_a_long_prefill_chunk_like_the_jnp_scatter():
    # 300 tokens x 3 KV heads: several work items of the kernel, each along one head's pages;
    # the chunk starts mid-page and two padding tokens point at the reserved page
    from worker.engine import cpu_attention

    assert cpu_attention.load(), "the CPU attention kernels did not build"
    rng = np.random.default_rng(5)
    kv, n, d, ps = 3, 24, 16, 16
    k_pages = jnp.asarray(rng.standard_normal((kv, n, d, ps), np.float32))
    v_pages = jnp.asarray(rng.standard_normal((kv, n, ps, d), np.float32))
    k, v = (jnp.asarray(rng.standard_normal((302, kv, d), np.float32)) for _ in range(2))
    slots = jnp.asarray(np.concatenate([np.arange(300) + 2 * ps + 5, [0, 0]]).astype(np.int32))
    want_k, want_v = jax.jit(pa.write_pages)(k_pages, v_pages, k, v, slots)
    got_k, got_v = jax.jit(cpu_attention.write_pages, donate_argnums=(0, 1))(jnp.array(k_pages), jnp.array(v_pages),
                                                                              k, v, slots)
    real = np.arange(n) > 0  # the reserved page 0 holds whichever padding write came last
    np.testing.assert_array_equal(np.asarray(got_k)[:, real], np.asarray(want_k)[:, real])
    np.testing.assert_array_equal(np.asarray(got_v)[:, real], np.asarray(want_v)[:, real])


# ---- a paged forward of the real model, driven like the engine drives it ----

CFG = ModelConfig(
    architecture="Qwen2ForCausalLM", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128, qkv_bias=True,
    sliding_windows=(None, 5),  # the upper layer's window is shorter than the sequences and crosses pages
)


@partial(jax.jit, static_argnames=("rows", "q_len"))
def paged_forward(model, kv, tokens, positions, slots, tables, context_lens, rows: int, q_len: int):
    """tokens/positions/slots i32[rows * q_len] -> (logits f32[rows * q_len, V], kv)."""
    h, d = CFG.num_heads, CFG.head_dim

    def attend(layer, q, k, v, cache):
        keys, values = cache
        kp, vp = pa.write_keys(keys[layer], k, slots), pa.write_kv(values[layer], v, slots)
        out = pa.paged_attention(q.reshape(rows, q_len, h, d), kp, vp, tables, positions.reshape(rows, q_len),
                              context_lens, CFG.window(layer))
        return out.reshape(rows * q_len, h, d), (keys[:layer] + (kp,) + keys[layer + 1 :],
                                                 values[:layer] + (vp,) + values[layer + 1 :])

    hidden, kv = model.trunk(tokens, positions, attend, kv)
    return model.logits(hidden), kv


def test_paged_forward_with_chunks_and_decodes_equals_plain_forward():
    model = build_model(CFG, seed=1)
    rng = np.random.default_rng(1)
    num_pages, width = 24, 8
    seqs = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (19, 11)]
    order = rng.permutation(np.arange(1, num_pages))  # scattered, interleaved pages
    tables = np.zeros((2, width), np.int32)
    tables[0], tables[1] = order[:width], order[width : 2 * width]
    zeros = lambda *shape: tuple(jnp.zeros(shape) for _ in range(CFG.num_layers))  # noqa: E731
    kv_heads, d = CFG.num_kv_heads, CFG.head_dim
    kv = (zeros(kv_heads, num_pages, d, PAGE), zeros(kv_heads, num_pages, PAGE, d))  # (keys, values), per layer
    # prefill in uneven chunks (the second one starts mid-page), then 6 greedy decodes each
    chunks = [[(0, 6), (0, 3)], [(6, 13), (3, 11)], [(13, 19), None]]
    decodes = 6
    done = [0, 0]
    step_logits: list[list[tuple[int, np.ndarray]]] = [[], []]  # (position, logits) per sequence
    for step in range(len(chunks) + decodes):
        plan = chunks[step] if step < len(chunks) else [(len(s) - 1, len(s)) for s in seqs]
        q_len = 8 if step < len(chunks) else 1
        tokens, positions, slots = (np.zeros(2 * q_len, np.int32) for _ in range(3))
        ctx = np.zeros(2, np.int32)
        for s, part in enumerate(plan):
            if part is None:
                continue
            a, b = part
            pos = np.arange(a, b)
            tokens[s * q_len : s * q_len + b - a] = seqs[s][a:b]
            positions[s * q_len : s * q_len + b - a] = pos
            slots[s * q_len : s * q_len + b - a] = tables[s][pos // PAGE] * PAGE + pos % PAGE
            ctx[s] = b
        logits, kv = paged_forward(model, kv, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(slots),
                                   jnp.asarray(tables), jnp.asarray(ctx), rows=2, q_len=q_len)
        logits = np.asarray(logits)
        for s, part in enumerate(plan):
            if part is None:
                continue
            a, b = part
            for i in range(b - a):
                step_logits[s].append((a + i, logits[s * q_len + i]))
            done[s] = b
        if step >= len(chunks) - 1:  # every prompt is in: extend each sequence greedily
            for s in range(2):
                if done[s] == len(seqs[s]):
                    seqs[s].append(int(step_logits[s][-1][1].argmax()))
    batch = np.zeros((2, max(map(len, seqs))), np.int32)  # right-padded: rows are causal
    for s in range(2):
        batch[s, : len(seqs[s])] = seqs[s]
    plains = np.asarray(jax.jit(lambda m, t: m(t))(model, jnp.asarray(batch)))  # [2, L, V]
    for s in range(2):
        plain = plains[s]
        got = dict(step_logits[s])
        assert sorted(got) == list(range(len(seqs[s]) - 1))  # every position was computed exactly once
        paged = np.stack([got[p] for p in sorted(got)])
        scale = np.abs(plain).max()
        np.testing.assert_allclose(paged, plain[: len(paged)], rtol=0, atol=1e-5 * scale, err_msg=f"sequence {s}")


def decode_inputs(dtype, seed=7, ps=4, d=8, h=4, kv=2, contexts=None):
    """6 sequences over 40 scattered pages of `ps` tokens; contexts on and off page boundaries and a full
    table (or the 6 `contexts` given)."""
    rng = np.random.default_rng(seed)
    s, n, p = 6, 40, 6
    k_pages = jnp.asarray(rng.normal(size=(kv, n, d, ps)), dtype)
    v_pages = jnp.asarray(rng.normal(size=(kv, n, ps, d)), dtype)
    tables = jnp.asarray(rng.permutation(n)[: s * p].reshape(s, p), jnp.int32)
    ctx = jnp.asarray(contexts or [1, ps - 1, ps, 2 * ps + 1, 4 * ps + 1, 6 * ps], jnp.int32)
    q = jnp.asarray(rng.normal(size=(s, h, d)), jnp.float32)
    return q, k_pages, v_pages, tables, ctx


def reference_decode(q, k_pages, v_pages, tables, ctx, window):
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return paged_attention(q[:, None], f32(k_pages), f32(v_pages), tables, (ctx - 1)[:, None], ctx, window)[:, 0]


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("pages_per_block", [None, 1, 2])
def test_jnp_decode_path_matches_the_reference(window, pages_per_block):
    """The jnp decode path (online softmax over page blocks) against the reference it replaces."""
    q, k_pages, v_pages, tables, ctx = decode_inputs(jnp.float32)
    out = pa.paged_decode_attention(q, k_pages, v_pages, tables, ctx - 1, ctx, window, pages_per_block)
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference_decode(q, k_pages, v_pages, tables, ctx, window)),
                               atol=1e-5, rtol=1e-5)
