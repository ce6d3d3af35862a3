#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md ("GPU results"), on a machine with one NVIDIA GPU.
#
#   scripts/gpu_bench.sh RUN... [--out OUTDIR] [--cache-in DIR] [--cache-out] [--autotune-out]
#
# Runs, in the order given:
#   check          the machine (nvidia-smi, jax's devices), tests/test_gpu_attention.py and
#                  tests/test_gpu_prefill.py (the compiled Pallas decode and prefill kernels against
#                  the reference), and tests/test_sampler.py's jnp cases (the GPU's draws)
#   attention      `bench attention`: one layer's decode attention at 64 x 1552 tokens, jnp, JAX's
#                  own Pallas kernel and a sweep of the kernel's work splits, and its prefill
#                  attention (2 rows x 512 tokens) through the reference and the Pallas prefill
#                  kernel; the runs after it take the fastest correct split (--pallas-tuning) and
#                  the prefill kernel where it is faster (--pallas-prefill)
#   launch         `bench launch`: a compiled step's launch time by argument kind (weights, donated
#                  pages, host arrays, as many as llama3-8b's step passes), the device idle and busy,
#                  and with a program of one product a weight (a real step's kernel count)
#   batch1         1 x 128/128: batch-1 decode against the memory-bandwidth roofline
#   128-128        64 x 128/128, with transformers on the same GPU and prompts (--compare hf)
#   128-128-engine 64 x 128/128, the engine alone: a variant of 128-128 (BENCH_FLAGS) without
#                  transformers' ~60 s again
#   1024-128       64 x 1024/128
#   1024-1024      64 x 1024/1024
#   1024-1024-jnp  64 x 1024/1024 with the jnp reference attention instead of the kernel
#
# All runs of one invocation share DEADLINE_S (default 570: one 10-minute device call); each gets
# the time still left. Compiled programs go to a persistent cache (JAX_COMPILATION_CACHE_DIR,
# default /tmp/redjax-jax-cache), so a run cut off by the deadline is cheaper the second time on
# the same machine. Each run writes its `--json` report to OUTDIR/RUN.json (OUTDIR: $OUT when
# set, else ./gpu-results) and appends its stderr to OUTDIR/gpu_bench.log; one summary line per
# run goes to stdout and OUTDIR/summary.txt. A run that fails or passes the deadline is reported
# and the next one still runs.
#
# A device machine starts bare on every call, and an 8B model's step variants took 25-60 s each to
# compile on an H100 (session 17, one after another: a 64 x 1024/1024 warm-up outlasted two
# 10-minute calls; it now plans 12 variants and compiles them several at once, and the dummy
# weights no longer cost a 2-minute compile). So the compile cache can travel between calls: --cache-out writes it, after the runs, as
# OUTDIR/jax-cache.tgz.* (parts of 15 MiB, within what a call brings back), and --cache-in DIR
# unpacks DIR/jax-cache.tgz.* into the cache before the runs (keep the cache's path: XLA's compile
# options, part of every cache key, name it). Leave the call ~20 s past DEADLINE_S
# for the packing (without DEADLINE_S, the runs stop 20 s before the default's 570).
# The compiled programs of an 8B model may not fit in what a call brings back; XLA's autotuning
# results, ~90 % of a first compile's time on a GPU (session 29), are small: --autotune-out packs
# only them (the cache's xla_gpu_per_fusion_autotune_cache_dir) as OUTDIR/xla-autotune.tgz, and
# --cache-in DIR restores DIR/xla-autotune.tgz too. They hold for the same GPU model and XLA.
#
# Environment: PRESET (default llama3-8b), DTYPE (default bfloat16), ATTENTION (default pallas:
# fail rather than fall back to jnp unnoticed), SIZE_SCALE (default 1; a dry run on a CPU divides
# the prompt and output lengths by it), PYTHON (default python3), BENCH_FLAGS (more `bench offline`
# flags for every run, e.g. "--compile-threads 1"), PALLAS_TUNING (the kernel runs' --pallas-tuning,
# until an `attention` run picks one), PALLAS_PREFILL (1: the kernel runs take --pallas-prefill, which fails
# rather than fall back; 0: --no-pallas-prefill, the reference; unset: the engine's default, the kernel
# where it compiles; until an `attention` run finds whether the prefill kernel beats the reference), ATTENTION_FLAGS (more `bench attention` flags), PROFILE (a directory: each
# `bench offline` run also traces 8 calls with prompt chunks and 8 steady decode calls of one more
# round into PROFILE/RUN/prefill and PROFILE/RUN/decode, and reports device time per prefill call and
# per decode step by kind; summary.txt gets the kinds and the top kernels of both).
set -uo pipefail

