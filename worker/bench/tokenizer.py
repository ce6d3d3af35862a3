"""A decode-only stand-in tokenizer for checkpoints that ship none (dummy weights, bare test models).

Benchmarks feed token ids, never text, so the engine only needs `decode` (for its incremental
detokenizer) and `eos_token_id`. Each id decodes to " t<id>": deterministic and never an
incomplete character, so the detokenizer's work per token stays realistic but small.
"""

from __future__ import annotations


class IdTokenizer:
    eos_token_id = None  # benchmarks run with ignore_eos

    def decode(self, token_ids: list[int], **_: object) -> str:
        return "".join(f" t{int(i)}" for i in token_ids)
