"""Model parity against Hugging Face transformers (PyTorch CPU) on tiny random checkpoints."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from tests.hf_models import ARCHITECTURES, make_hf_model
from worker.models.config import ModelConfig, ModelConfigError
from worker.models import loader
from worker.models.loader import CheckpointError, build_model, load_model

PROMPT_LENGTHS = (3, 9, 14, 20)


def _prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, path, shard_size="40KB" if request.param == "llama" else None)
    return request.param, path, hf


def test_logits_match_transformers_for_a_ragged_batch(checkpoint):
    name, path, hf = checkpoint
    model = load_model(path)
    prompts = _prompts(model.cfg.vocab_size)
    width = max(map(len, prompts))
    batch = np.zeros((len(prompts), width), np.int32)  # right-padded
    for i, p in enumerate(prompts):
        batch[i, : len(p)] = p
    ours = np.asarray(jax.jit(lambda t: model(t))(jnp.asarray(batch)))  # [B, T, V]
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].numpy()  # [T, V]
        scale = np.abs(ref).max()
        err = np.abs(ours[i, : len(p)] - ref).max()
        assert err <= 1e-4 * scale, f"{name}: prompt {i} max abs error {err} vs logit scale {scale}"


def test_greedy_continuation_matches_generate(checkpoint):
    name, path, hf = checkpoint
    model = load_model(path)
    steps = 32

    @jax.jit
    def next_token(tokens, length):  # tokens i32[T] padded, length: real tokens
        logits = model(tokens[None])[0]  # [T, V]
        return jnp.argmax(logits[length - 1]).astype(jnp.int32)

    for p in _prompts(model.cfg.vocab_size, seed=2)[:3]:
        buf = jnp.zeros(len(p) + steps, jnp.int32).at[: len(p)].set(jnp.asarray(p))
        for k in range(steps):
            buf = buf.at[len(p) + k].set(next_token(buf, len(p) + k))
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False, eos_token_id=None)
        assert np.asarray(buf[len(p) :]).tolist() == ref[0, len(p) :].tolist(), name


def test_bfloat16_weights_load_and_run(tmp_path):
    hf = make_hf_model("qwen3", tmp_path, dtype=torch.bfloat16)
    model = load_model(tmp_path)
    assert model.cfg.dtype == "bfloat16"
    assert model.model.layers[0].mlp.up_proj.weight[...].dtype == jnp.bfloat16
    tokens = np.array([[5, 17, 99, 3, 42, 7]], np.int32)
    ours = np.asarray(model(jnp.asarray(tokens)))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.float().numpy()
    assert np.isfinite(ours).all()
    # bf16 arithmetic differs in rounding order; the distributions must still agree closely
    assert np.abs(ours - ref).max() <= 0.05 * np.abs(ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.8


def test_bfloat16_compute_is_at_least_as_close_to_float32_as_transformers_bfloat16(tmp_path):
    """Our bfloat16 forward multiplies bfloat16 operands into float32 and keeps activations float32;
    against the float32 forward of the same (bfloat16-rounded) weights it must err no more than
    transformers' own bfloat16 forward does."""
    hf = make_hf_model("llama", tmp_path, dtype=torch.bfloat16)
    model = load_model(tmp_path)
    tokens = np.array([[5, 17, 99, 3, 42, 7, 64, 11, 2, 80]], np.int32)
    ours = np.asarray(model(jnp.asarray(tokens)))
    with torch.no_grad():
        hf_bf16 = hf(torch.tensor(tokens)).logits.float().numpy()
        exact = hf.float()(torch.tensor(tokens)).logits.numpy()
    ours_err, hf_err = np.abs(ours - exact).max(), np.abs(hf_bf16 - exact).max()
    assert 0 < ours_err <= hf_err, (ours_err, hf_err)


def test_bfloat16_checkpoint_can_be_served_in_float32(tmp_path):
    make_hf_model("llama", tmp_path, dtype=torch.bfloat16)
    model = load_model(tmp_path, dtype="float32")
    assert model.model.norm.weight[...].dtype == jnp.float32