runs=()
out=${OUT:-gpu-results}
cache_in=
cache_out=
autotune_out=
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --cache-in) cache_in=$2; shift 2 ;;
    --cache-out) cache_out=1; shift ;;
    --autotune-out) autotune_out=1; shift ;;
    *) runs+=("$1"); shift ;;
  esac
done
[ ${#runs[@]} -gt 0 ] || { echo "usage: scripts/gpu_bench.sh RUN... [--out OUTDIR] [--cache-in DIR] [--cache-out] [--autotune-out]" >&2; exit 2; }
preset=${PRESET:-llama3-8b}
dtype=${DTYPE:-bfloat16}
attention=${ATTENTION:-pallas}
deadline=$((SECONDS + ${DEADLINE_S:-570}))
[ -z "$cache_out$autotune_out" ] || deadline=$((deadline - 20))  # time to pack the cache within the call
scale=${SIZE_SCALE:-1}
python=${PYTHON:-python3}
extra=${BENCH_FLAGS:-}  # word-split on purpose: several flags
tuning=(); [ -z "${PALLAS_TUNING:-}" ] || tuning=(--pallas-tuning "$PALLAS_TUNING")
case "${PALLAS_PREFILL:-}" in 1) tuning+=(--pallas-prefill) ;; 0) tuning+=(--no-pallas-prefill) ;; esac
mkdir -p "$out"
log="$out/gpu_bench.log"
export PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/redjax-jax-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0.5}

say() { echo "$*" | tee -a "$out/summary.txt"; }

mkdir -p "$JAX_COMPILATION_CACHE_DIR"
autotune=$JAX_COMPILATION_CACHE_DIR/xla_gpu_per_fusion_autotune_cache_dir  # where jax points XLA's
if [ -n "$cache_in" ]; then
  if compgen -G "$cache_in/jax-cache.tgz.*" >/dev/null; then
    cat "$cache_in"/jax-cache.tgz.* | tar xz -C "$JAX_COMPILATION_CACHE_DIR" \
      && say "cache: restored $(ls "$JAX_COMPILATION_CACHE_DIR" | wc -l) entries from $cache_in"
  elif [ -f "$cache_in/xla-autotune.tgz" ]; then
    mkdir -p "$autotune" && tar xzf "$cache_in/xla-autotune.tgz" -C "$autotune" \
      && say "cache: restored $(find "$autotune" -type f | wc -l) autotuning results from $cache_in"
  else
    say "cache: nothing to restore in $cache_in"
  fi
fi

left() { echo $((deadline - SECONDS > 1 ? deadline - SECONDS : 1)); }

