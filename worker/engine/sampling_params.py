"""Per-request sampling and stopping parameters. Host side: no JAX import.

The API validates requests by building one of these, so every check lives here once and
raises `ValueError` with a message fit to show a client.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20  # top-N alternatives per token, as OpenAI allows
MAX_N = 16
MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt; they share the prompt's KV pages
    max_tokens: int | None = 16  # new tokens at most; None: until the context limit
    min_tokens: int = 0  # new tokens at least before EOS, a stop token or a stop string may end the sequence
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 disables
    min_p: float = 0.0  # drop tokens below min_p * p(most likely)
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # HF-style: divides positive, multiplies negative logits of seen tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    seed: int | None = None  # per-request seed; None lets the engine pick one
    stop: tuple[str, ...] = ()  # stop strings, checked on text across token boundaries
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end the sequence
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    logprobs: int | None = None  # logprob of each sampled token plus this many alternatives
    prompt_logprobs: int | None = None  # logprobs of prompt tokens plus this many alternatives
    skip_special_tokens: bool = True  # drop special tokens from decoded text
    # structured output: the grammar the tokens must follow, as llguidance takes it (its JSON form or Lark
    # text; api/structured.py, api/tool_grammar.py)
    grammar: str | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}]")
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 0),
            "max_tokens must be a non-negative integer",
        )
        _check(_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens must be a non-negative integer")
        _check(
            self.max_tokens is None or not _int(self.max_tokens) or self.min_tokens <= self.max_tokens,
            "min_tokens must not exceed max_tokens",
        )
        _check(_num(self.temperature) and 0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]")
        _check(_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k must be an integer >= -1 (-1 or 0: disabled)")
        _check(_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]")
        _check(_num(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]")
        _check(
            _num(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"
        )
        _check(
            _num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]"
        )
        _check(isinstance(self.logit_bias, tuple), "logit_bias must be a tuple of (token_id, bias) pairs")
        for pair in self.logit_bias:
            _check(
                isinstance(pair, tuple) and len(pair) == 2 and _int(pair[0]) and pair[0] >= 0 and _num(pair[1])
                and -100.0 <= pair[1] <= 100.0,
                "logit_bias maps token ids (non-negative integers) to biases in [-100, 100]",
            )
        _check(self.seed is None or _int(self.seed), "seed must be an integer")
        _check(
            isinstance(self.stop, tuple) and len(self.stop) <= MAX_STOP_STRINGS
            and all(isinstance(s, str) and s for s in self.stop),
            f"stop must be at most {MAX_STOP_STRINGS} non-empty strings",
        )
        _check(
            isinstance(self.stop_token_ids, tuple) and all(_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be non-negative integers",
        )
        _check(self.grammar is None or (isinstance(self.grammar, str) and self.grammar), "grammar must be a string")
        # a finished grammar allows only an end-of-sequence token: neither may hold that back
        _check(self.grammar is None or not (self.min_tokens or self.ignore_eos),
               "min_tokens and ignore_eos cannot be combined with structured output (a grammar)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_int(value) and 0 <= value <= MAX_LOGPROBS),
                f"{name} must be an integer in [0, {MAX_LOGPROBS}]",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether a presence, frequency or repetition penalty applies."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in the request must exist in the model's vocabulary."""
        for token_id, _ in self.logit_bias:
            _check(token_id < vocab_size, f"logit_bias token id {token_id} is outside the vocabulary ({vocab_size})")
        for token_id in self.stop_token_ids:
            _check(token_id < vocab_size, f"stop_token_ids entry {token_id} is outside the vocabulary ({vocab_size})")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (tuples become lists); `from_dict` inverts it."""
        out = dict(vars(self))  # not asdict(): its deep copies cost ~3 % of the API's CPU per request
        out["logit_bias"] = [list(p) for p in self.logit_bias]
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        _check(not unknown, f"unknown sampling parameters: {sorted(unknown)}")
        data = dict(data)
        if "logit_bias" in data:
            data["logit_bias"] = tuple(tuple(p) for p in data["logit_bias"])
        for key in ("stop", "stop_token_ids"):
            if key in data:
                data[key] = tuple(data[key])
        return cls(**data)


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
