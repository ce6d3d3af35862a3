"""Tiny random Hugging Face checkpoints of each supported architecture, built with transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)

ARCHITECTURES = {
    # Llama 3 shape: untied head, llama3 RoPE scaling, attention bias off
    "llama": lambda: transformers.LlamaConfig(
        **COMMON,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # Llama with linear RoPE scaling, tied embeddings and attention/MLP bias
    "llama-linear": lambda: transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0},
        attention_bias=True, mlp_bias=True,
    ),
    # Mistral: sliding window smaller than the test sequences
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=6, head_dim=16),
    # Qwen2: q/k/v bias, tied embeddings, sliding window on the upper layer
    "qwen2": lambda: transformers.Qwen2Config(
        **COMMON, tie_word_embeddings=True, use_sliding_window=True, sliding_window=5, max_window_layers=1
    ),
    # Qwen3: q/k RMSNorm, explicit head_dim different from hidden/heads
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False),
}

HF_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "llama-linear": transformers.LlamaForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
}


def make_hf_model(name: str, out_dir: Path, seed: int = 0, dtype=torch.float32, shard_size: str | None = None,
                  vocab_size: int | None = None):
    """Build a random model of architecture `name`, save it to out_dir, return the torch model.
    `vocab_size` overrides the default 256 (to match a tokenizer saved beside it)."""
    torch.manual_seed(seed)
    config = ARCHITECTURES[name]()
    if vocab_size is not None:
        config.vocab_size = vocab_size
    model = HF_CLASSES[name](config).to(dtype).eval()
    # random init gives near-zero logits; scale up so greedy choices are far from ties
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return model


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    """(architecture, directory, its transformers model) for every test architecture, once per module."""
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, make_hf_model(request.param, path)