# bench NAME NUM_PROMPTS INPUT OUTPUT [extra flags...]
bench() {
  local name=$1 n=$2 input=$(($3 / scale)) output=$(($4 / scale))
  shift 4
  local json="$out/$name.json" started=$SECONDS profile=()
  [ -z "${PROFILE:-}" ] || profile=(--profile "$PROFILE/$name")
  echo "=== $name: $n x $input/$output $*" >>"$log"
  timeout "$(left)" "$python" -m worker.cli bench offline --dummy "$preset" --dtype "$dtype" \
    --num-prompts "$n" --input-len "$input" --output-len "$output" --json --log-level info "$@" "${profile[@]}" $extra \
    >"$json" 2>>"$log"
  local rc=$?
  if [ $rc -ne 0 ]; then
    rm -f "$json"
    say "$name: FAILED (exit $rc$([ $rc -eq 124 ] && echo ', deadline') after $((SECONDS - started)) s; see gpu_bench.log)"
    tail -3 "$log"
    return 0
  fi
  say "$("$python" - "$json" "$name" "$((SECONDS - started))" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
line = (f"{sys.argv[2]}: {r['output_tokens_per_s']:.0f} output tok/s, {r['roofline_fraction']:.2f}x the roofline, decode {r['decode_step_ms']:.2f} ms/step "
        f"at {r['decode_roofline_fraction']:.0%} of the roofline (batch {r['decode_mean_batch']:.0f}), "
        f"prefill {r['prefill_roofline_fraction']:.0%}, host {r['host_fraction']:.0%}")
d = r["decode_phase"]
if d["calls"]:  # the host's decode share and where it goes, per call (the host target's figure)
    line += (f" (decode {r['decode_host_fraction']:.1%}: per call " + ", ".join(
        f"{part} {d[part + '_s'] / d['calls'] * 1e3:.2f}" for part in ("schedule", "build", "launch", "postprocess"))
        + (f", launch thread {d['launch_thread_s'] / d['calls'] * 1e3:.2f}" if d.get("launch_thread_s") else "")
        + f" ms of {d['wall_s'] / d['calls'] * 1e3:.1f})")
line += (f"; "
        f"attention {r['attention']} {r['engine'].get('pallas_tuning') or 'default'}"
        f"{', prefill kernel' if r.get('pallas_prefill_kernel') else ''}, {r['compiles_during_run']} compiles during the run; "
        f"{r['startup']['variants_compiled_ahead']} variants compiled ahead in {r['startup']['compile_ahead_s']:.0f} s")
if "ratio" in r:
    line += f"; transformers {r['baseline_output_tokens_per_s']:.0f} tok/s ({r['ratio']:.2f}x)"
    if "greedy_match_fraction" in r:
        line += (f", greedy outputs identical {r['greedy_match_fraction']:.0%}, first token "
                 f"{r['greedy_first_token_match_fraction']:.0%}, {r['greedy_mean_common_tokens']:.1f} tokens alike")
print(line + f" [{sys.argv[3]} s]")
if "profile" in r:
    from worker.bench.profile import table
    lines = table(r["profile"])
    at = next((i for i, text in enumerate(lines) if text.startswith("prefill:")), len(lines))
    print("\n".join(f"{sys.argv[2]} " + text for text in lines[:min(at, 9)] + lines[at:at + 9]))
if "profile_error" in r:
    print(f"{sys.argv[2]} profile: failed ({r['profile_error']})")
EOF
)"
}

