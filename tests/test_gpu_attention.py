"""The Pallas/Triton decode attention kernel (worker/engine/gpu_attention.py) against the jnp
reference (itself held to torch in test_paged_attention.py) and, inside a running engine, against
transformers; and lowered for CUDA to check it becomes one Triton kernel. On a GPU the kernel runs
compiled; elsewhere (CI) through Pallas's interpreter, which runs the same kernel code."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.engine_support import drain, hf_greedy, tokenizer  # noqa: F401 (a fixture)
from tests.hf_models import make_hf_model
from worker.engine import gpu_attention, gpu_prefill, paged_attention as pa
from worker.engine.attention_choice import AttentionUnavailable, choose_attention
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.models.loader import load_model

ON_GPU = jax.default_backend() == "gpu"
decode = partial(gpu_attention.pallas_decode_attention, interpret=not ON_GPU)
PREFILL_KERNEL = partial(gpu_prefill.pallas_prefill_attention, interpret=not ON_GPU)
KERNEL = gpu_attention.PALLAS if ON_GPU else pa.AttentionOps("pallas-interpret", decode, gpu_prefill.prefill_attention,
                                                              reads_own_context=False)


def pages_and_queries(rng, heads, kv_heads, dim, page_size, num_pages, width, rows, stored=jnp.float32):
    """Random pages (garbage everywhere: only what the tables and lengths name may be read)."""
    k = rng.standard_normal((kv_heads, num_pages, dim, page_size), dtype=np.float32) * 3
    v = rng.standard_normal((kv_heads, num_pages, page_size, dim), dtype=np.float32) * 3
    to = (lambda x: pa.stored(jnp.asarray(x), pa.BF16_BITS)) if stored == pa.BF16_BITS else jnp.asarray
    tables = rng.permutation(np.arange(1, num_pages))[: rows * width].reshape(rows, width).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((rows, heads, dim), dtype=np.float32))
    return q, to(k), to(v), jnp.asarray(tables)


TUNINGS = [gpu_attention.DEFAULT, gpu_attention.SESSION_17,
           gpu_attention.Tuning(pages_per_block=3, target_programs=4096)]  # blocks that straddle splits


@pytest.mark.parametrize("tuning", TUNINGS, ids=lambda t: f"{t.pages_per_block}x{t.target_programs}")
@pytest.mark.parametrize("heads,kv_heads,dim,page_size,window", [
    (8, 2, 32, 16, None),  # 4 query heads per KV head, padded to a 16-row tile
    (4, 4, 16, 32, None),  # no grouping, pages of 32
    (6, 2, 64, 16, 21),  # a sliding window that starts mid-page; 3 heads per group
])
def test_kernel_matches_the_reference(heads, kv_heads, dim, page_size, window, tuning):
    rng = np.random.default_rng(0)
    width, rows = 6, 6
    q, k, v, tables = pages_and_queries(rng, heads, kv_heads, dim, page_size, 48, width, rows)
    lens = jnp.asarray([1, page_size - 1, page_size, page_size + 1, 3 * page_size + 5, width * page_size], jnp.int32)
    positions = lens - 1
    got = decode(q, k, v, tables, positions, lens, window, tuning=tuning)
    with jax.default_matmul_precision("highest"):  # a GPU's float32 einsum defaults to TF32 (10-bit mantissa)
        ref = pa.paged_attention(q[:, None], k, v, tables, positions[:, None], lens, window)[:, 0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_long_contexts_split_over_blocks_of_pages():
    """Contexts of many blocks, split over several programs each, with a window that ends a split's
    pages early and rows that stop mid-block: what llama3-8b's 1024/1024 decode does, in miniature."""
    rng = np.random.default_rng(2)
    width, rows = 40, 4
    q, k, v, tables = pages_and_queries(rng, 8, 2, 16, 16, 200, width, rows)
    lens = jnp.asarray([1, 333, 517, width * 16], jnp.int32)
    for window in (None, 100):
        for tuning in TUNINGS:
            got = decode(q, k, v, tables, lens - 1, lens, window, tuning=tuning)
            with jax.default_matmul_precision("highest"):  # not TF32 on a GPU
                ref = pa.paged_attention(q[:, None], k, v, tables, (lens - 1)[:, None], lens, window)[:, 0]
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5, err_msg=str(tuning))