def test_dummy_weights_from_a_preset_shape():
    cfg = ModelConfig.preset("llama3-8b")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (
        128256, 4096, 32, 32, 8, 14336)
    assert ModelConfig.preset("llama3.2-1b").num_params == pytest.approx(1.236e9, rel=0.01)
    small = ModelConfig.from_hf_dict({**ModelConfig.preset("llama-100m").to_hf_dict(), "num_hidden_layers": 1,
                                      "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
                                      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})
    model = build_model(small, seed=3)
    logits = model(jnp.array([[1, 2, 3]], jnp.int32))
    assert logits.shape == (1, 3, 512) and bool(jnp.isfinite(logits).all())
    assert float(jnp.std(model.model.layers[0].mlp.up_proj.weight[...])) == pytest.approx(0.02, rel=0.2)
    with pytest.raises(ModelConfigError, match="unknown preset"):
        ModelConfig.preset("gpt-17")


def test_dummy_shape_from_any_config_json(tmp_path, monkeypatch):
    """--dummy takes a model's config.json (the file, or a directory holding it) as well as a
    shipped preset: the shape of a model whose weights are not here."""
    d = {**ModelConfig.preset("llama-100m").to_hf_dict(), "num_hidden_layers": 5, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = ModelConfig.preset(str(tmp_path / "config.json"))
    assert (cfg.num_layers, cfg.vocab_size, cfg.hidden_size) == (5, 1000, 768)
    assert ModelConfig.preset(str(tmp_path)) == cfg
    monkeypatch.chdir(tmp_path.parent)
    assert ModelConfig.preset(f"./{tmp_path.name}") == cfg
    for bad in (str(tmp_path / "missing.json"), str(tmp_path.parent)):  # no file; a directory without one
        with pytest.raises(ModelConfigError, match="neither a config.json nor a directory holding one"):
            ModelConfig.preset(bad)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        ModelConfig.preset(str(tmp_path / "broken.json"))


def test_dummy_weights_are_initialised_like_the_modules_one_program_per_shape():
    """Norm scales one, biases zero, every other tensor its own N(0, 0.02) draw; the same seed the
    same weights. Made by one small program per distinct tensor shape, not one for the model."""
    cfg = ModelConfig.from_hf_dict({**ModelConfig.preset("llama-100m").to_hf_dict(), "num_hidden_layers": 3,
                                    "vocab_size": 384, "hidden_size": 64, "intermediate_size": 96,
                                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                    "attention_bias": True, "tie_word_embeddings": False})
    loader._dummy_tensor.clear_cache()
    model = build_model(cfg, seed=5)
    programs = loader._dummy_tensor._cache_size()
    flat = {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model))}
    norms = [n for n in flat if n.endswith("norm.weight")]
    biases = [n for n in flat if n.endswith(".bias")]
    assert len(norms) == 2 * 3 + 1 and len(biases) == 4 * 3  # q k v o biases
    assert all((flat[n] == 1).all() for n in norms) and all((flat[n] == 0).all() for n in biases)
    drawn = [n for n in flat if n not in norms and n not in biases]
    assert len(drawn) == 7 * 3 + 2  # q k v o gate up down per layer, the embedding, the head
    for n in drawn:
        assert flat[n].std() == pytest.approx(0.02, rel=0.2), n
    q0, q1 = flat["model.layers.0.self_attn.q_proj.weight"], flat["model.layers.1.self_attn.q_proj.weight"]
    assert not np.allclose(q0, q1)  # same shape, separate draws
    again = build_model(cfg, seed=5).model.layers[1].self_attn.q_proj.weight[...]
    other = build_model(cfg, seed=6).model.layers[1].self_attn.q_proj.weight[...]
    np.testing.assert_array_equal(np.asarray(again), q1)
    assert not np.allclose(np.asarray(other), q1)
    shapes = {(v.shape, v.dtype, "norm" if n in norms else "bias" if n in biases else "") for n, v in flat.items()}
    assert programs == len(shapes) < len(flat)


