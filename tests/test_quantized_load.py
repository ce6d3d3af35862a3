"""Projections made as the weights load (worker/engine/projections.py, loader `project`): each layer
projection becomes its int8 or int4 form, or the CPU kernel's panels, as soon as its float weights
are in and those are freed, so a model never holds all its float weights at once; the result is the
model that quantizing or packing after the load gives, array for array, and an engine built either
way gives the same tokens."""

from __future__ import annotations

import gc
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from worker.bench.prompts import WORDS
from worker.engine import cpu_matmul, projections
from worker.engine.config import EngineConfig
from worker.engine.int8_linear import Quantized
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.models import loader
from worker.models.config import ModelConfig
from worker.models.dummy_model import write_dummy_model
from worker.models.llama import Linear
from worker.models.loader import build_model, load_model, load_tokenizer
from tests.engine_support import drain

# eight layers whose projections hold most of the weights: a load that kept its float projections
# until the end would hold about three times the peak a load that frees them as it goes holds
SHAPE = {"num_hidden_layers": 8, "vocab_size": 256, "hidden_size": 128, "intermediate_size": 384,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256}
SCHEMES = ("int8", "int4")


def config() -> ModelConfig:
    return ModelConfig.from_hf_dict({**ModelConfig.preset("llama-100m").to_hf_dict(), **SHAPE})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A float32 checkpoint of `config()` with a word tokenizer: written as `bench stack --dummy` writes one."""
    path = tmp_path_factory.mktemp("quantized-load")
    (path / "shape.json").write_text(json.dumps(config().to_hf_dict()))
    return write_dummy_model(str(path / "shape.json"), path / "model", list(WORDS), "float32")


def live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays())


def quantized_arrays(model) -> dict[str, np.ndarray]:
    return {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model, Quantized))}


def float_projection_bytes(cfg: ModelConfig) -> int:
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return 4 * cfg.num_layers * (2 * h * q + 2 * h * kv + 3 * h * i)


@pytest.mark.parametrize("scheme", SCHEMES + (None,))
@pytest.mark.parametrize("source", ("checkpoint", "dummy"))
def test_each_projection_takes_its_engine_form_as_it_loads_and_its_float_weights_are_freed(model_dir, scheme, source):
    # int8, int4 (on XLA's path: any CPU), or with no quantization the CPU kernel's panels where it runs
    cfg = config()
    engine_config = EngineConfig(quantization=scheme, matmul="xla" if scheme else "auto")
    project = projections.projection(engine_config, cfg)
    if project is None:  # no quantization on a CPU without the float32 kernel: nothing to do as it loads
        assert scheme is None and cpu_matmul.matmul_for("auto", 1, jnp.float32) == "xla"
        return
    peaks = []  # the arrays alive as each projection is replaced, beyond those alive before the load

    def recording(linear):
        peaks.append(live_bytes() - before)
        return project(linear)

    gc.collect()
    gc.disable()  # what the load leaves to Python's cycle collector counts as held
    try:
        before = live_bytes()
        model = load_model(model_dir, project=recording) if source == "checkpoint" else build_model(cfg, "float32", 0, recording)
        loaded = live_bytes() - before
    finally:
        gc.enable()
    assert len(peaks) == 7 * cfg.num_layers
    assert not [m for _, m in nnx.iter_modules(model.model) if isinstance(m, Linear)]  # every projection replaced
    # what is alive on the way is the model so far and the float tensors not yet replaced: never more
    # than the loaded model and about a layer's float projections (a load that kept the float weights
    # would hold all of them beside it by the last projection)
    layer = float_projection_bytes(cfg) // cfg.num_layers
    assert max(peaks) < loaded + 1.5 * layer, (max(peaks), loaded, layer)

    # the arrays of a model quantized or packed after its load, one for one
    after = load_model(model_dir) if source == "checkpoint" else build_model(cfg, "float32", 0)
    assert loader.weight_bytes(after) == 4 * cfg.num_params  # float32 as loaded
    assert loader.weight_bytes(model) == loaded  # what the load left alive is the model
    assert loaded < 4 * cfg.num_params if scheme else loaded == 4 * cfg.num_params  # panels: the same floats
    if scheme is None:
        want = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(cpu_matmul.pack_model(after).model, nnx.Param))}
        got = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model.model, nnx.Param))}
    else:
        after, how = projections.quantize(after, engine_config)
        assert how == f"{scheme} (xla)"
        got, want = quantized_arrays(model), quantized_arrays(after)
        assert len(got) >= 2 * 7 * cfg.num_layers
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=str(name))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_an_engine_from_the_path_quantizes_at_load_and_gives_the_same_tokens(model_dir, scheme):
    sizes = dict(max_num_seqs=4, page_size=4, num_pages=48, max_num_batched_tokens=16, decode_steps=2)
    engine_config = EngineConfig(quantization=scheme, **sizes)
    at_load = LLMEngine.from_path(model_dir, engine_config)
    after = LLMEngine(load_model(model_dir), load_tokenizer(model_dir), engine_config)
    assert at_load.quantization == after.quantization == f"{scheme} ({'kernel' if projections.uses_kernel(at_load.config) else 'xla'})"
    tokens = [greedy_tokens(engine) for engine in (at_load, after)]
    assert tokens[0] == tokens[1] and all(len(t) == 10 for t in tokens[0])


def greedy_tokens(engine: LLMEngine) -> list[list[int]]:
    """10 greedy tokens for each of three prompts; the engine's pages all free again after."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(4, 256, n).tolist() for n in (2, 7, 13)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    got = drain(engine)
    assert engine.allocator.num_free_pages == engine.allocator.num_usable_pages
    return [got[(f"r{i}", 0)].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("scheme", (None, "int8"))
def test_an_untied_head_is_packed_as_it_loads_where_the_engine_runs_the_kernel(tmp_path, scheme):
    """The LM head takes the CPU kernel's panels as it loads where the engine would pack it (so the
    loaded head is freed before the greedy head's screen is built from the panels), and the engine
    gives the tokens an engine packing it after the load gives."""
    (tmp_path / "shape.json").write_text(json.dumps({**config().to_hf_dict(), "tie_word_embeddings": False}))
    path = write_dummy_model(str(tmp_path / "shape.json"), tmp_path / "model", list(WORDS), "float32")
    cfg = ModelConfig.from_dir(path)
    engine_config = EngineConfig(quantization=scheme, max_num_seqs=4, page_size=4, num_pages=48,
                                 max_num_batched_tokens=16, decode_steps=2)
    assert projections.head_projection(EngineConfig(matmul="xla"), cfg) is None
    head = projections.head_projection(engine_config, cfg)
    if cpu_matmul.matmul_for("auto", 1, jnp.float32) == "xla":  # no float32 kernel on this CPU: nothing to pack
        assert head is None
        return
    model = load_model(path, project=projections.projection(engine_config, cfg), project_head=head)
    assert isinstance(model.lm_head, cpu_matmul.PanelLinear)
    want = cpu_matmul.pack_linear(load_model(path).lm_head).panels[...]
    np.testing.assert_array_equal(np.asarray(model.lm_head.panels[...]), np.asarray(want))
    at_load = LLMEngine.from_path(path, engine_config)
    after = LLMEngine(load_model(path), load_tokenizer(path), engine_config)
    assert at_load.matmul == after.matmul == "kernel" and at_load.greedy_head == after.greedy_head
    assert greedy_tokens(at_load) == greedy_tokens(after)


def test_an_engine_refuses_a_model_quantized_otherwise(model_dir):
    cfg = config()
    int8 = load_model(model_dir, project=projections.projection(EngineConfig(quantization="int8", matmul="xla"), cfg))
    tokenizer = load_tokenizer(model_dir)
    with pytest.raises(ValueError, match="quantized or packed otherwise than quantization='int4'"):
        LLMEngine(int8, tokenizer, EngineConfig(quantization="int4", matmul="xla", num_pages=16))
    with pytest.raises(ValueError, match="quantized, but the engine's quantization is None"):
        LLMEngine(int8, tokenizer, EngineConfig(num_pages=16))


def test_large_dummy_tensors_are_drawn_block_by_block(monkeypatch):
    """Past BLOCK_FROM elements a tensor is drawn as blocks of whole rows (a row count that divides
    its rows, at most BLOCK elements each), each its own N(0, 0.02) draw; the same key the same tensor."""
    monkeypatch.setattr(loader, "BLOCK_FROM", 1000)
    monkeypatch.setattr(loader, "BLOCK", 400)
    loader._dummy_tensor.clear_cache()
    try:
        key = jax.random.key(7)
        for shape, rows in (((96, 40), 8), ((97, 40), 1)):  # 96 rows: blocks of 8 (10 would not divide); 97: of 1
            w = np.asarray(loader._dummy_tensor(key, shape, jnp.dtype(jnp.float32), "normal"))
            assert w.shape == shape and w.std() == pytest.approx(0.02, rel=0.1)
            blocks = w.reshape(-1, rows * 40)
            assert len({b.tobytes() for b in blocks}) == len(blocks)  # every block its own draw
            np.testing.assert_array_equal(np.asarray(loader._dummy_tensor(key, shape, jnp.dtype(jnp.float32), "normal")), w)
        small = np.asarray(loader._dummy_tensor(key, (20, 40), jnp.dtype(jnp.float32), "normal"))  # 800: one draw
        np.testing.assert_array_equal(small, np.asarray(jax.jit(lambda k: loader.weight_init(k, (20, 40), jnp.float32))(key)))
    finally:
        loader._dummy_tensor.clear_cache()