def test_bfloat16_pages_and_padding_rows():
    """Pages stored as bfloat16 bit patterns with a bfloat16 query; a row with no context gets zeros."""
    rng = np.random.default_rng(1)
    q, k, v, tables = pages_and_queries(rng, 8, 2, 32, 16, 40, 4, 3, stored=pa.BF16_BITS)
    q = q.astype(jnp.bfloat16)
    lens = jnp.asarray([37, 0, 64], jnp.int32)
    positions = jnp.maximum(lens - 1, 0)
    got = np.asarray(decode(q, k, v, tables, positions, lens), np.float32)
    ref = np.asarray(pa.paged_attention(q[:, None], k, v, tables, positions[:, None], lens)[:, 0], np.float32)
    np.testing.assert_allclose(got[[0, 2]], ref[[0, 2]], rtol=2e-2, atol=2e-2)  # bfloat16 products
    assert not got[1].any()


@pytest.mark.parametrize("tuning", TUNINGS[:2], ids=lambda t: f"{t.pages_per_block}x{t.target_programs}")
def test_int8_pages_with_their_scales(tuning):
    """int8 pages (kv_quant.py): the scales multiply each page's scores and, in the weighted sum, its
    weights; the products in bfloat16 (int8 values are exact in it), so the result is the
    reference's over the dequantized pages to bfloat16 rounding; a padding row gets zeros."""
    from worker.engine.int8_linear import quantize
    from worker.engine.kv_quant import QuantizedPages

    rng = np.random.default_rng(6)
    q, k, v, tables = pages_and_queries(rng, 8, 2, 32, 16, 48, 6, 4)
    k, v = QuantizedPages(*quantize(k, axis=2)), QuantizedPages(*quantize(v, axis=3))
    lens = jnp.asarray([37, 0, 96, 5], jnp.int32)
    positions = jnp.maximum(lens - 1, 0)
    got = np.asarray(decode(q, k, v, tables, positions, lens, tuning=tuning))
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(pa.paged_attention(q[:, None], k, v, tables, positions[:, None], lens)[:, 0])
    live = [0, 2, 3]
    # bfloat16 weights and products: within a percent of the largest output (0.4 % in session 67)
    assert np.abs(got[live] - ref[live]).max() < 0.01 * np.abs(ref[live]).max()
    assert not got[1].any()


def kernel_products(q: jax.Array, stored, fn=gpu_attention.pallas_decode_attention) -> list:
    """The operand dtypes and precision of every matrix product inside `fn` (the decode kernel),
    for a query of q's dtype over llama3-8b-shaped pages held as `stored`."""
    import jax.extend as jex

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for value in eqn.params.values():
                for x in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(x, (jex.core.ClosedJaxpr, jex.core.Jaxpr)):
                        yield from walk(getattr(x, "jaxpr", x))

    pages = [jax.ShapeDtypeStruct(shape, stored) for shape in ((8, 64, 128, 16), (8, 64, 16, 128))]
    rows = q.shape[:-2]  # [S] or [S, Q]
    ints = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in ((rows[0], 16), rows, rows[:1])]
    jaxpr = jax.make_jaxpr(fn)(q, *pages, *ints).jaxpr
    return [(tuple(str(x.aval.dtype) for x in e.invars), e.params["precision"]) for e in walk(jaxpr)
            if e.primitive.name == "dot_general"]


def test_a_float32_query_over_bfloat16_pages_multiplies_in_bfloat16():
    """The model hands attention float32 queries. Over bfloat16 pages the kernel's products are
    bfloat16 ones (tensor cores): session 30's H200 ran the engine's calls as float32 products at
    full precision, several times the cost of the same shape with a bfloat16 query. Float32 pages
    keep exact float32 products."""
    f32 = jax.ShapeDtypeStruct((4, 32, 128), jnp.float32)
    products = kernel_products(f32, pa.BF16_BITS)
    assert products and all(p == (("bfloat16", "bfloat16"), None) for p in products), products
    exact = kernel_products(f32, jnp.float32)
    assert exact and all(p[0] == ("float32", "float32") and p[1] is not None for p in exact), exact
    rng = np.random.default_rng(4)
    q, k, v, tables = pages_and_queries(rng, 8, 2, 32, 16, 40, 4, 3, stored=pa.BF16_BITS)
    lens = jnp.asarray([37, 9, 64], jnp.int32)
    got = decode(q, k, v, tables, lens - 1, lens)
    assert got.dtype == jnp.float32
    rounded = decode(q.astype(jnp.bfloat16), k, v, tables, lens - 1, lens)  # what a bfloat16 model's query gives
    np.testing.assert_allclose(np.asarray(got), np.asarray(rounded, np.float32), rtol=1e-2, atol=1e-2)


