"""A decode-only stand-in tokenizer for checkpoints that ship none (dummy weights, bare test models).

Benchmarks feed token ids, never text, so the engine only needs `decode` (for its incremental
detokenizer) and `eos_token_id`. Each id decodes to " t<id>": deterministic and never an
incomplete character. Given the vocabulary's size it also hands the engine each id's bytes
(`byte_table`), so its text goes the way a byte-level tokenizer's does (Llama 3's, which the
dummy shapes stand for): a table lookup, not two decode calls a read-back (session 45).
"""

from __future__ import annotations


class IdTokenizer:
    eos_token_id = None  # benchmarks run with ignore_eos

    def __init__(self, vocab_size: int | None = None):
        self.vocab_size = vocab_size

    def byte_table(self) -> tuple[list[bytes], list[bytes]] | None:
        """Each id's bytes (no special tokens: one table serves both ways), or None with no size."""
        if self.vocab_size is None:
            return None
        table = [f" t{i}".encode() for i in range(self.vocab_size)]
        return table, table

    def decode(self, token_ids: list[int], **_: object) -> str:
        return "".join(f" t{int(i)}" for i in token_ids)
