#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md ("GPU results"), on a machine with one NVIDIA GPU.
#
#   scripts/gpu_bench.sh STAGE [OUTDIR]
#
# Stages, each sized for one 10-minute call of a lent GPU machine (run them in this order):
#   check  the machine (nvidia-smi, jax's devices), the GPU attention tests (the compiled Pallas
#          kernel against the reference), batch-1 decode at 128/128
#   short  64 x 128/128 (with transformers on the same GPU, same prompts) and 64 x 1024/128
#   long   64 x 1024/1024 with the Pallas decode kernel, then with the jnp reference attention
#
# Every run writes its `--json` report to OUTDIR (default: $OUT when set, else ./gpu-results) as
# STAGE-NAME.json, and its stderr to STAGE-NAME.log; a summary line per run goes to stdout.
# A run that fails or passes its time limit is reported and the stage goes on to the next run.
#
# Environment: PRESET (default llama3-8b), DTYPE (default bfloat16), ATTENTION (default pallas:
# fail rather than fall back to jnp unnoticed), RUN_LIMIT_S (default 280 per run),
# SIZE_SCALE (default 1; a dry run on a CPU can divide the prompt and output lengths by it).
set -uo pipefail

stage=${1:?usage: scripts/gpu_bench.sh check|short|long [OUTDIR]}
out=${2:-${OUT:-gpu-results}}
preset=${PRESET:-llama3-8b}
dtype=${DTYPE:-bfloat16}
attention=${ATTENTION:-pallas}
limit=${RUN_LIMIT_S:-280}
scale=${SIZE_SCALE:-1}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

# bench NAME NUM_PROMPTS INPUT OUTPUT [extra flags...]
bench() {
  local name=$1 n=$2 input=$(($3 / scale)) output=$(($4 / scale))
  shift 4
  local json="$out/$stage-$name.json" log="$out/$stage-$name.log"
  local started=$SECONDS
  timeout "$limit" "$python" -m worker.cli bench offline --dummy "$preset" --dtype "$dtype" \
    --num-prompts "$n" --input-len "$input" --output-len "$output" --json "$@" >"$json" 2>"$log"
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "$name: FAILED (exit $rc after $((SECONDS - started)) s; see $log)"
    tail -5 "$log"
    return 0
  fi
  "$python" - "$json" "$name" "$((SECONDS - started))" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
line = (f"{sys.argv[2]}: {r['output_tokens_per_s']:.0f} output tok/s, decode {r['decode_step_ms']:.2f} ms/step "
        f"at {r['decode_roofline_fraction']:.0%} of the roofline (batch {r['decode_mean_batch']:.0f}), "
        f"prefill {r['prefill_roofline_fraction']:.0%}, host {r['host_fraction']:.0%}; "
        f"attention {r['attention']}, {r['compiles_during_run']} compiles during the run")
if "ratio" in r:
    line += f"; transformers {r['baseline_output_tokens_per_s']:.0f} tok/s ({r['ratio']:.2f}x)"
print(line + f" [{sys.argv[3]} s]")
EOF
}

case "$stage" in
  check)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/check-gpu.txt" 2>&1
    "$python" -c "import jax, flax, transformers; print(jax.__version__, flax.__version__, transformers.__version__, jax.devices())" \
      >>"$out/check-gpu.txt" 2>&1
    cat "$out/check-gpu.txt"
    timeout "$limit" "$python" -m pytest -q -p no:cacheprovider tests/test_gpu_attention.py >"$out/check-tests.log" 2>&1
    echo "GPU attention tests: exit $? ($(tail -1 "$out/check-tests.log"))"
    bench batch1 1 128 128 --attention "$attention"
    ;;
  short)
    # transformers on the same GPU: leave it half the memory (JAX takes 75 % by default)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 bench 128-128 64 128 128 --attention "$attention" \
      --compare hf --hf-batch-size 64
    bench 1024-128 64 1024 128 --attention "$attention"
    ;;
  long)
    bench 1024-1024 64 1024 1024 --attention "$attention"
    bench 1024-1024-jnp 64 1024 1024 --attention jnp
    ;;
  *)
    echo "unknown stage $stage (check, short or long)" >&2
    exit 2
    ;;
esac
