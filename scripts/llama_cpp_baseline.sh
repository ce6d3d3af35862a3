#!/usr/bin/env bash
# llama.cpp as a CPU baseline for redjax (docs/benchmarks.md, "Against llama.cpp"): builds llama.cpp
# from the source that PyPI's llama-cpp-python sdist carries (no network beyond PyPI), writes a
# llama-100m-shaped checkpoint with random weights and a byte-level BPE tokenizer both servers read,
# converts it to GGUF in float32, bfloat16, Q8_0 and Q4_0, and prints the commands that compare
# them with redjax, offline and served.
#
#   scripts/llama_cpp_baseline.sh [OUTDIR]        (default /tmp/llama-cpp-baseline; ~10 min on 2 cores)
#
# Needs cmake, g++ and the project's dev virtualenv (.venv: transformers, torch). Everything goes
# under OUTDIR; nothing in the checkout changes.
set -euo pipefail

OUT=${1:-/tmp/llama-cpp-baseline}
VERSION=0.3.36  # llama-cpp-python; its vendor/llama.cpp is what gets built
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=$ROOT/.venv/bin/python
SRC=$OUT/llama_cpp_python-$VERSION/vendor/llama.cpp
MODEL=$OUT/llama-100m
mkdir -p "$OUT"

if [ ! -x "$SRC/build/bin/llama-server" ]; then
  "$PY" -m pip download -q "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d "$OUT"
  tar xzf "$OUT/llama_cpp_python-$VERSION.tar.gz" -C "$OUT"
  cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$OUT/cmake.log" 2>&1
  cmake --build "$SRC/build" -j"$(nproc)" --target llama-server llama-batched-bench llama-quantize > "$OUT/build.log" 2>&1
fi

# The converter knows published tokenizers by a hash of how they split a test text and refuses
# others; this one pre-tokenizes with GPT-2's regex, so unknown byte-level BPEs are told "gpt-2".
if ! grep -q "redjax: unknown byte-level BPE" "$SRC/conversion/base.py"; then
  "$PY" - "$SRC/conversion/base.py" <<'EOF'
import sys
path = sys.argv[1]
text = open(path).read()
anchor = "        if res is None:\n            logger.warning(\"\\n\")"
assert anchor in text, "the converter changed: find where get_vocab_base_pre gives up"
text = text.replace(anchor, "        if res is None:  # redjax: unknown byte-level BPE\n            res = \"gpt-2\"\n" + anchor, 1)
open(path, "w").write(text)
EOF
fi
[ -d "$OUT/pylib/sentencepiece" ] ||  # the converter imports it for every Llama
  "$PY" -m pip install -q --target "$OUT/pylib" sentencepiece

if [ ! -f "$MODEL/model.safetensors" ]; then
  "$PY" - "$ROOT" "$MODEL" <<'EOF'
# llama-100m's shape, random weights (seed 0), and a 32000-token byte-level BPE trained on the demo
# model's book, this checkout's text and Python's own library, so that sampled ids decode to text in both servers
import json, subprocess, sys, sysconfig
from pathlib import Path
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
root, out = Path(sys.argv[1]), Path(sys.argv[2])
texts = [(root / "worker/demo_model/corpus/pride_and_prejudice.txt").read_text()]
files = subprocess.run(["git", "-C", root, "ls-files", "*.md", "*.py", "*.cc", "*.h"], capture_output=True,
                       text=True, check=True).stdout.split()
texts += [(root / f).read_text(errors="replace") for f in files]
stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:3000]  # enough text for 32000 tokens
texts += [p.read_text(errors="replace") for p in stdlib]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|bos|>", "<|eos|>"],
                                                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
cfg = json.loads((root / "worker/models/presets/llama-100m.json").read_text())
cfg.update(bos_token_id=0, eos_token_id=1)
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(out)
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                               clean_up_tokenization_spaces=False)
fast.save_pretrained(out)
print(f"{out}: llama-100m, tokenizer of {len(fast)} tokens (config's vocab_size {cfg['vocab_size']})")
EOF
fi

for type in f32 bf16 q8_0; do
  [ -f "$OUT/llama-100m-$type.gguf" ] || PYTHONPATH="$SRC/gguf-py:$OUT/pylib" "$PY" "$SRC/convert_hf_to_gguf.py" \
    "$MODEL" --outtype "$type" --outfile "$OUT/llama-100m-$type.gguf" > "$OUT/convert-$type.log" 2>&1
done
[ -f "$OUT/llama-100m-q4_0.gguf" ] || "$SRC/build/bin/llama-quantize" "$OUT/llama-100m-f32.gguf" \
  "$OUT/llama-100m-q4_0.gguf" Q4_0 "$(nproc)" > "$OUT/quantize.log" 2>&1

B=$SRC/build/bin
cat <<EOF

Built: $B/llama-server, llama-batched-bench. Model: $MODEL and $OUT/llama-100m-{f32,bf16,q8_0,q4_0}.gguf.
Pairs: f32 with redjax's default, bf16 with --dtype bfloat16, q8_0 with --quantization int8, q4_0 with --quantization int4.

Offline (engines alone, 64 x 128/128; llama.cpp's output tok/s = 64 * 128 / its T s):
  $B/llama-batched-bench -m $OUT/llama-100m-f32.gguf -c 16384 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 64 -t $(nproc)
  redjax bench offline --model $MODEL --num-prompts 64 --input-len 128 --output-len 128 --rounds 2

Served (both up; wait for redjax's "compiled ... while idle" log line before measuring):
  $B/llama-server -m $OUT/llama-100m-f32.gguf -t $(nproc) -tb $(nproc) -np 64 -c 32768 --port 8090 &
  redjax serve --model $MODEL --port 8000 &
  redjax bench serve --url http://127.0.0.1:8000 --compare-url http://127.0.0.1:8090 --tokenizer $MODEL \\
    --input-len 128 --output-len 128 --num-prompts 64 --pairs 2 --seed 1
  (one stream at a time: --num-prompts 16 --concurrency 1 --pairs 3; a new --seed for each run, or
  the prefix caches of both servers hold the prompts)
EOF
