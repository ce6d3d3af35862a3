"""The demo model shipped with redjax: a tiny Llama that has memorized Pride and Prejudice.

`DEMO_MODEL_DIR` is a Hugging Face checkpoint directory (config.json, model.safetensors,
tokenizer files) made by scripts/train_demo_model.py. `demo_passages` gives prompts from the
corpus with the text that follows them, for tests of any engine that serves the model.
No heavy imports here.
"""

from __future__ import annotations

import re
from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).parent
CORPUS_PATH = DEMO_MODEL_DIR / "corpus" / "pride_and_prejudice.txt"

_CHAPTER = re.compile(r"^Chapter \d+$")
# a sentence ends at . ! or ? (and any closing quotes), except after a title like "Mr."
_SENTENCE_END = re.compile(r"(?<!\bMr)(?<!\bMrs)(?<!\bDr)(?<!\bSt)[.!?]+[\"']*(?=\s|$)")


def read_paragraphs(path: str | Path = CORPUS_PATH) -> list[str]:
    """The corpus as a list of paragraphs (the file separates them with one blank line)."""
    return [p for p in Path(path).read_text(encoding="utf-8").split("\n\n") if p.strip()]


def first_sentence(text: str) -> str:
    """The text up to and including the end of its first sentence (all of it if none ends)."""
    match = _SENTENCE_END.search(text)
    return text[: match.end()] if match else text


def demo_passages(k: int, path: str | Path = CORPUS_PATH, max_words: int = 50) -> list[tuple[str, str]]:
    """k (prompt, expected continuation) pairs from chapter openings spread over the corpus.

    The prompt is the first sentence of a chapter; the expected continuation is the exact
    corpus text after it up to the end of the next sentence, including the whitespace or
    paragraph break that separates them. Chapters whose second sentence is longer than
    `max_words` words are left out. Greedy decoding of the prompt (preceded by the BOS token)
    should reproduce the continuation.
    """
    text = Path(path).read_text(encoding="utf-8")
    paragraphs = read_paragraphs(path)
    candidates = []
    for i, heading in enumerate(paragraphs[:-1]):
        if _CHAPTER.match(heading):
            prompt = first_sentence(paragraphs[i + 1])
            rest = text[text.index(paragraphs[i + 1]) + len(prompt) :]
            gap = len(rest) - len(rest.lstrip())
            expected = rest[:gap] + first_sentence(rest[gap:])
            if len(expected.split()) <= max_words:
                candidates.append((prompt, expected))
    if not 0 < k <= len(candidates):
        raise ValueError(f"k must be in 1..{len(candidates)}, got {k}")
    return [candidates[round(i * (len(candidates) - 1) / max(k - 1, 1))] for i in range(k)]