for run in "${runs[@]}"; do
  case "$run" in
    check)
      { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
        echo "host: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)"
        "$python" -c "import jax, flax, transformers; print(jax.__version__, flax.__version__, transformers.__version__, jax.devices())"
      } >>"$log" 2>&1
      tail -3 "$log"
      timeout "$(left)" "$python" -m pytest -q -p no:cacheprovider tests/test_gpu_attention.py tests/test_gpu_prefill.py \
        >>"$log" 2>&1
      say "check: GPU attention tests exit $? ($(tail -1 "$log"))"
      # the accelerators' sampler (jnp; the [kernel] cases need the CPU backend): draws against float64
      timeout "$(left)" "$python" -m pytest -q -p no:cacheprovider tests/test_sampler.py -k "not kernel" >>"$log" 2>&1
      say "check: sampler tests, jnp path, exit $? ($(tail -1 "$log"))"
      ;;
    attention)
      started=$SECONDS
      echo "=== attention" >>"$log"
      # word-split on purpose: several flags
      if timeout "$(left)" "$python" -m worker.cli bench attention --dummy "$preset" --dtype "$dtype" \
           --context $((1552 / scale)) --prefill-chunk $((512 / scale)) --prefill-context $((1024 / scale)) \
           --json ${ATTENTION_FLAGS:-} >"$out/attention.json" 2>>"$log"; then
        picked=$("$python" - "$out/attention.json" "$out/summary.txt" <<'EOF'
import json, sys
from worker.bench.attention import fastest, prefill_kernel_wins
r = json.load(open(sys.argv[1]))
with open(sys.argv[2], "a") as summary:
    for row in r["results"]:
        line = (f"attention {row['name']}: " + (row["error"] if "error" in row else
                f"{row['us_per_call']:.0f} us/layer, {row['kv_gbs']:.0f} GB/s ({row['bandwidth_fraction']:.0%}), "
                f"max err {row['max_abs_error']:.2g}"))
        print(line, file=sys.stderr)
        summary.write(line + "\n")
    for row in r["prefill"]["results"]:
        line = (f"attention prefill {row['name']}: " + (row["error"] if "error" in row else
                f"{row['us_per_call']:.0f} us/layer, {row['tflops']:.0f} TFLOP/s, max err {row['max_abs_error']:.2g}"))
        print(line, file=sys.stderr)
        summary.write(line + "\n")
best = fastest(r)
kernel = not r["interpret"] and prefill_kernel_wins(r)  # interpreted calls time the interpreter
print((best["name"].split(" ", 1)[1] if best else "-") + (" prefill" if kernel else ""))
EOF
)
        read -r picked prefill_pick <<<"$picked"
        [ "$picked" != - ] || picked=
        if [ "$attention" = pallas ]; then
          tuning=(); [ -z "$picked" ] || tuning=(--pallas-tuning "$picked")
          if [ -n "$prefill_pick" ]; then tuning+=(--pallas-prefill); else tuning+=(--no-pallas-prefill); fi
        fi
        say "attention: fastest Pallas setting ${picked:-none}, prefill kernel $([ -n "$prefill_pick" ] && echo "faster than the reference" || echo "not faster"); the kernel runs after this use ${tuning[*]:-the defaults} [$((SECONDS - started)) s]"
      else
        say "attention: FAILED (exit $?; see gpu_bench.log)"
      fi
      ;;
    launch)
      if timeout "$(left)" "$python" -m worker.cli bench launch --json >"$out/launch.json" 2>>"$log"; then
        "$python" - "$out/launch.json" <<'EOF' | while read -r line; do say "$line"; done
import json, sys
for row in json.load(open(sys.argv[1]))["results"]:
    per = f", {row['us_per_added_argument']:.2f} us per added argument" if "us_per_added_argument" in row else ""
    products = f", {row['products']} products" if row.get("products") else ""
    print(f"launch {row['name']} ({row['weights']} weights, {row['pages']} pages, {row['host']} host arrays{products}): "
          f"{row['median_us']:.0f} us{per}")
EOF
      else
        say "launch: FAILED (exit $?; see gpu_bench.log)"
      fi
      ;;
    batch1) bench batch1 1 128 128 --attention "$attention" "${tuning[@]}" ;;
    # transformers on the same GPU: leave it half the memory (JAX takes 75 % by default)
    128-128) XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 bench 128-128 64 128 128 --attention "$attention" "${tuning[@]}" \
               --compare hf --hf-batch-size 64 ;;
    128-128-engine) bench 128-128-engine 64 128 128 --attention "$attention" "${tuning[@]}" ;;
    1024-128) bench 1024-128 64 1024 128 --attention "$attention" "${tuning[@]}" ;;
    1024-1024) bench 1024-1024 64 1024 1024 --attention "$attention" "${tuning[@]}" ;;
    1024-1024-jnp) bench 1024-1024-jnp 64 1024 1024 --attention jnp ;;
    *) say "$run: unknown run (check, attention, launch, batch1, 128-128, 128-128-engine, 1024-128, 1024-1024, 1024-1024-jnp)" ;;
  esac
done

if [ -n "$cache_out" ]; then
  rm -f "$out"/jax-cache.tgz.*
  tar cz -C "$JAX_COMPILATION_CACHE_DIR" . | split -b 15M - "$out/jax-cache.tgz."
  say "cache: $(ls "$JAX_COMPILATION_CACHE_DIR" | wc -l) entries saved as $(ls "$out"/jax-cache.tgz.* | wc -l) part(s) in $out"
fi
if [ -n "$autotune_out" ]; then
  mkdir -p "$autotune"
  tar czf "$out/xla-autotune.tgz" -C "$autotune" .
  say "cache: $(find "$autotune" -type f | wc -l) autotuning results saved as $out/xla-autotune.tgz ($(du -k "$out/xla-autotune.tgz" | cut -f1) KiB)"
fi
