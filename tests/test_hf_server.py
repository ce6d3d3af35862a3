"""redjax beside Hugging Face's own server, `transformers serve --continuous-batching`: the same
greedy completions through the official openai client, the same end-of-sequence ids, and
`bench stack --compare hf` measuring the two on the same load."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

import openai
import pytest
import torch
import transformers

from tests.bench_support import check_serve_report, run_bench
from tests.conftest import free_port
from tests.stack_support import jax_cache_env, make_served_model, start_api, start_worker, stop, wait_until
from worker.bench.hf_server import NO_EOS, wait_listening, hf_serve_argv

PROMPTS = ["hello world", "the quick brown fox", "a tiny tokenizer for tests", "the answer is"]
ENGINE = ("--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--page-size", "8", "--num-pages", "128")


def _end_of_turn_model(path) -> tuple[str, int, str]:
    """The served test model, its generation_config.json naming one more end-of-sequence id, as chat
    checkpoints name their end-of-turn token there: a token greedy decoding of PROMPTS[1] gives at
    step k >= 2 and not before (one config.json and the tokenizer do not name). -> (the directory,
    k, that token's text)."""
    make_served_model(path)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    ids = tok(PROMPTS[1], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:]
    out = out.tolist()
    k = next(k for k in range(2, len(out)) if out[k] not in out[:k] and out[k] != tok.eos_token_id)
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [tok.eos_token_id, out[k]]}))
    return str(path), k, tok.decode([out[k]])


@pytest.fixture(scope="module")
def servers(tmp_path_factory, redis_url):
    """(redjax's openai client, transformers serve's, the model id transformers serve takes, the
    step at which PROMPTS[1]'s greedy completion reaches its end of turn, that token's text)."""
    model_dir, k, end_text = _end_of_turn_model(tmp_path_factory.mktemp("hf-served") / "tinyllama")
    url = redis_url.rsplit("/", 1)[0] + "/6"
    worker = start_worker(model_dir, url, "hf-compare-w0", env=jax_cache_env(tmp_path_factory.mktemp("jax-cache")))
    api, base = start_api(model_dir, url)
    port = free_port()
    with tempfile.TemporaryFile(mode="w+") as log:
        hf = subprocess.Popen(hf_serve_argv(model_dir, port, ()), stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        try:
            wait_listening(hf, f"http://127.0.0.1:{port}", log)
            wait_until(lambda: openai.OpenAI(base_url=base + "/v1", api_key="x").models.list().data, 120)
            yield (openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300),
                   openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300),
                   model_dir, k, end_text)
        finally:
            hf.terminate()
            hf.wait(timeout=60)
            assert stop(api) == 0 and stop(worker) == 0


def test_greedy_completions_match_transformers_serve(servers):
    """Every prompt's greedy completion, streamed and not, is the same with the same token counts
    from both servers. Both stop at the end-of-turn id that generation_config.json names
    (finish_reason "stop", that token counted), and run past it on request (ignore_eos;
    transformers' spelling: a generation_config with eos_token_id -1). One convention differs: an
    end token the tokenizer does not mark special keeps its text in transformers' completion, and
    OpenAI-compatible servers (vLLM, redjax) leave a stop token's text out."""
    ours, theirs, hf_model, k, end_text = servers
    served = ours.models.list().data[0].id
    stops = 0
    for prompt in PROMPTS:
        a = ours.completions.create(model=served, prompt=prompt, max_tokens=12, temperature=0)
        b = theirs.completions.create(model=hf_model, prompt=prompt, max_tokens=12, temperature=0)
        assert a.choices[0].finish_reason == b.choices[0].finish_reason, prompt
        stops += a.choices[0].finish_reason == "stop"
        end = end_text if a.choices[0].finish_reason == "stop" else ""
        assert a.choices[0].text + end == b.choices[0].text, prompt
        assert (a.usage.prompt_tokens, a.usage.completion_tokens) == (b.usage.prompt_tokens, b.usage.completion_tokens)
        stream = ours.completions.create(model=served, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == a.choices[0].text
    assert stops >= 1  # PROMPTS[1] at least, below
    a = ours.completions.create(model=served, prompt=PROMPTS[1], max_tokens=12, temperature=0)
    assert (a.choices[0].finish_reason, a.usage.completion_tokens) == ("stop", k + 1)  # token k ends the turn
    a = ours.completions.create(model=served, prompt=PROMPTS[1], max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    b = theirs.completions.create(model=hf_model, prompt=PROMPTS[1], max_tokens=12, temperature=0, extra_body=NO_EOS)
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.completion_tokens == b.usage.completion_tokens == 12


def test_greedy_chat_matches_transformers_serve(servers):
    """Chat requests: both servers render the model's chat template alike (the same prompt token
    counts) and give each conversation the same greedy reply."""
    ours, theirs, hf_model, _, end_text = servers
    served = ours.models.list().data[0].id
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        a = ours.chat.completions.create(model=served, messages=messages, max_tokens=12, temperature=0)
        b = theirs.chat.completions.create(model=hf_model, messages=messages, max_tokens=12, temperature=0)
        assert a.choices[0].finish_reason == b.choices[0].finish_reason, prompt
        end = end_text if a.choices[0].finish_reason == "stop" else ""
        assert a.choices[0].message.content + end == b.choices[0].message.content, prompt
        assert (a.usage.prompt_tokens, a.usage.completion_tokens) == (b.usage.prompt_tokens, b.usage.completion_tokens)


def test_stack_measures_redjax_against_transformers_serve(tmp_path):
    """`bench stack --compare hf`: each pair serves the same prompts through redjax serve and
    through transformers serve, the same number of tokens each (its requests ignore EOS the way
    that server spells it), and the ratio is the pair's output tok/s."""
    model = make_served_model(tmp_path / "served")
    code, out = run_bench("stack", "--compare", "hf", "--model", str(model), "--pairs", "1", "--num-prompts", "4",
                          "--input-len", "6", "--output-len", "8", "--json", *ENGINE)
    assert code == 0, out
    report = json.loads(out)
    assert report["baseline"] == "hf" and report["failed"] == 0
    pair = report["pairs"][0]
    assert pair["first"] == "serve" and pair["hf_failed"] == 0
    assert pair["serve_prompt_tokens"] == pair["hf_prompt_tokens"] > 0  # the same prompts, counted alike
    assert pair["serve_output_tokens"] == pair["hf_output_tokens"] == 4 * 8
    assert pair["ratio"] == pytest.approx(pair["serve_output_tokens_per_s"] / pair["hf_output_tokens_per_s"])
    assert report["median_ratio"] == pytest.approx(pair["ratio"])
    assert report["hf_output_tokens_per_s"] == pair["hf_output_tokens_per_s"] > 0
    assert "transformers serve" in pair["hf_cpu"]["by_thread_group"]
    check_serve_report(report["last_serve_report"], 4)
    check_serve_report(report["last_hf_report"], 4)


def test_stack_compare_hf_refuses_quantization_before_starting_anything(capsys):
    with pytest.raises(SystemExit) as exit_:
        run_bench("stack", "--compare", "hf", "--quantization", "int8", "--pairs", "1")
    assert exit_.value.code == 2
    assert "no CPU counterpart of --quantization" in capsys.readouterr().err
