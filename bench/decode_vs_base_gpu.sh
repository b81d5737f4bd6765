#!/usr/bin/env bash
# The Ling-mini decode bench (bench/ling_mini_gpu.py: TP=1, graphs, the sweep and per-step profiles)
# of this checkout against a base commit's, in one device call: the same card, the same run. Make the
# base here first, then carry it:
#   git archive -o .cache/base-tree.tar <base commit>
#   run("bash bench/decode_vs_base_gpu.sh", kind="nvidia-h200",
#       carry=[".cache/transport-whl", ".cache/base-tree.tar", ".cache/pytest-whl"])
# Order: new, base, new again (the second new run shows the spread). $SWEEP / $PROFILE_C: the
# concurrencies (default 1,8,16,32,64 / 1,8,32,64); $WALL_S bounds each bench run (default 150 s);
# $TREES: more builds benched after the base, `NAME=TAR ...` (each `git archive -o TAR <commit>`,
# carried; results in $OUT/ling_mini_NAME.json). $BENCH_ARGS go to every bench run (e.g. `--shape
# ming-flash --tp 2` on two GPUs); AGAIN=0 skips the second new run; FRESH_TRITON=1 gives each run an
# empty Triton cache (every compile seen: the bench's [compiles] lines);
# $PRE: a command run first (e.g. the kernel bench); TESTS=1 runs the decode GPU tests at the end ($TEST_FILES,
# default the decode fusions, async scheduling and prefill graph tests; $TEST_S bounds them, default 190 s).
# Everything is teed to $OUT/log; each run's JSON lands in $OUT/ling_mini_{new,base,new2}.json and the
# per-step lines of all in $OUT/decode_vs_base_summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/decode-vs-base-out}
mkdir -p "$OUT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
here=$PWD
base=/tmp/omnistage-base
conc=${SWEEP:-1,8,16,32,64}
source bench/gpu_steps.sh

bench() {  # bench NAME DIR: the decode bench of the checkout in DIR; its lines also in $OUT/NAME.out
  (
    cd "$2" && source bench/device_env.sh >/dev/null
    if ((${FRESH_TRITON:-0})); then export TRITON_CACHE_DIR=/tmp/triton-cache-$1 && rm -rf "$TRITON_CACHE_DIR"; fi
    timeout "${WALL_S:-150}" python3 bench/ling_mini_gpu.py --profile-c "${PROFILE_C:-1,8,32,64}" \
      --sweep "$conc" --sweep-tokens 128 --real-requests 2 --max-model-len 4096 --out "$OUT/ling_mini_$1.json" ${BENCH_ARGS:-} \
      2>&1 | grep -v "layers (dummy weights)\|loading weights" | tee "$OUT/$1.out"
    exit "${PIPESTATUS[0]}"
  )
}

(
  device_preamble
  step "base tree" bash -c "rm -rf $base && mkdir -p $base && tar -xf .cache/base-tree.tar -C $base"
  if [[ -n ${PRE:-} ]]; then step "pre: $PRE" bash -c "$PRE"; fi
  step "bench: new" bench new "$here"
  step "bench: base" bench base "$base"
  for tree in ${TREES:-}; do  # NAME=TAR: more builds in the same call (e.g. branches to measure)
    name=${tree%%=*}
    step "tree $name" bash -c "rm -rf /tmp/omnistage-$name && mkdir -p /tmp/omnistage-$name && tar -xf ${tree#*=} -C /tmp/omnistage-$name"
    step "bench: $name" bench "$name" "/tmp/omnistage-$name"
  done
  if ((${AGAIN:-1})); then step "bench: new again" bench new2 "$here"; fi
  if ((${TESTS:-0})); then
    # Each bench run links `omnistage` to its own tree (device_env.sh): the tests import this checkout's.
    source bench/device_env.sh >/dev/null
    step "pytest wheels" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/site .cache/pytest-whl/*.whl
    step "GPU tests" timeout "${TEST_S:-190}" python3 -m pytest -q -rs -p no:cacheprovider \
      ${TEST_FILES:-tests/services/thinker/engine/test_decode_fusions_gpu.py \
        tests/services/thinker/engine/test_async_scheduling_gpu.py tests/services/thinker/engine/test_prefill_graphs_gpu.py}
  fi
  echo "=== per step (graphs): device ops, wall ms, kernel ms ==="
  for x in new base $(for t in ${TREES:-}; do echo "${t%%=*}"; done) new2; do
    echo "$x:"
    grep "^\[profile\].*graphs:.*wall\|^\[sweep\]\|^\[compiles\]" "$OUT/$x.out" 2>/dev/null || echo "  (no profile lines)"
  done | tee "$OUT/decode_vs_base_summary.txt"
  steps_done
) 2>&1 | tee "$OUT/log"
exit "${PIPESTATUS[0]}"
