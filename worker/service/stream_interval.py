"""How often a stream gets its next delta: a choice's outputs between two publishes are merged.

Each delta costs the whole serving path a round of work: a Redis entry, the API's read, parse and
SSE write, the client's read. Fused decode calls already produce a choice's tokens in runs, but
steps that mix prefill chunks with decode rows produce one token per running sequence every step
(every ~20 ms on the 2-core CPU while a wave of prompts is admitted). Holding a choice's tokens
until an interval has passed since its last publish halves those deltas there, and leaves the
rest alone. The interval is `interval_s` while the worker runs a full batch and shrinks in
proportion with fewer streams: per-delta costs matter when the machine is saturated, and a lone
stream gets its tokens as they are made.

- a choice's outputs go out at once until one carrying text has (time to first token, as a
  client sees it, is unchanged);
- an output that finishes a choice goes out at once, with everything held before it;
- held outputs go out once they are due, at the worker loop's next turn;
- a delta that carries text carries the text of all its tokens (a resumed request counts on it),
  so tokens that end inside a character are never merged behind text.

A worker that stops with outputs held loses nothing: they were never published, so whoever
resumes the request generates those tokens again from the last published ones.
"""

from __future__ import annotations

import dataclasses

from worker.engine.request_output import RequestOutput


class StreamInterval:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._held: dict[tuple[str, int], RequestOutput] = {}  # (request id, choice) -> merged, not yet out
        self._last: dict[tuple[str, int], float] = {}  # (request id, choice) -> when its text last went out

    def take(self, outputs: list[RequestOutput], now: float, load: float = 1.0) -> list[RequestOutput]:
        """The outputs to publish now, in order: merged with what was held for their choice, then
        any held ones that have come due. `load`: the share of the worker's sequence slots in use."""
        if self.interval_s <= 0:  # off: nothing is ever held
            return outputs
        interval = self.interval_s * min(1.0, max(0.0, load))
        ready: list[RequestOutput] = []
        for out in outputs:
            key = (out.request_id, out.index)
            held = self._held.pop(key, None)
            if held is not None and held.text and not out.text and not (out.finish_reason or out.request_finished):
                # `out`'s tokens end inside a character (their text comes with a later token): a delta
                # with text says the text of all its tokens was sent, which a resumed request relies
                # on, so what was held goes out alone and `out` is held from now
                ready.append(held)
                self._last[key] = now
            elif held is not None:
                out = _merge(held, out)
            last = self._last.get(key)
            if last is None or out.finish_reason or out.request_finished or now - last >= interval:
                ready.append(out)
                if out.text or last is not None:
                    self._last[key] = now
            else:
                self._held[key] = out
            if out.finish_reason or out.request_finished:
                self._last.pop(key, None)
        for key in [k for k in self._held if now - self._last[k] >= interval]:
            ready.append(self._held.pop(key))
            self._last[key] = now
        return ready

    def forget(self, request_id: str) -> None:
        """Drop what is held for a request that leaves this worker unfinished (handed back)."""
        for key in [k for k in (*self._held, *self._last) if k[0] == request_id]:
            self._held.pop(key, None)
            self._last.pop(key, None)


def _merge(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One output carrying `first`'s tokens, text and logprobs followed by `then`'s."""
    logprobs = None if first.logprobs is None and then.logprobs is None else (first.logprobs or []) + (then.logprobs or [])
    return dataclasses.replace(then, token_ids=first.token_ids + then.token_ids, text=first.text + then.text,
                               logprobs=logprobs, prompt_logprobs=first.prompt_logprobs or then.prompt_logprobs)
