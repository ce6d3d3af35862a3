"""What the LLMEngine tests share: the byte-level BPE tokenizer they train, the KV shape most
engines use, transformers' greedy reference, and driving an engine until it is idle while
folding its deltas into per-choice totals."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from tests.byte_bpe import byte_level_bpe
from worker.engine.llm_engine import LLMEngine

CORPUS = [
    "the quick brown fox jumps over the lazy dog, again and again and again.",
    "Héllo wörld! The café serves crème brûlée to a naïve guest.",
    "hello world, this is a test of the tokenizer; numbers 0123456789.",
]
ROOMY = dict(max_num_seqs=8, page_size=8, num_pages=64, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return byte_level_bpe(CORPUS)


def hf_greedy(hf, prompt: list[int], n: int, **kwargs) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, **kwargs)
    return out[0, len(prompt) :].tolist()


@dataclass
class Choice:
    token_ids: list[int] = field(default_factory=list)
    deltas: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def text(self) -> str:
        return "".join(self.deltas)


def collect(results: dict[tuple[str, int], Choice], outputs) -> None:
    """Fold RequestOutputs (deltas) into per-choice totals."""
    for out in outputs:
        choice = results.setdefault((out.request_id, out.index), Choice())
        assert choice.finish_reason is None, f"{out.request_id}/{out.index}: output after it finished"
        choice.token_ids += out.token_ids
        choice.deltas.append(out.text)
        choice.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            assert choice.prompt_logprobs is None, "prompt logprobs sent twice"
            choice.prompt_logprobs = out.prompt_logprobs
        choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason


def drain(engine: LLMEngine, before_step=None, results=None) -> dict[tuple[str, int], Choice]:
    """Step until idle; `before_step(k)` runs before step k (to add or abort requests)."""
    results = {} if results is None else results
    k = 0
    while engine.has_unfinished() or (before_step and k == 0):
        if before_step:
            before_step(k)
        collect(results, engine.step())
        k += 1
        assert k < 3000, "engine does not finish"
    return results


def demo_text_figures(**engine_args) -> tuple[int, float]:
    """The shipped demo model (real weights, its book nearly memorized) with these engine settings:
    (how many of 12 chapter openings it continues with the book's next sentence, its perplexity
    over 24 book paragraphs by prompt logprobs)."""
    import math

    from worker.cli import DEMO_MODEL
    from worker.demo_model import demo_passages, read_paragraphs
    from worker.engine.config import EngineConfig
    from worker.engine.sampling_params import SamplingParams
    from worker.models.loader import load_model, load_tokenizer

    tok = load_tokenizer(DEMO_MODEL)
    passages = demo_passages(12)
    windows = [tok(p).input_ids[:128] for p in read_paragraphs() if len(p) > 400][:24]
    engine = LLMEngine(load_model(DEMO_MODEL), tok, EngineConfig(max_num_seqs=64, **engine_args))
    for i, (prompt, want) in enumerate(passages):
        budget = len(tok(want, add_special_tokens=False).input_ids) + 2
        engine.add_request(f"p{i}", tok(prompt).input_ids, SamplingParams(temperature=0.0, max_tokens=budget))
    for i, window in enumerate(windows):
        engine.add_request(f"w{i}", window, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    got = drain(engine)
    kept = sum(got[(f"p{i}", 0)].text.startswith(want) for i, (_, want) in enumerate(passages))
    logprobs = [e["logprob"] for i in range(len(windows)) for e in got[(f"w{i}", 0)].prompt_logprobs[1:]]
    return kept, math.exp(-sum(logprobs) / len(logprobs))
