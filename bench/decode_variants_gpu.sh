#!/usr/bin/env bash
# Many same-build A/Bs of the decode step in one device call: each variant is this checkout's
# Ling-mini decode bench (bench/ling_mini_gpu.py: TP=1, graphs, dummy weights) in a process of its own
# with its own environment (the OMNISTAGE_THINKER_* switches, docs/config.md), started short (the KV
# pinned: no memory search; decode graphs up to the sweep's largest level, at least 2; one real
# request), its sweep at $SWEEP (default 1,1,2). The variants run in $ROUNDS interleaved rounds (default 2; even rounds in
# reverse order), so drift over the call falls on every variant alike; bench/decode_variants.py then
# prints each one's median and best tok/s, its share of the HBM floor and whether its greedy tokens
# are the first variant's.
#   VARIANTS="all= none=OMNISTAGE_THINKER_QKV_ROPE:off;OMNISTAGE_THINKER_GATEUP_SELECT:off tiles2=OMNISTAGE_THINKER_DECODE_TILES:2,4"
#   run("VARIANTS='...' bash bench/decode_variants_gpu.sh", kind="nvidia-h200",
#       carry=[".cache/transport-whl", ".cache/pytest-whl"])
# A variant is NAME=ENV:VALUE;ENV:VALUE... (NAME= alone: the defaults); the first is the reference
# of the token check. BASE=TAR (a `git archive -o TAR <commit>`, carried) adds variant `base`: that
# build with the defaults. $WALL_S bounds each run (default 90 s), $TOKENS its new tokens a request
# (default 256), $BENCH_ARGS go to every run. $PRE: a command run first (a kernel micro-bench);
# TESTS=1 then runs $TEST_FILES (pytest; $TEST_S bounds them, default 150 s). Everything is teed to
# $OUT/log; each run's JSON lands in $OUT/variants/NAME_rK.json, the table in $OUT/decode_variants.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/decode-variants-out}
mkdir -p "$OUT/variants"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
here=$PWD
read -r -a variants <<<"${VARIANTS:-all=}"
if [[ -n ${BASE:-} ]]; then variants+=("base="); fi
source bench/gpu_steps.sh

run_variant() {  # run_variant NAME ROUND: one run of variant NAME (its tree and environment)
  local name=$1 round=$2 spec="" dir=$here
  for v in "${variants[@]}"; do [[ ${v%%=*} == "$name" ]] && spec=${v#*=}; done
  [[ $name == base && -n ${BASE:-} ]] && dir=/tmp/omnistage-base
  (
    cd "$dir" && source bench/device_env.sh >/dev/null
    IFS=';' read -r -a pairs <<<"$spec"
    for pair in "${pairs[@]}"; do [[ -n $pair ]] && export "${pair%%:*}=${pair#*:}"; done
    env | grep '^OMNISTAGE_THINKER_' | sort | sed "s/^/[env] $name: /"
    local seqs=2 level levels
    IFS=, read -r -a levels <<<"${SWEEP:-1,1,2}"
    for level in "${levels[@]}"; do ((level > seqs)) && seqs=$level; done
    timeout "${WALL_S:-90}" python3 bench/ling_mini_gpu.py --sweep "${SWEEP:-1,1,2}" --max-num-seqs "$seqs" \
      --sweep-tokens "${TOKENS:-256}" --max-num-batched-tokens 512 --max-model-len 4096 \
      --kv-tokens 32768 --real-requests 1 --out "$OUT/variants/${name}_r$round.json" ${BENCH_ARGS:-} 2>&1 \
      | grep "^\[sweep\]\|^\[host\]\|Error\|error\|FAILED\|Traceback" | sed "s/^/$name r$round: /"
    exit "${PIPESTATUS[0]}"
  )
}

(
  device_preamble
  if [[ -n ${BASE:-} ]]; then
    step "base tree" bash -c "rm -rf /tmp/omnistage-base && mkdir -p /tmp/omnistage-base && tar -xf $BASE -C /tmp/omnistage-base"
  fi
  if [[ -n ${PRE:-} ]]; then step "pre: $PRE" bash -c "$PRE"; fi
  names=()
  for v in "${variants[@]}"; do names+=("${v%%=*}"); done
  for ((round = 1; round <= ${ROUNDS:-2}; round++)); do
    order=("${names[@]}")
    if ((round % 2 == 0)); then order=(); for ((i = ${#names[@]} - 1; i >= 0; i--)); do order+=("${names[i]}"); done; fi
    for name in "${order[@]}"; do step "variant $name round $round" run_variant "$name" "$round"; done
  done
  echo "=== variants: out tok/s a concurrency (median of the rounds' sweep rows) ==="
  python3 bench/decode_variants.py "$OUT" --order "${names[*]}"
  if ((${TESTS:-0})); then
    source bench/device_env.sh >/dev/null  # the base run linked `omnistage` to its tree
    step "pytest wheels" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/site .cache/pytest-whl/*.whl
    step "GPU tests" timeout "${TEST_S:-150}" python3 -m pytest -q -rs -p no:cacheprovider ${TEST_FILES:-}
  fi
  steps_done
) 2>&1 | tee "$OUT/log"
exit "${PIPESTATUS[0]}"