def test_prefill_rows_over_bfloat16_pages_multiply_in_bfloat16():
    """Prefill rows run the reference, with the decode kernel's rounding: over bfloat16 pages a
    float32 query and the softmax weights enter their products as bfloat16 (the result is the
    reference's on the query rounded to bfloat16); over float32 pages the products stay float32."""
    f32 = jax.ShapeDtypeStruct((2, 8, 32, 128), jnp.float32)
    prefill = gpu_prefill.prefill_attention
    products = kernel_products(f32, pa.BF16_BITS, prefill)
    assert len(products) == 2 and all(p[0] == ("bfloat16", "bfloat16") for p in products), products
    exact = kernel_products(f32, jnp.float32, prefill)
    assert len(exact) == 2 and all(p[0] == ("float32", "float32") for p in exact), exact
    rng = np.random.default_rng(5)
    q, k, v, tables = pages_and_queries(rng, 8, 2, 32, 16, 40, 4, 6, stored=pa.BF16_BITS)
    q = q.reshape(2, 3, 8, 32)  # 2 rows of 3 query tokens
    lens = jnp.asarray([37, 64], jnp.int32)
    positions = lens[:, None] - 3 + jnp.arange(3)[None, :]
    tables = tables.reshape(2, 12)[:, :4]
    got = prefill(q, k, v, tables, positions, lens)
    assert got.dtype == jnp.float32
    rounded = pa.paged_attention(q.astype(jnp.bfloat16), k, v, tables, positions, lens)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(rounded, np.float32))
    exact_ref = pa.paged_attention(q, k, v, tables, positions, lens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(exact_ref), rtol=3e-2, atol=3e-2)
    f32_pages = [pa.page_values(x).astype(jnp.float32) for x in (k, v)]
    np.testing.assert_array_equal(np.asarray(prefill(q, *f32_pages, tables, positions, lens)),
                                  np.asarray(pa.paged_attention(q, *f32_pages, tables, positions, lens)))


@pytest.mark.parametrize("tuning", TUNINGS[:2], ids=lambda t: f"{t.pages_per_block}x{t.target_programs}")
@pytest.mark.parametrize("dtype,stored,s,n,p", [(jnp.float32, jnp.float32, 64, 1024, 64),
                                               (jnp.bfloat16, pa.BF16_BITS, 64, 1024, 64),
                                               (jnp.bfloat16, pa.BF16_BITS, 1, 1024, 64),
                                               (jnp.bfloat16, pa.BF16_BITS, 64, 3000, 130),
                                               (jnp.float32, jnp.int8, 64, 1024, 64)])
