"""A servable directory of a preset shape (`worker/models/dummy_model.py`), read back through the
real loaders: the weights by ours and by transformers, the tokenizer by transformers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from worker.bench.prompts import WORDS, random_prompts
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.models.config import ModelConfig
from worker.models.dummy_model import SPACE, word_vocab, write_dummy_model
from worker.models.loader import load_model, load_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_dummy_model("llama-tiny", tmp_path_factory.mktemp("dummy"), list(WORDS))


def test_word_vocab_gives_every_id_one_token():
    vocab = word_vocab(10, {2: "<s>", 5: "</s>"}, ["a", "b", "a", "c"])
    assert sorted(vocab.values()) == list(range(10))
    assert vocab["<s>"] == 2 and vocab["</s>"] == 5
    assert [vocab[SPACE + w] for w in "abc"] == [0, 1, 3]  # the free ids in order, a repeated word once
    assert vocab[SPACE + "t9"] == 9 and SPACE + "t2" not in vocab
    with pytest.raises(ValueError, match="outside"):
        word_vocab(4, {4: "</s>"}, [])


def test_tokenizer_covers_the_vocabulary_one_token_per_word(tiny):
    cfg = ModelConfig.preset("llama-tiny")
    tok = load_tokenizer(tiny)
    assert len(tok) == cfg.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg.bos_token_id, cfg.eos_token_ids[0])
    prompt = random_prompts(1, 40, seed=5)[0]
    ids = tok(prompt)["input_ids"]
    assert len(ids) == 40 and tok.unk_token_id not in ids
    assert tok.decode(ids) == prompt
    assert tok("the zebra")["input_ids"][1] == tok.unk_token_id
    assert tok.decode([cfg.vocab_size - 1]) == f"t{cfg.vocab_size - 1}"
    assert len(set(WORDS)) < cfg.vocab_size


def test_streamed_text_equals_the_whole_decode(tiny):
    """What the engine streams token by token (its incremental detokenizer) is the decode of all
    the ids: random weights emit any id, so every kind of token is covered by random ids."""
    tok = load_tokenizer(tiny)
    rng = np.random.default_rng(0)
    prompt = tok("the river")["input_ids"]
    out = rng.integers(0, len(tok), 200).tolist()
    detok = IncrementalDetokenizer(tok, prompt)
    streamed = "".join(detok.add([i]) for i in out) + detok.flush()
    assert streamed == tok.decode(prompt + out, skip_special_tokens=True)[len(tok.decode(prompt)):]


def test_weights_load_in_our_loader_and_in_transformers_alike(tiny):
    model = load_model(tiny)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny), local_files_only=True).eval()
    ids = [1, 5, 9, 300, 7]
    ours = np.asarray(jax.jit(lambda t: model(t))(jnp.asarray([ids], jnp.int32)))[0]  # [T, V]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()  # [T, V]
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()
