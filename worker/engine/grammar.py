"""Structured output on the host: a request's grammar (as llguidance takes it: a JSON schema, a
regular expression or a Lark grammar, made by the API) held per sequence as a matcher that gives
the bitmask of the tokens its next sample may take and follows the tokens it took. No JAX.

A sequence with a grammar takes one token a call (no fused steps, no drafts), and the engine reads
each call holding one back before it builds the next: the next mask depends on the token drawn.
"""

from __future__ import annotations

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

WORD_BITS = 32  # tokens per mask word: token t is bit t % 32 of word t // 32


def mask_words(vocab_size: int) -> int:
    """i32 words in one row's mask over a vocabulary of `vocab_size` (the logits' width)."""
    return -(-vocab_size // WORD_BITS)


class GrammarCompiler:
    """Makes the matchers of one model: its tokenizer's token texts, read once, on first use."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self._tokens: llguidance.LLTokenizer | None = None

    def matcher(self, grammar: str) -> Grammar:
        """A fresh matcher of `grammar`; ValueError if it does not compile."""
        if self._tokens is None:  # any end-of-sequence id ends a finished grammar
            self._tokens = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                        eos_token=list(self.eos_ids))  # fmt: skip
        matcher = llguidance.LLMatcher(self._tokens, grammar)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
        return Grammar(matcher, mask_words(self.vocab_size))


class Grammar:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int):
        self.matcher, self.words = matcher, words  # words: W, a mask row's i32 words

    def fill(self, masks: np.ndarray, row: int) -> None:
        """Write the tokens the next sample may take into masks[row] (i32[R, W] bitmask rows)."""
        llguidance.numpy.fill_next_token_bitmask(self.matcher, masks, row)

    def consume(self, tokens: list[int]) -> bool:
        """Follow the tokens the sequence took; false if the grammar does not allow one of them."""
        return all(self.matcher.consume_token(t) for t in tokens)

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""
