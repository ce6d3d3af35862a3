"""Prompts for `redjax bench serve`: random words, or a file (text lines, JSON lines, ShareGPT).
Each prompt may carry its own output length; `None` leaves it to `--output-len`.

Random prompts are `input_len` words, which most tokenizers cut into more tokens than words (the
demo model's: ~1.5 a word). Given the served model's tokenizer they are cut to exactly
`input_len` tokens instead (`exact_tokens`), as vLLM's random dataset makes them.

`draw_lengths` also gives `redjax bench offline` its per-request lengths (`--range-ratio`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

WORDS = ("the of and to in is was for on that with as by at from his her an which or be are this had not but "
         "river stone light city garden winter music paper window engine market signal forest harbor letter "
         "silver morning valley bridge planet story number system network station").split()


@dataclass(frozen=True)
class Prompt:
    text: str
    output_len: int | None = None  # max_tokens for this request; None: the run's --output-len


def random_prompts(n: int, input_len: int, seed: int = 0) -> list[str]:
    """`input_len` random common words each (about one token per word with most tokenizers)."""
    return [p.text for p in random_workload(n, input_len, 1, seed=seed)]


def random_workload(n: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0, prefix_len: int = 0, draw: int = 0, tokenizer=None) -> list[Prompt]:
    """Random prompts of `draw_lengths` words in (tokens, with `tokenizer`) and tokens out, each
    after the same `prefix_len` random words (a shared system prompt, for the prefix cache; vLLM's
    `--random-prefix-len`). A `draw` above 0 gives other words at the same lengths after the same
    prefix: each run of a sweep sends its own prompts, so no run finds an earlier run's in the
    server's prefix cache."""
    prefix_rng = random.Random(f"prefix-{seed}")
    words_rng = random.Random(seed if draw == 0 else f"words-{seed}-{draw}")
    prefix = "".join(prefix_rng.choice(WORDS) + " " for _ in range(prefix_len))

    def words(k: int) -> str:
        text = " ".join(words_rng.choice(WORDS) for _ in range(k))
        return text if tokenizer is None else exact_tokens(text, k, tokenizer, words_rng)

    return [Prompt(prefix + words(k), m) for k, m in draw_lengths(n, input_len, output_len, range_ratio, seed)]


def exact_tokens(text: str, k: int, tokenizer, rng: random.Random, tries: int = 8) -> str:
    """`text` cut (or lengthened with more random words) to a text that `tokenizer` encodes as
    exactly `k` tokens (no special tokens). Decoding k tokens and encoding the text again can merge
    or split at the cut, so the cut is retried on the new encoding; after `tries` the closest."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < k:
        text += " " + " ".join(rng.choice(WORDS) for _ in range(k - len(ids)))
        ids = tokenizer.encode(text, add_special_tokens=False)
    best = text
    for _ in range(tries):
        best = tokenizer.decode(ids[:k])
        again = tokenizer.encode(best, add_special_tokens=False)
        if len(again) == k:
            return best
        ids = again if len(again) > k else again + tokenizer.encode(" " + rng.choice(WORDS), add_special_tokens=False)
    return best


def draw_lengths(n: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                 seed: int = 0) -> list[tuple[int, int]]:
    """n (input, output) lengths, each drawn uniformly from [len * (1 - range_ratio), len * (1 +
    range_ratio)], at least 1; range_ratio 0: fixed lengths. Both benchmarks draw them here, so
    one seed gives `bench serve` and `bench offline` the same lengths."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("range ratio must be in [0, 1)")
    # a stream of their own: a seed draws the same words (or token ids) at any ratio
    rng = random.Random(f"lengths-{seed}")

    def draw(length: int) -> int:
        low, high = round(length * (1 - range_ratio)), round(length * (1 + range_ratio))
        return max(1, rng.randint(low, high) if high > low else length)

    return [(draw(input_len), draw(output_len)) for _ in range(n)]


def file_prompts(path: str, n: int, tokenizer=None) -> list[Prompt]:
    """Prompts from `path`, cycled to `n`:

    - a ShareGPT-style JSON file (a list of {"conversations": [{"from": "human", "value": ...},
      {"from": "gpt", "value": ...}, ...]}): each conversation's first human turn; with a
      `tokenizer` (transformers), its output length is the token count of the reply that follows
      it, as in the dataset;
    - JSON lines: {"prompt": ...}, optionally with "max_tokens" (that request's output length);
    - otherwise one prompt per non-empty line.
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if _sharegpt_text(text):
        prompts = _sharegpt(json.loads(text), path, tokenizer)
    elif tokenizer is not None:
        raise ValueError(f"{path}: a tokenizer sets output lengths of ShareGPT files only")
    else:
        lines = [line for line in text.splitlines() if line.strip()]
        prompts = [_json_line(line, path, i + 1) if line.lstrip().startswith("{") else Prompt(line)
                   for i, line in enumerate(lines)]
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return [prompts[i % len(prompts)] for i in range(n)]


def is_sharegpt(path: str) -> bool:
    """Whether `path` is a ShareGPT JSON file (a list), whose replies can set output lengths."""
    with open(path, encoding="utf-8") as f:
        return _sharegpt_text(f.read(4096))


def _sharegpt_text(text: str) -> bool:
    return text.lstrip().startswith("[")


def _json_line(line: str, path: str, lineno: int) -> Prompt:
    item = json.loads(line)
    if not isinstance(item.get("prompt"), str):
        raise ValueError(f"{path}:{lineno}: a JSON line needs a string 'prompt'")
    max_tokens = item.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise ValueError(f"{path}:{lineno}: 'max_tokens' must be a positive integer")
    return Prompt(item["prompt"], max_tokens)


def _sharegpt(items: list, path: str, tokenizer) -> list[Prompt]:
    """Each conversation's first human turn; with a tokenizer, the reply after it sets the output
    length (conversations without a reply are left out then)."""
    prompts = []
    for item in items:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            raise ValueError(f"{path}: expected a ShareGPT list of objects with 'conversations'")
        turns = [t for t in turns if isinstance(t, dict) and isinstance(t.get("value"), str)]
        asked = next((i for i, t in enumerate(turns) if t.get("from") in ("human", "user") and t["value"].strip()),
                     None)
        if asked is None:
            continue
        if tokenizer is None:
            prompts.append(Prompt(turns[asked]["value"]))
            continue
        reply = next((t["value"] for t in turns[asked + 1:] if t.get("from") in ("gpt", "assistant")), "")
        reply_tokens = len(tokenizer.encode(reply, add_special_tokens=False))
        if reply_tokens:
            prompts.append(Prompt(turns[asked]["value"], reply_tokens))
    return prompts
