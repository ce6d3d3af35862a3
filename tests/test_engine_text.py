"""LLMEngine's stop conditions and streamed text on a "cycle" Llama built so that its greedy
continuation walks a fixed text forever (its tokens, then EOS, then again): predictable text for
stop strings across token boundaries, EOS, stop token ids, lengths and UTF-8 characters split
over tokens. References: transformers' `generate` (the checkpoint really cycles) and the
tokenizer's own `decode` for text.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine_support import ROOMY, drain, hf_greedy, tokenizer  # noqa: F401 (a fixture)
from tests.hf_models import make_hf_model
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

CYCLE_TEXT = "naïve 日€🎉ж!"  # all its tokens differ; "ï" is split inside merged tokens, the rest over byte tokens


@pytest.fixture(scope="module")
def cycle_ckpt(tokenizer, tmp_path_factory):
    """A Llama whose greedy continuation of any cycle token is the next one. Attention and MLP
    outputs are zeroed, so the final hidden state is norm(embedding(current token)); the head row
    of each token's successor is that state, normalised, so it alone gets the top logit."""
    cycle = tokenizer.encode(CYCLE_TEXT, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert len(set(cycle)) == len(cycle)
    path = tmp_path_factory.mktemp("cycle")
    hf = make_hf_model("llama", path, seed=3, vocab_size=len(tokenizer))
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hidden = hf.model.norm(hf.model.embed_tokens.weight)  # [V, H]
        head = torch.zeros_like(hf.lm_head.weight)
        for cur, nxt in zip(cycle, cycle[1:] + cycle[:1]):
            head[nxt] = 4.0 * hidden[cur] / hidden[cur].norm()
        hf.lm_head.weight.copy_(head)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert hf_greedy(hf, cycle[:1], 3 * len(cycle)) == (cycle * 4)[1 : 3 * len(cycle) + 1]  # transformers agrees
    return path, cycle


@pytest.fixture(scope="module")
def cycle_engine(cycle_ckpt) -> LLMEngine:
    return LLMEngine.from_path(cycle_ckpt[0], EngineConfig(**ROOMY))  # async overlap and 4 fused decodes


def cycle_tokens(cycle: list[int], start: int, count: int) -> list[int]:
    return [cycle[(start + i) % len(cycle)] for i in range(count)]


def completion_text(tokenizer, prompt: list[int], output: list[int]) -> str:
    """What the output adds to the prompt's text, by decoding both at once (a character the prompt
    leaves unfinished belongs to the output)."""
    before = tokenizer.decode(prompt, skip_special_tokens=True).rstrip("\ufffd")
    return tokenizer.decode(prompt + output, skip_special_tokens=True)[len(before) :]


def test_stop_string_across_token_boundaries_trimmed_or_kept(cycle_engine, cycle_ckpt, tokenizer):
    _, cycle = cycle_ckpt
    prompt = cycle[:1]
    expected = cycle_tokens(cycle, 1, 40)
    full = completion_text(tokenizer, prompt, expected)
    stop = "ve 日€"  # starts inside a merged token, ends inside byte tokens
    cut = next(k for k in range(len(expected)) if stop in tokenizer.decode(expected[: k + 1]))
    cases = {
        "trim": SamplingParams(temperature=0.0, max_tokens=40, stop=(stop,)),
        "keep": SamplingParams(temperature=0.0, max_tokens=40, stop=(stop, "zzz"), include_stop_str_in_output=True),
        "never": SamplingParams(temperature=0.0, max_tokens=35, stop=("日本",), ignore_eos=True),  # "日" held, released
        "over_eos": SamplingParams(temperature=0.0, max_tokens=40, stop=("!na",), ignore_eos=True),
    }
    for rid, params in cases.items():
        cycle_engine.add_request(rid, prompt, params)
    results = drain(cycle_engine)
    at = full.index(stop)
    assert results[("trim", 0)].text == full[:at] == "aï"
    assert results[("keep", 0)].text == full[: at + len(stop)]
    for rid in ("trim", "keep"):
        assert results[(rid, 0)].finish_reason == "stop" and results[(rid, 0)].stop_reason == stop
        assert results[(rid, 0)].token_ids == expected[: cut + 1]
    never = results[("never", 0)]
    assert never.finish_reason == "length" and never.text == full[: len(CYCLE_TEXT) * 2 - 1]
    over = results[("over_eos", 0)]  # EOS decodes to nothing, so "!" and "na" meet across it
    assert over.stop_reason == "!na" and over.text == full[: full.index("!na")]


def test_stop_token_ids_eos_ignore_eos_and_max_tokens(cycle_engine, cycle_ckpt, tokenizer):
    _, cycle = cycle_ckpt
    bang = tokenizer.convert_tokens_to_ids("!")
    prompt = cycle[:2]
    cases = {
        "eos": SamplingParams(temperature=0.0, max_tokens=40),
        "ignore_eos": SamplingParams(temperature=0.0, max_tokens=2 * len(cycle) - 2, ignore_eos=True),
        "stop_id": SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=(bang,)),
        "max": SamplingParams(temperature=0.0, max_tokens=5),
    }
    for rid, params in cases.items():
        cycle_engine.add_request(rid, prompt, params)
    results = drain(cycle_engine)
    upto_eos = cycle[2:]
    got = results[("eos", 0)]
    assert (got.token_ids, got.finish_reason, got.stop_reason) == (upto_eos, "stop", None)
    assert got.text == completion_text(tokenizer, prompt, upto_eos) == CYCLE_TEXT[2:]
    got = results[("ignore_eos", 0)]
    assert got.token_ids == cycle[2:] + cycle and got.finish_reason == "length"
    assert got.text == CYCLE_TEXT[2:] + CYCLE_TEXT  # EOS kept generating, but is no text
    got = results[("stop_id", 0)]
    assert (got.token_ids[-1], got.finish_reason, got.stop_reason) == (bang, "stop", bang)
    assert got.token_ids == cycle[2 : cycle.index(bang) + 1] and got.text == CYCLE_TEXT[2:-1]  # stop token: no text
    got = results[("max", 0)]
    assert got.token_ids == cycle[2:7] and got.finish_reason == "length"


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_text_deltas_never_split_a_character(cycle_ckpt, tokenizer, decode_steps):
    path, cycle = cycle_ckpt
    assert sum("\ufffd" in tokenizer.decode([t]) for t in cycle) >= 10  # characters really span tokens
    engine = LLMEngine.from_path(path, EngineConfig(**ROOMY, decode_steps=decode_steps))
    count = {start: 3 * len(cycle) - start - 1 for start in range(4)}  # each ends on EOS, between characters
    for start in range(4):  # prompts ending at different points, some inside a character
        engine.add_request(f"s{start}", cycle[: start + 1],
                           SamplingParams(temperature=0.0, max_tokens=count[start], ignore_eos=True))
    results = drain(engine)
    for start in range(4):
        got = results[(f"s{start}", 0)]
        assert got.token_ids == cycle_tokens(cycle, start + 1, count[start])
        assert got.text == completion_text(tokenizer, cycle[: start + 1], got.token_ids)
        assert not any("\ufffd" in d for d in got.deltas), got.deltas
        # streamed in pieces, not at the end (a fused call decodes its tokens' text at once)
        assert sum(1 for d in got.deltas if d) > (10 if decode_steps == 1 else 3)


def test_a_padded_vocabulary_streams_its_padded_ids_as_no_text(tokenizer, tmp_path):
    """A checkpoint whose vocab_size exceeds its tokenizer (rows padded for alignment, as many real
    ones have): a request steered onto a padded id by logit_bias gets the ids and no text, and the
    request beside it is untouched, its greedy tokens transformers'. (Session 76: the first padded
    id sampled raised IndexError in the detokenizer and stopped the engine.)"""
    padded = len(tokenizer) + 16
    hf = make_hf_model("llama", tmp_path, seed=5, vocab_size=padded)
    tokenizer.save_pretrained(tmp_path)
    engine = LLMEngine.from_path(tmp_path, EngineConfig(**ROOMY))
    prompt = tokenizer.encode("the quick brown fox", add_special_tokens=False)
    pad = padded - 3
    engine.add_request("pad", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                     logit_bias=((pad, 100.0),)))
    engine.add_request("plain", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    results = drain(engine)
    got = results[("pad", 0)]
    assert (got.token_ids, got.text, got.finish_reason) == ([pad] * 6, "", "length")
    got = results[("plain", 0)]
    assert got.token_ids == hf_greedy(hf, prompt, 8)
    assert got.text == completion_text(tokenizer, prompt, got.token_ids)
