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
