"""Incremental detokenization for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen): a table lookup
and an incremental UTF-8 decoder instead of two tokenizer calls a read-back. No JAX.

A byte-level decoder turns each token into bytes on its own (each character of the token maps to
one byte; a token with a character outside that map, an added token's literal text, goes as its
UTF-8) and decodes the concatenation, with U+FFFD for bytes that form no character. So the text
of a stream of tokens is the incremental UTF-8 decoding of their bytes: a character split over
several tokens waits in the decoder until its last byte arrives, and nothing depends on the tokens
around it. That is the whole job of `IncrementalDetokenizer`'s two-window decode for these
tokenizers, at a fraction of its cost (session 45: 8-10 us a row of a fused read-back, most of it
two tokenizer calls on caches the step had just cleared, against ~1 us). `byte_table` builds the
table once per engine, only for a tokenizer whose decoder is exactly that; every other tokenizer
(SentencePiece's, with its dropped first space, WordPiece's) keeps the windowed decode.
"""

from __future__ import annotations

import codecs

PROMPT_CONTEXT = 6  # the prompt's last tokens decoded first (left context; a character they leave open)
REPLACEMENT = "\ufffd"  # what UTF-8 decoding puts for bytes that form no character


def _byte_of_char() -> dict[str, int]:
    """The byte-level alphabet: printable bytes stand for themselves, the other 68 bytes for the
    code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def byte_table(tokenizer) -> tuple[list[bytes], list[bytes]] | None:
    """Each id's bytes, as (special tokens kept, special tokens skipped: b""), for a tokenizer whose
    decoder is byte-level alone or that gives its own (`tokenizer.byte_table()`); None for any
    other (or a slow tokenizer), which then decodes through its windows."""
    own = getattr(tokenizer, "byte_table", None)  # a tokenizer that knows its bytes (the benchmarks' stand-in)
    if callable(own):
        return own()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    byte_of = _byte_of_char()
    kept = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        token = backend.id_to_token(i)
        try:
            kept.append(b"" if token is None else bytes(byte_of[c] for c in token))
        except KeyError:  # not in the alphabet: an added token's literal text
            kept.append(token.encode())
    skipped = list(kept)
    for i in getattr(tokenizer, "all_special_ids", ()):
        if 0 <= i < len(skipped):
            skipped[i] = b""
    return kept, skipped


class ByteLevelDetokenizer:
    """`IncrementalDetokenizer`'s interface over a byte table: `add`, `flush`, `resume`, `text`."""

    def __init__(self, table: tuple[list[bytes], list[bytes]], prompt_token_ids: list[int],
                 skip_special_tokens: bool = True):
        self._bytes = table[1] if skip_special_tokens else table[0]  # id -> its bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._decoder.decode(self._join(prompt_token_ids[-PROMPT_CONTEXT:]))  # the prompt's text: not output
        # the prompt ended inside a character: bytes wait in the decoder. If the output completes
        # it, the character is output text; if not, the U+FFFD for them is not (as the windows do)
        self._prompt_open = bool(self._decoder.getstate()[0])
        self._held = ""  # text decoded on resuming that has not gone out yet
        self.text = ""  # all output text emitted so far

    def add(self, token_ids: list[int]) -> str:
        """Append new output tokens; returns the text they complete (possibly "")."""
        return self._out(self._decoder.decode(self._join(token_ids)))

    def flush(self) -> str:
        """At the end of the sequence: bytes still waiting for their character, as U+FFFD."""
        return self._out(self._decoder.decode(b"", True))

    def resume(self, sent: list[int], held: list[int]) -> str:
        """Take over another worker's stream: the text of `sent` went out there and is returned;
        that of `held` (none, unless the stream began on a detokenizer that holds more back) goes
        out with the next `add`."""
        sent_text = self._out(self._decoder.decode(self._join(sent)))
        self._held = self._decoder.decode(self._join(held))
        return sent_text

    def _out(self, delta: str) -> str:
        if self._prompt_open and delta:
            self._prompt_open = False
            if delta[0] == REPLACEMENT:  # what the prompt left open never completed
                delta = delta[1:]
        if self._held:
            delta, self._held = self._held + delta, ""
        self.text += delta
        return delta

    def _join(self, token_ids: list[int]) -> bytes:
        try:
            return b"".join(map(self._bytes.__getitem__, token_ids))
        except IndexError:  # an id past the tokenizer's vocabulary: a padded row of the model's
            n = len(self._bytes)  # embedding (a tokenizer smaller than vocab_size); no text, as HF decode
            return b"".join(self._bytes[i] if i < n else b"" for i in token_ids)
