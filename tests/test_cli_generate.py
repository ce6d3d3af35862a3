"""`redjax generate`: the offline CLI prints one JSON object per prompt, in order, matching transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
import transformers

from tests.stack_support import REPO, _env, make_served_model


def test_generate_json_matches_transformers_greedy(tmp_path):
    model_dir = make_served_model(tmp_path / "m")
    prompts = ["hello world", "the quick brown fox jumps", "a"]
    out = subprocess.run(
        [sys.executable, "-m", "worker.cli", "generate", "--model", str(model_dir), "--max-tokens", "12", "--json",
         "--page-size", "8", "--num-pages", "64", "--max-num-seqs", "4"]
        + [arg for p in prompts for arg in ("--prompt", p)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["prompt"] for r in rows] == prompts
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    for row in rows:
        assert set(row) >= {"text", "token_ids", "finish_reason"}
        ids = tok(row["prompt"], return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)[0, ids.shape[1]:]
        ref = ref.tolist()
        if tok.eos_token_id in ref:  # transformers stops at EOS and so must we
            ref = ref[: ref.index(tok.eos_token_id) + 1]
        assert row["token_ids"] == ref
        assert row["finish_reason"] == ("stop" if ref[-1] == tok.eos_token_id else "length")
        assert row["text"] == tok.decode([t for t in ref if t != tok.eos_token_id], skip_special_tokens=True)


def test_generate_rejects_bad_parameters_clearly(tmp_path):
    model_dir = make_served_model(tmp_path / "m")
    out = subprocess.run(
        [sys.executable, "-m", "worker.cli", "generate", "--model", str(model_dir), "--prompt", "x", "--top-p", "0"],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0 and "top_p" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "worker.cli", "generate", "--model", str(tmp_path / "missing"), "--prompt", "x"],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0 and "does not exist" in out.stderr
