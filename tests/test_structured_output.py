"""Structured output end to end in the engine: the shipped demo model (real weights) constrained
by llguidance grammars gives the tokens transformers' `generate` gives with the same grammar's
mask as a logits processor, greedy; sampled and mixed batches keep to their grammars; requests
without one beside them are unchanged."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest
import torch
import transformers

from api.structured import request_grammar
from tests.engine_support import drain
from worker.cli import DEMO_MODEL
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.models.loader import load_model, load_tokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
PROMPT = "Mr. Darcy was"


@pytest.fixture(scope="module")
def demo():
    tok = load_tokenizer(DEMO_MODEL)
    engine = LLMEngine(load_model(DEMO_MODEL), tok, EngineConfig(max_num_seqs=8, decode_steps=4))
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()
    return engine, tok, hf


def _grammar(**body) -> str:
    return request_grammar(body)


class GrammarMask(transformers.LogitsProcessor):
    """The reference: llguidance's mask of the same grammar on transformers' scores, token by token."""

    def __init__(self, tok, vocab_size: int, eos_ids: list[int], grammar: str, prompt_len: int):
        self.matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size, eos_token=eos_ids),
                                            grammar)  # fmt: skip
        self.mask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
        self.prompt_len, self.vocab_size = prompt_len, vocab_size

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self.mask, 0)
        ids = np.arange(self.vocab_size)
        allowed = (self.mask[0, ids // 32] >> (ids % 32)) & 1
        return scores.masked_fill(torch.from_numpy(allowed == 0)[None, :], float("-inf"))


def _reference(demo, grammar: str, max_tokens: int) -> list[int]:
    engine, tok, hf = demo
    ids = tok(PROMPT).input_ids
    mask = GrammarMask(tok, engine.model_config.vocab_size, sorted(engine.eos_ids), grammar, len(ids))
    with torch.no_grad():
        prompt = torch.tensor([ids])  # (an explicit mask: the demo's BOS id 0 is no padding)
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_tokens, do_sample=False,
                          logits_processor=[mask], eos_token_id=sorted(engine.eos_ids))  # fmt: skip
    tokens = out[0, len(ids):].tolist()
    return tokens[: next((k + 1 for k, t in enumerate(tokens) if t in engine.eos_ids), len(tokens))]


GRAMMARS = {
    "json_schema": dict(response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}),
    "json_object": dict(response_format={"type": "json_object"}),
    "regex": dict(structured_outputs={"regex": r"(Yes|No), [a-z]+ [a-z]+\."}),
    "choice": dict(structured_outputs={"choice": ["a proud man", "an amiable man", "ill-humoured (and rude)"]}),
    "lark": dict(structured_outputs={"grammar": 'start: "He said " NAME "."\nNAME: /[A-Z][a-z]+/'}),
}


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_greedy_tokens_equal_transformers_with_the_same_mask(demo, kind):
    engine, tok, _ = demo
    grammar = _grammar(**GRAMMARS[kind])
    engine.add_request("g", tok(PROMPT).input_ids, SamplingParams(temperature=0.0, max_tokens=48, grammar=grammar))
    got = drain(engine)[("g", 0)]
    want = _reference(demo, grammar, 48)
    assert got.token_ids == want, (tok.decode(got.token_ids), tok.decode(want))
    text = got.text
    if kind == "json_object" and got.finish_reason == "length":  # any object: the demo may go on past 48 tokens
        assert text.startswith("{") and len(got.token_ids) == 48
        return
    assert got.finish_reason == "stop"  # the rest end within 48 tokens, at an end-of-sequence token
    if kind == "json_schema":
        value = json.loads(text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int) and 0 <= value["age"] <= 120
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "choice":
        assert text in GRAMMARS["choice"]["structured_outputs"]["choice"]
    elif kind == "regex":
        assert text.startswith(("Yes, ", "No, ")) and text.endswith(".")
    else:
        assert text.startswith("He said ") and text[8].isupper() and text.endswith(".")


def test_sampled_and_mixed_batches_keep_to_their_grammars(demo):
    """n=3 sampled choices under a schema, a regex request and plain requests in one batch: each
    constrained choice parses, the plain requests give what they give alone."""
    engine, tok, _ = demo
    ids = tok(PROMPT).input_ids
    plain = SamplingParams(temperature=0.0, max_tokens=20)
    engine.add_request("alone", ids, plain)
    alone = drain(engine)[("alone", 0)].token_ids
    schema = _grammar(**GRAMMARS["json_schema"])
    engine.add_request("json", ids, SamplingParams(temperature=1.0, top_p=0.9, n=3, seed=7, max_tokens=60,
                                                   grammar=schema))  # fmt: skip
    engine.add_request("plain", ids, plain)
    engine.add_request("regex", ids, SamplingParams(temperature=0.8, seed=3, max_tokens=30,
                                                    grammar=_grammar(**GRAMMARS["regex"])))  # fmt: skip
    engine.add_request("plain2", tok("It is a truth").input_ids, SamplingParams(temperature=0.7, seed=1, max_tokens=20))
    got = drain(engine)
    for k in range(3):
        choice = got[("json", k)]
        if choice.finish_reason == "stop":  # (a sampled name may run to max_tokens: then it is cut, as in vLLM)
            value = json.loads(choice.text)
            assert set(value) == {"name", "age"} and 0 <= value["age"] <= 120
        else:
            assert choice.text.startswith("{")
    regex = got[("regex", 0)].text
    assert got[("regex", 0)].finish_reason == "stop" and regex.startswith(("Yes, ", "No, ")) and regex.endswith(".")
    assert got[("plain", 0)].token_ids == alone
    assert len(got[("plain2", 0)].token_ids) == 20
    assert engine.allocator.num_free_pages == engine.allocator.num_pages - 1  # (the reserved page)


def test_a_request_resumed_elsewhere_follows_its_grammar_from_where_it_was(demo):
    """resume_request replays the tokens sent into a fresh matcher: the rest equals the whole."""
    engine, tok, _ = demo
    grammar = _grammar(**GRAMMARS["json_schema"])
    params = SamplingParams(temperature=0.0, max_tokens=48, grammar=grammar)
    engine.add_request("whole", tok(PROMPT).input_ids, params)
    whole = drain(engine)[("whole", 0)].token_ids
    engine.resume_request("rest", tok(PROMPT).input_ids, params, emitted={0: whole[:5]})
    rest = drain(engine)[("rest", 0)].token_ids
    assert whole[:5] + rest == whole
    with pytest.raises(ValueError, match="grammar"):  # tokens the grammar never allowed: refused, nothing held
        engine.resume_request("bad", tok(PROMPT).input_ids, params, emitted={0: tok(" was", add_special_tokens=False).input_ids})
    assert not engine.has_unfinished() and engine.allocator.num_free_pages == engine.allocator.num_pages - 1


@pytest.mark.parametrize("form", ["hermes", "llama3_json"])
def test_a_forced_tool_call_from_the_engine_parses_into_a_call_of_the_named_function(demo, form):
    """tool_choice's grammar (api/tool_grammar.py) on the real model: whatever it would have
    written, the reply is a call of the function, with arguments that keep to its parameters."""
    from api.tool_calls import parse_calls
    from api.tool_grammar import call_grammar
    from api.tools import FORMATS

    engine, tok, _ = demo
    fmt = next(f for f in FORMATS if f.name == form)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}  # fmt: skip
    grammar = call_grammar([weather], fmt, False, lambda text: None)
    engine.add_request("call", tok(PROMPT).input_ids, SamplingParams(temperature=0.0, max_tokens=60, grammar=grammar))
    got = drain(engine)[("call", 0)]
    assert got.finish_reason == "stop", got.text
    (call,) = parse_calls(got.text, fmt)
    arguments = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather" and set(arguments) == {"city", "days"}
    assert 1 <= arguments["days"] <= 7 and len(arguments["city"]) <= 16
