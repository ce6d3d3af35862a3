"""What the API knows about the served model: its tokenizer, chat template and context limit.

Read from a local Hugging Face folder only (config.json + tokenizer files); nothing is downloaded.
transformers is imported when a model is loaded, not when `api` is imported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.engine.sampling_params import SamplingParams
from worker.models.config import generation_config


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the served model name
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    max_model_len: int  # prompt tokens + generated tokens at most
    vocab_size: int  # token ids must be below this
    # sampling fields a request leaves out -> the checkpoint's values (generation_config.json), see below
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    # token id -> its own text (logprobs name every alternative by it): filled as ids are first seen,
    # at most the vocabulary; a decode call per new id, then a lookup (~12 us -> ~1 us for 5 ids)
    _token_text: dict[int, str] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def load(cls, model_dir: str, name: str, max_model_len: int | None = None,
             generation_defaults: bool = True) -> "ModelInfo":
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
        defaults = sampling_defaults(folder / "generation_config.json") if generation_defaults else {}
        return cls(name=name, tokenizer=tokenizer, max_model_len=max_model_len, vocab_size=int(vocab_size),
                   sampling_defaults=defaults)

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

    def is_special_token(self, text: str) -> bool:
        """Whether `text` is one special token of the tokenizer (decoding with
        skip_special_tokens drops it)."""
        return self.special_token_id(text) is not None

    def special_token_id(self, text: str) -> int | None:
        """The id of the special token spelled `text`, or None where there is none."""
        return next((i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special and t.content == text), None)

    @property
    def chat_template(self) -> str | None:
        """The template's text; a tokenizer with named templates (a "tool_use" one beside the
        default, which transformers picks when tools are given) gives them all, joined."""
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):
            return "\n".join(t for t in template.values() if isinstance(t, str)) or None
        return template if isinstance(template, str) else None

    def render_chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Chat messages -> prompt token ids, through the model's own jinja2 template (sandboxed by
        transformers). `continue_final_message` leaves the last message open, so the model goes on
        with it (an assistant turn the client began); `template_kwargs` are the template's own
        variables (e.g. Qwen3's `enable_thinking`)."""
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(template_kwargs or {}),
        )  # fmt: skip
        # The template writes BOS itself when the model wants one.
        return self.encode(text, add_special_tokens=False)


# generation_config.json's sampling fields a request may leave out, with transformers' own default
# for each: a checkpoint's value other than that default is the value its makers chose to sample with
# (Llama 3 Instruct: temperature 0.6, top_p 0.9; Qwen2.5 Instruct: 0.7, 0.8, top_k 20,
# repetition_penalty 1.05), which transformers' generate, vLLM and SGLang use where a request sets none.
GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}


def sampling_defaults(path: Path) -> dict[str, float | int]:
    """The checkpoint's sampling defaults from its generation_config.json (none where there is no
    such file); `do_sample` is not read, as vLLM does not: a request's own fields decide."""
    generation = generation_config(path.parent)
    defaults = {name: generation[name] for name, default in GENERATION_DEFAULTS.items()
                if generation.get(name) is not None and generation[name] != default}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    return defaults
