"""Stop strings matched on the output text across token boundaries. No JAX.

Text that might be the start of a stop string is held back until the next deltas settle it,
so a client never sees part of a stop string; `flush` releases it when the sequence ends for
another reason. The match that ends first wins (as if the text arrived one character at a
time); on a tie, the one that starts first.
"""

from __future__ import annotations

from typing import NamedTuple


class StopCheck(NamedTuple):
    text: str  # safe to emit now; on a match, the final text (stop string trimmed or kept)
    stop: str | None  # the stop string matched; the sequence ends here


class StopChecker:
    def __init__(self, stop: tuple[str, ...], include_stop_str_in_output: bool = False):
        self._stop = tuple(s for s in stop if s)
        self._include = include_stop_str_in_output
        self._held = ""  # text not emitted yet: a possible beginning of a stop string
        self.matched: str | None = None

    @property
    def idle(self) -> bool:
        """No stop strings to look for: `add` would return its delta as it is."""
        return not self._stop

    def add(self, delta: str, armed: bool = True) -> StopCheck:
        """Feed newly decoded text; returns what may be emitted and the match, if any. A match must
        end in `delta`. Unarmed (before min_tokens, or text another worker already checked), text
        is only held back as it would be, and nothing matches."""
        if self.matched is not None:
            return StopCheck("", self.matched)
        if not self._stop:
            return StopCheck(delta, None)
        text = self._held + delta
        match = self._first_match(text, len(self._held)) if armed else None
        if match is not None:
            start, stop = match
            self.matched, self._held = stop, ""
            return StopCheck(text[: start + len(stop)] if self._include else text[:start], stop)
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return StopCheck(text[: len(text) - keep], None)

    def flush(self) -> str:
        """Text held back, released because the sequence ended without a stop string."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str, after: int) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first past `after` characters, if any."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stop:
            start = text.find(stop, max(0, after - len(stop) + 1))
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
