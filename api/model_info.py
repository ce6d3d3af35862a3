"""What the API knows about the served model: its tokenizer, chat template and context limit.

Read from a local Hugging Face folder only (config.json + tokenizer files); nothing is downloaded.
transformers is imported when a model is loaded, not when `api` is imported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the served model name
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    max_model_len: int  # prompt tokens + generated tokens at most
    vocab_size: int  # token ids must be below this
    # token id -> its own text (logprobs name every alternative by it): filled as ids are first seen,
    # at most the vocabulary; a decode call per new id, then a lookup (~12 us -> ~1 us for 5 ids)
    _token_text: dict[int, str] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def load(cls, model_dir: str, name: str, max_model_len: int | None = None) -> "ModelInfo":
        from transformers import AutoTokenizer

        folder = Path(model_dir)
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path} not found (model_dir must be a local Hugging Face model folder)")
        config = json.loads(config_path.read_text())
        config = config.get("text_config", config)  # multimodal wrappers keep the LM's fields here
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        model_limit = config.get("max_position_embeddings")
        if max_model_len is None:
            if not isinstance(model_limit, int):
                raise ValueError(f"{config_path} has no max_position_embeddings; set max_model_len")
            max_model_len = model_limit
        vocab_size = config.get("vocab_size") or len(tokenizer)
        return cls(name=name, tokenizer=tokenizer, max_model_len=max_model_len, vocab_size=int(vocab_size))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token's own text, as shown in logprobs (special tokens kept)."""
        known = self._token_text
        new = list({t for t in token_ids if t not in known})
        if new:  # (batch_decode([]) is not an empty list in every transformers version)
            known.update(zip(new, self.tokenizer.batch_decode([[t] for t in new], skip_special_tokens=False)))
        return [known[t] for t in token_ids]

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Chat messages -> prompt token ids, through the model's own jinja2 template."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template writes BOS itself when the model wants one.
        return self.encode(text, add_special_tokens=False)
