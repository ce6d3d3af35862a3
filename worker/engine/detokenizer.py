"""Incremental detokenization: text deltas that never split a UTF-8 character. No JAX.

How a token decodes can depend on its neighbours (SentencePiece drops the leading space of the
first token in a string; byte-level BPE spreads one character over several tokens). So each
step decodes a short window twice, with and without the tokens not emitted yet, and emits the
difference. While the longer text ends in U+FFFD (an incomplete character) nothing is emitted.
After an emission the last CONTEXT tokens emitted (and back to one that is text, where special
tokens are skipped) become the next window's context, not a whole fused call's 16 (session 45: the
two decodes of a row 5.0 -> 3.3 us in a loop). Byte-level tokenizers skip all this
(byte_detokenizer.py); `detokenizers` gives each sequence the right one.
"""

from __future__ import annotations

from typing import Callable, Protocol

from worker.engine.byte_detokenizer import PROMPT_CONTEXT, REPLACEMENT, ByteLevelDetokenizer, byte_table

CONTEXT = 6  # emitted tokens kept as left context for the next ones
MAX_WINDOW = 32  # tokens that decoded to nothing (skipped specials) kept as context at most


class Decoder(Protocol):
    def decode(self, token_ids: list[int], **kwargs) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        # a transformers fast tokenizer decodes in Rust; calling its backend directly skips the
        # Python wrapper, which cost more than the decoding itself (no clean-up either way)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode_ids = backend.decode if backend is not None else self._decode_slow
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # ids that decode to nothing here: never the only context a window keeps
        self._silent = frozenset(getattr(tokenizer, "all_special_ids", ())) if skip_special_tokens else frozenset()
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT:])  # context, then tokens not emitted
        self._read = len(self._ids)  # _ids[:read] is context (emitted text or prompt)
        self.text = ""  # all output text emitted so far

    def add(self, token_ids: list[int]) -> str:
        """Append new output tokens; returns the text they complete (possibly "")."""
        self._ids.extend(token_ids)
        return self._emit(final=False)

    def resume(self, sent: list[int], held: list[int]) -> str:
        """Take over another detokenizer's stream (a request resumed by another worker): the text of
        the `sent` tokens was emitted there, that of the `held` ones not yet (it ended inside a
        character), so they stay pending here. Returns the sent text."""
        self._ids.extend(sent)
        text = self._emit(final=True)
        self._ids.extend(held)
        return text

    def flush(self) -> str:
        """At the end of the sequence: whatever is held back, incomplete characters included."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[: self._read])
        after = self._decode(self._ids)
        if after.endswith(REPLACEMENT) and not final:
            return ""
        if after.startswith(before):
            delta = after[len(before) :]
        else:  # the prompt's tail ended inside a character the output completes
            delta = after[len(before.rstrip(REPLACEMENT)) :]
        if delta or self._read > MAX_WINDOW:
            del self._ids[: self._context_start()]  # the last tokens emitted now: the next context
        self._read = len(self._ids)
        self.text += delta
        return delta

    def _context_start(self) -> int:
        """Where the next window's context starts: CONTEXT tokens from the end, earlier while those
        would all decode to nothing (a SentencePiece window would then lose its leading space)."""
        ids, start = self._ids, max(0, len(self._ids) - CONTEXT)
        while start > 0 and ids[-1] in self._silent and all(t in self._silent for t in ids[start:]):
            start -= 1
        return start

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self._skip_special)

    def _decode_slow(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


Detokenizer = IncrementalDetokenizer | ByteLevelDetokenizer


def detokenizers(tokenizer) -> Callable[[list[int], bool], Detokenizer]:
    """A maker of one detokenizer a sequence, (prompt ids, skip special tokens) -> detokenizer: the
    byte table's for a byte-level tokenizer (built here, once), the windowed one for any other."""
    table = byte_table(tokenizer)
    if table is None:
        return lambda prompt, skip: IncrementalDetokenizer(tokenizer, prompt, skip)
    return lambda prompt, skip: ByteLevelDetokenizer(table, prompt, skip)
