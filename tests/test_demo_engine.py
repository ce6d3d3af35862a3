"""The shipped demo model through redjax's own engine: it reproduces its corpus, like transformers does."""

from __future__ import annotations

import torch
import transformers

from worker.demo_model import DEMO_MODEL_DIR, demo_passages
from worker.engine.llm import LLM
from worker.engine.sampling_params import SamplingParams


def test_engine_continues_corpus_passages_and_matches_transformers():
    passages = demo_passages(9)
    llm = LLM(str(DEMO_MODEL_DIR), max_num_seqs=16, num_pages=256)
    params = SamplingParams(temperature=0.0, max_tokens=72)
    results = llm.generate([prompt for prompt, _ in passages], params)
    for (prompt, expected), result in zip(passages, results):
        assert result.outputs[0].text.startswith(expected), (prompt, expected, result.outputs[0].text)

    tok = transformers.AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DEMO_MODEL_DIR)).eval()
    for result in results[:3]:
        ids = torch.tensor([result.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=72, do_sample=False, pad_token_id=tok.eos_token_id)
        assert result.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()


def test_demo_chat_reply_follows_the_template():
    llm = LLM(str(DEMO_MODEL_DIR), max_num_seqs=4, num_pages=64)
    tok = llm.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Who is Mr. Darcy?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.rstrip().endswith("<|assistant|>")
    ids = tok(text, add_special_tokens=False).input_ids
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
    assert len(out.token_ids) > 0 and out.text.strip()
    assert "<|assistant|>" not in out.text  # special tokens are not text


def _chat_ids(tok, question: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def test_min_tokens_matches_transformers_min_new_tokens():
    """min_tokens holds back EOS and stop tokens as transformers' `min_new_tokens` holds back its
    EOS ids: with '"' as the stop token, every demo reply (which opens with a quote) would be one
    token long; with min_tokens both give the same tokens up to the next quote past the limit."""
    llm = LLM(str(DEMO_MODEL_DIR), max_num_seqs=4, num_pages=64)
    tok = llm.tokenizer
    quote = tok('"', add_special_tokens=False).input_ids
    assert len(quote) == 1
    prompts = [_chat_ids(tok, q) for q in ("Who is Mr. Darcy?", "Where does Elizabeth live?", "What did Jane say?")]
    short = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=80, stop_token_ids=tuple(quote)))
    assert [r.outputs[0].token_ids for r in short] == [quote] * 3  # the limit below is what makes them longer
    params = SamplingParams(temperature=0.0, max_tokens=80, min_tokens=12, stop_token_ids=tuple(quote))
    results = llm.generate(prompts, params)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DEMO_MODEL_DIR)).eval()
    for result in results:
        out = result.outputs[0]
        ids = torch.tensor([result.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=80, min_new_tokens=12, do_sample=False,
                              eos_token_id=[*quote, tok.eos_token_id], pad_token_id=tok.eos_token_id)  # fmt: skip
        assert out.token_ids == ref[0, ids.shape[1]:].tolist()
        assert 12 < len(out.token_ids) < 80 and out.token_ids[-1] == quote[0] and quote[0] not in out.token_ids[:12]
        assert out.finish_reason == "stop"


def test_min_tokens_lets_stop_strings_end_only_past_the_limit():
    """A stop string that ends before min_tokens outputs is passed over (vLLM's rule); the first
    that ends in a later token's text ends the sequence. Greedy tokens are those of a run without it."""
    llm = LLM(str(DEMO_MODEL_DIR), max_num_seqs=4, num_pages=64)
    tok = llm.tokenizer
    prompt = _chat_ids(tok, "Who is Mr. Darcy?")
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=120))[0].outputs[0]
    stopped = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=120, stop=('"',)))[0].outputs[0]
    assert stopped.text == "" and plain.text.startswith('"')  # the reply's opening quote ends it at once
    limit = 15
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=120, min_tokens=limit, stop=('"',)))[0]
    out = out.outputs[0]
    before = len(tok.decode(plain.token_ids[: limit - 1]))  # the text of the tokens decoded unarmed
    end = plain.text.index('"', before) if plain.text[before:].count('"') else None
    assert end is not None and end + 1 > before  # the test needs a quote past the limit
    assert out.text == plain.text[:end] and out.finish_reason == "stop"
    assert out.token_ids == plain.token_ids[: len(out.token_ids)] and len(out.token_ids) >= limit
