"""The demo model: the training script end to end, the shipped checkpoint in transformers, the chat template."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from worker.demo_model import CORPUS_PATH, DEMO_MODEL_DIR, demo_passages, read_paragraphs

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_FILES = (
    "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
)


def hf_greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    import torch

    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)


@pytest.fixture(scope="module")
def shipped():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR, local_files_only=True)
    return model, tokenizer


def test_demo_passages_come_from_the_corpus():
    text = CORPUS_PATH.read_text(encoding="utf-8")
    passages = demo_passages(8)
    assert len(passages) == 8
    assert passages[0][0] == (
        "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
        "must be in want of a wife."
    )
    for prompt, expected in passages:
        assert prompt + expected in text
        assert expected[:1].isspace() and expected.strip()
    with pytest.raises(ValueError):
        demo_passages(len(read_paragraphs()))


def test_training_script_tiny_run_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "model"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_demo_model.py"), "--out", str(out), "--tiny", "--steps", "6"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step     6/6" in result.stdout and "continuations reproduce the corpus" in result.stdout
    for name in SHIPPED_FILES:
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert model.config.vocab_size == len(tokenizer) == 512
    assert hf_greedy(model, tokenizer, "It is a truth", 4) is not None


def test_shipped_files_are_small_and_complete():
    for name in SHIPPED_FILES:
        assert (DEMO_MODEL_DIR / name).is_file(), name
    total = sum(p.stat().st_size for p in DEMO_MODEL_DIR.rglob("*") if p.is_file())
    assert total <= 20 * 2**20


def test_shipped_model_reproduces_corpus_passages(shipped):
    model, tokenizer = shipped
    for prompt, expected in demo_passages(6):
        budget = len(tokenizer(expected, add_special_tokens=False).input_ids) + 2
        got = hf_greedy(model, tokenizer, prompt, budget)
        assert got.startswith(expected), f"prompt {prompt!r}\n got {got!r}\nwant {expected!r}"


def test_shipped_tokenizer_round_trips_and_adds_bos(shipped):
    _, tokenizer = shipped
    text = read_paragraphs()[5]
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_chat_template_renders(shipped):
    _, tokenizer = shipped
    messages = [
        {"role": "system", "content": "You are Miss Austen."},
        {"role": "user", "content": "Who is Mr. Darcy?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|bos|><|system|>\nYou are Miss Austen.<|eos|>\n<|user|>\nWho is Mr. Darcy?<|eos|>\n<|assistant|>\n"
    )
    closed = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not closed.endswith("<|assistant|>\n")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    special = {tokenizer.convert_tokens_to_ids(t) for t in ("<|bos|>", "<|system|>", "<|user|>", "<|assistant|>")}
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert special <= set(ids)