def test_save_checkpoint_writes_shards_past_its_size_that_transformers_and_the_loader_read(tmp_path):
    """A model larger than `shard_bytes` is written as numbered shards and their index, as
    save_pretrained writes them (so a dummy 8B model is written one shard at a time); transformers
    and the loader read the same weights from it as from the single file a smaller limit is not needed for."""
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig.from_hf_dict({**ModelConfig.preset("llama-100m").to_hf_dict(), "num_hidden_layers": 2,
                                    "vocab_size": 384, "hidden_size": 64, "intermediate_size": 96,
                                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                    "tie_word_embeddings": False})
    model = build_model(cfg, seed=2)
    loader.save_checkpoint(model, tmp_path / "one")
    loader.save_checkpoint(model, tmp_path / "shards", shard_bytes=40_000)
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["config.json", "model.safetensors"]
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in (tmp_path / "shards").glob("*.safetensors")) == files
    sizes = [(tmp_path / "shards" / f).stat().st_size for f in files]
    assert index["metadata"]["total_size"] == sum(load_file(tmp_path / "one" / "model.safetensors")[n].nbytes
                                                  for n in index["weight_map"])
    assert max(sizes) < 40_000 + 384 * 64 * 4 + 4096  # a shard past the limit holds one tensor (the embedding)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "one").eval()(ids).logits
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "shards").eval()(ids).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    again = load_model(tmp_path / "shards")
    for (key, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(again))):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(key))
    logits = np.asarray(again(jnp.asarray(ids.numpy(), jnp.int32)))
    np.testing.assert_allclose(logits, ref.detach().numpy(), rtol=1e-4, atol=1e-4)


# ---- error paths: each names the file and the tensor ----

@pytest.fixture
def llama_dir(tmp_path):
    make_hf_model("qwen3", tmp_path / "m")
    return tmp_path / "m"


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_directory_and_files(tmp_path, llama_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "empty")
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(llama_dir)


def test_missing_shard_is_named(tmp_path):
    make_hf_model("llama", tmp_path, shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / shard).unlink()
    with pytest.raises(FileNotFoundError, match=shard):
        load_model(tmp_path)


def test_unsupported_architecture_and_activation(llama_dir):
    _edit_config(llama_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelConfigError, match="unsupported architecture"):
        load_model(llama_dir)
    _edit_config(llama_dir, architectures=["Qwen3ForCausalLM"], hidden_act="gelu")
    with pytest.raises(ModelConfigError, match="hidden_act"):
        load_model(llama_dir)
    _edit_config(llama_dir, hidden_act="silu", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(ModelConfigError, match="yarn"):
        load_model(llama_dir)


def test_shape_mismatch_names_file_and_tensor(llama_dir):
    _edit_config(llama_dir, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*mlp\.(gate|up|down)_proj\.weight.*shape"):
        load_model(llama_dir)


def test_unused_and_missing_tensors_are_named(llama_dir):
    file = llama_dir / "model.safetensors"
    tensors = load_file(file)
    save_file({**tensors, "model.layers.0.self_attn.extra.weight": torch.zeros(2)}, file)
    with pytest.raises(CheckpointError, match=r"extra\.weight.*not used"):
        load_model(llama_dir)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=r"missing tensors.*layers\.1\.mlp\.down_proj\.weight"):
        load_model(llama_dir)


def test_config_round_trips_through_hf_dict(checkpoint):
    _, path, _ = checkpoint
    cfg = ModelConfig.from_dir(path)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_generation_config_adds_its_end_of_sequence_ids(tmp_path):
    """Chat checkpoints name their end-of-turn token in generation_config.json (Llama 3 Instruct:
    config.json 128001, generation_config.json [128001, 128009]); generation stops at every id
    either file names, config.json's first, as transformers' generate stops. A generation_config
    that is not a JSON object is refused by name."""
    d = {**ModelConfig.preset("llama-100m").to_hf_dict(), "eos_token_id": 7}
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (7,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9, 9, 11], "do_sample": True}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (7, 9, 11)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (7, 5)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (7,)
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match="generation_config.json: not a JSON object"):
        ModelConfig.from_dir(tmp_path)


def test_sliding_window_is_parsed_per_layer(tmp_path):
    make_hf_model("qwen2", tmp_path)
    assert ModelConfig.from_dir(tmp_path).sliding_windows == (None, 5)
    shutil.rmtree(tmp_path)
    make_hf_model("mistral", tmp_path)
    assert ModelConfig.from_dir(tmp_path).sliding_windows == (6, 6)
