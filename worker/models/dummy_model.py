"""A servable model directory of a preset shape: random weights and a word-level tokenizer.

`bench offline --dummy` runs the engine on random token ids and needs no tokenizer, but the API
takes text, so serving a preset shape (`bench stack --dummy`) needs a model directory like any
other: `config.json`, `model.safetensors` and tokenizer files that transformers loads. The
tokenizer here is one word per token over the whole vocabulary: the special tokens at the
preset's ids, then the words given (`bench stack` gives the load generator's, so its random
prompts are one token per word), then `t<i>` for every id left. Words are split on spaces and
joined with spaces again (the sentencepiece convention: a token carries its leading "▁"), so
outputs read as " t8123 river t17" and stream like any Llama tokenizer's.
"""

from __future__ import annotations

from pathlib import Path

from worker import host_memory
from worker.models.config import ModelConfig
from worker.models.loader import build_model, save_checkpoint

SPACE = "\u2581"  # "▁": a token's leading space
UNK = "<unk>"


def word_vocab(vocab_size: int, specials: dict[int, str], words: list[str]) -> dict[str, int]:
    """token -> id for ids 0 .. vocab_size - 1: `specials` at their ids, `words` (each once) in the
    first free ids, `t<id>` in the rest."""
    if any(not 0 <= i < vocab_size for i in specials):
        raise ValueError(f"special token ids {sorted(specials)} outside a vocabulary of {vocab_size}")
    free = (i for i in range(vocab_size) if i not in specials)
    vocab = {token: i for i, token in specials.items()}
    for word, i in zip(dict.fromkeys(words), free):
        vocab[SPACE + word] = i
    taken = set(vocab.values())
    for i in range(vocab_size):
        if i not in taken:
            vocab[f"{SPACE}t{i}"] = i
    return vocab


def word_tokenizer(vocab_size: int, bos_id: int | None, eos_id: int | None, words: list[str]):
    """A transformers fast tokenizer over `word_vocab` (unknown words map to <unk>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = {"bos_token": (bos_id, "<s>"), "eos_token": (eos_id, "</s>")}
    specials = {i: token for i, token in names.values() if i is not None}
    unk_id = next(i for i in range(vocab_size) if i not in specials)
    specials[unk_id] = UNK
    tok = Tokenizer(models.WordLevel(word_vocab(vocab_size, specials, words), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement=SPACE, prepend_scheme="always")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=UNK, **{key: token for key, (i, token) in names.items() if i is not None})


def write_dummy_model(preset: str, out_dir: str | Path, words: list[str], dtype: str | None = None,
                      seed: int = 0) -> Path:
    """Random weights of `preset` (in `dtype`, default the preset's) and a word tokenizer whose
    first words are `words`, in `out_dir`. The weights are freed and their memory handed back when
    it returns (the caller goes on to serve them from another process)."""
    cfg = ModelConfig.preset(preset)
    out = Path(out_dir)
    with host_memory.loading():
        save_checkpoint(build_model(cfg, dtype, seed=seed), out, dtype)
    eos_id = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
    word_tokenizer(cfg.vocab_size, cfg.bos_token_id, eos_id, words).save_pretrained(str(out))
    return out