def test_lowers_to_one_triton_kernel_for_cuda(dtype, stored, s, n, p, tuning):
    """The llama3-8b decode shape (32 heads, 8 KV heads, head dim 128, pages of 16) lowers for CUDA
    to a Triton custom call (a primitive Triton cannot express fails here, not on the GPU); at
    batch 1 with its context split over many programs per KV head; with a page pool and a page table
    whose sizes are not powers of two (the pool's size follows the GPU's free memory); int8 pages
    with their scales."""
    from worker.engine.kv_quant import QuantizedPages

    kv = 8

    def pages(shape):
        if stored == jnp.int8:
            return QuantizedPages(jax.ShapeDtypeStruct(shape, jnp.int8), jax.ShapeDtypeStruct((kv, n, 16), jnp.float32))
        return jax.ShapeDtypeStruct(shape, stored)

    args = (jax.ShapeDtypeStruct((s, 32, 128), dtype), pages((kv, n, 128, 16)), pages((kv, n, 16, 128)),
            *(jax.ShapeDtypeStruct(x, jnp.int32) for x in ((s, p), (s,), (s,))))
    lowered = jax.jit(partial(gpu_attention.pallas_decode_attention, tuning=tuning)).trace(*args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and 'name = "redjax_paged_decode_attention"' in text


def test_a_row_whose_window_passed_its_context_sees_nothing():
    """A fused decode row that has stopped steps on past its context: with a sliding window its
    visible range can end inside the page where the window starts. It gets zeros (no NaN, no
    garbage weighted in), and the other rows their reference values."""
    rng = np.random.default_rng(3)
    q, k, v, tables = pages_and_queries(rng, 8, 2, 16, 16, 96, 40, 2)
    lens, positions = jnp.asarray([520, 300], jnp.int32), jnp.asarray([625, 299], jnp.int32)
    with jax.default_matmul_precision("highest"):  # not TF32 on a GPU
        ref = pa.paged_attention(q[:, None], k, v, tables, positions[:, None], lens, 100)[:, 0]
    for tuning in TUNINGS:
        got = np.asarray(decode(q, k, v, tables, positions, lens, 100, tuning=tuning))
        assert not got[0].any(), tuning
        np.testing.assert_allclose(got[1], np.asarray(ref[1]), rtol=1e-5, atol=1e-5)


def test_context_splits_fill_the_gpu_up_to_one_block_each():
    old = gpu_attention.SESSION_17
    assert gpu_attention.context_splits(64, 8, 64, old) == 1  # 512 programs already
    assert gpu_attention.context_splits(1, 8, 64, old) == 64 and gpu_attention.context_splits(1, 8, 16, old) == 16
    assert gpu_attention.context_splits(64, 8, 128) == 2  # the default: ~1024 programs at 1024/1024
    assert gpu_attention.context_splits(1, 8, 128) == 32  # 32 blocks of 4 pages, one per program
    assert gpu_attention.context_splits(6, 2, 6) == 2  # the tests above: 2 blocks of 4 pages


def test_supported_shapes_and_the_choice():
    assert gpu_attention.supported(128, 16) and gpu_attention.supported(16, 64)
    assert not gpu_attention.supported(80, 16) and not gpu_attention.supported(128, 8)
    with pytest.raises(ValueError, match="needs the GPU backend, tensor_parallel 1, and head dim and page size"):
        choose_attention("pallas", 1, 128, 8, jnp.float32, jnp.float32)  # pages of 8: too small a tile anywhere
    if ON_GPU:
        assert choose_attention("auto", 1, 128, 16, jnp.bfloat16, jnp.bfloat16) is gpu_attention.PALLAS
    else:
        with pytest.raises(ValueError, match="needs the GPU backend"):
            choose_attention("pallas", 1, 128, 16, jnp.float32, jnp.float32)
    assert choose_attention("jnp", 1, 128, 16, jnp.float32, jnp.float32) is pa.JNP
    with pytest.raises(AttentionUnavailable, match="pallas_tuning applies to the Pallas decode kernel, and this "
                                                   "engine runs jnp attention"):
        choose_attention("jnp", 1, 128, 16, jnp.float32, jnp.float32, (4, 2048, 4, 2))
    if ON_GPU:
        tuned = choose_attention("auto", 1, 128, 16, jnp.bfloat16, jnp.bfloat16, (8, 4096, 8, 3))
        assert tuned.name == "pallas" and tuned.decode.keywords["tuning"] == gpu_attention.Tuning(8, 4096, 8, 3)
    assert EngineConfig(attention="pallas").attention == "pallas"
    with pytest.raises(ValueError, match="attention must be auto, kernel, pallas or jnp"):
        EngineConfig(attention="triton")


@pytest.mark.parametrize("prefill_kernel", [False, True], ids=["reference-prefill", "prefill-kernel"])
def test_engine_decodes_with_the_kernel_like_transformers(tokenizer, tmp_path, monkeypatch, prefill_kernel):  # noqa: F811
    """A tiny Qwen2 (head dim 16, sliding window on its upper layer) served with the kernel in its
    decode rows, fused steps included, and in its prefill rows the reference or the Pallas prefill
    kernel (`--pallas-prefill`; a 70-token prompt chunked over steps of 64 tokens): greedy tokens
    equal transformers'."""
    hf = make_hf_model("qwen2", tmp_path, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(tmp_path)
    ops = replace(KERNEL, prefill=PREFILL_KERNEL) if prefill_kernel else KERNEL
    monkeypatch.setattr("worker.engine.llm_engine.choose_attention", lambda *args: ops)
    engine = LLMEngine(load_model(tmp_path), tokenizer, EngineConfig(max_num_seqs=4, page_size=16, num_pages=24,
                                                                     max_num_batched_tokens=64, decode_steps=4))
    assert engine.attention == KERNEL.name
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, len(tokenizer), n).tolist() for n in (3, 17, 30, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    results = drain(engine)
    for i, prompt in enumerate(prompts):
        assert results[(f"r{i}", 0)].token_ids == hf_greedy(hf, prompt, 10), i


def test_int8_pages_with_the_kernel_track_the_jnp_path(tokenizer, tmp_path, monkeypatch):  # noqa: F811
    """int8 KV pages served with the kernel in decode rows (fused steps) and, in prefill rows, the
    reference or the Pallas prefill kernel (a 70-token prompt chunked over steps of 64 tokens), against
    the same pages through the jnp path: the kernels' bfloat16 products can split a near tie the
    other way, so most prompts' greedy tokens are the same."""
    make_hf_model("llama", tmp_path, vocab_size=len(tokenizer))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, len(tokenizer), n).tolist() for n in (3, 17, 30, 45, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for name, ops in (("kernel", KERNEL), ("prefill-kernel", replace(KERNEL, prefill=PREFILL_KERNEL)), ("jnp", pa.JNP)):
        monkeypatch.setattr("worker.engine.llm_engine.choose_attention", lambda *args, ops=ops: ops)
        engine = LLMEngine(load_model(tmp_path), tokenizer, EngineConfig(
            max_num_seqs=4, page_size=16, num_pages=24, max_num_batched_tokens=64, decode_steps=4,
            kv_cache_dtype="int8"))
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        results = drain(engine)
        tokens[name] = [results[(f"r{i}", 0)].token_ids for i in range(len(prompts))]
        assert engine.allocator.num_free_pages == engine.allocator.num_usable_pages
    for name in ("kernel", "prefill-kernel"):
        same = [a == b for a, b in zip(tokens[name], tokens["jnp"])]
        assert sum(same) >= 4, (name, tokens)


def test_bfloat16_engine_with_the_kernel_tracks_the_jnp_path(tokenizer, tmp_path, monkeypatch):  # noqa: F811
    """The GPU benchmark's configuration in miniature: a bfloat16 model with bfloat16 pages (held as
    bit patterns), pages of 16, fused decode steps. Each generated token's logprob under the kernel
    engine matches the jnp engine's within bfloat16 rounding (the first token comes from prefill,
    where both run the reference)."""
    make_hf_model("qwen2", tmp_path, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(tmp_path)
    sizes = dict(max_num_seqs=4, page_size=16, num_pages=24, max_num_batched_tokens=64, decode_steps=4,
                 dtype="bfloat16")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, len(tokenizer), n).tolist() for n in (5, 21)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)

    def run(engine):
        assert engine.runner.kv.dtype == jnp.bfloat16
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        return drain(engine)

    ref = run(LLMEngine(load_model(tmp_path), tokenizer, EngineConfig(attention="jnp", **sizes)))
    monkeypatch.setattr("worker.engine.llm_engine.choose_attention", lambda *args: KERNEL)
    engine = LLMEngine(load_model(tmp_path), tokenizer, EngineConfig(**sizes))
    assert engine.attention == KERNEL.name
    got = run(engine)
    for key, choice in ref.items():
        first = next((k for k, (a, b) in enumerate(zip(choice.token_ids, got[key].token_ids)) if a != b), 8)
        assert first >= 4, (key, choice.token_ids, got[key].token_ids)  # a near tie may flip a late token
        diffs = [abs(a["logprob"] - b["logprob"]) for a, b in zip(choice.logprobs[:first], got[key].logprobs[:first])]
        # the same bfloat16 inputs and float32 sums: equal here, a little apart on a GPU (the kernel
        # with its scale 10 % off moves them by 0.005-0.027, 0.01 on average)
        assert max(diffs) < 1e-2 and sum(diffs) / len(diffs) < 3e-3, diffs


@pytest.mark.parametrize("tuning", [None, (8, 4096, 8, 3)])
def test_the_startup_probe_runs_the_engines_work_split(monkeypatch, tuning):
    """`auto` takes the kernel only after running it once with the engine's own split; here through
    the interpreter (a CPU cannot compile it, and says so with False)."""
    from worker.engine import attention_choice

    seen, kernel = [], gpu_attention.pallas_decode_attention

    def interpreted(*args, tuning, **kwargs):
        seen.append(tuning)
        return kernel(*args, tuning=tuning, interpret=True, **kwargs)

    settings = gpu_attention.DEFAULT if tuning is None else gpu_attention.Tuning(*tuning)
    if not ON_GPU:
        assert not attention_choice.pallas_compiles.__wrapped__(128, 16, "bfloat16", "bfloat16", settings)
    monkeypatch.setattr(gpu_attention, "pallas_decode_attention", interpreted)
    assert attention_choice.pallas_compiles.__wrapped__(128, 16, "bfloat16", "bfloat16", settings)
    assert seen == [gpu_attention.DEFAULT if tuning is None else gpu_attention.Tuning(*tuning)]
