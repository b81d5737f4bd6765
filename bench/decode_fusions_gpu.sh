#!/usr/bin/env bash
# The decode step's kernel fusions (issue 40 point 2) on one GPU, Ling-mini shape, TP=1, graphs:
# the same build with OMNISTAGE_THINKER_FUSIONS on, then off — per-step device ops (graph nodes),
# wall and kernel ms at c=1/8/32, the decode sweep — then the GPU tests (bf16 graphs = bf16 eager
# with the fusions on, fp32 = the reference, the kernels at Ling-mini's MoE shapes).
#   run("bash bench/decode_fusions_gpu.sh", kind="nvidia-h200",
#       carry=[".cache/transport-whl", ".cache/pytest-whl"])
# Everything is teed to $OUT/log; each run's JSON summary lands in $OUT/ling_mini_<AB>_{on,off}.json
# and the per-step lines of both in $OUT/decode_<AB>_summary.txt (AB: fusions unless told). A step that fails is named in
# the log (`FAILED: <step> (exit N)`, 124: its time limit) and the rest still run; the exit status
# is 1 when any failed. $WALL_S bounds each bench run (default 170 s), $TEST_S the tests (default
# 190 s): the whole stays inside one 600 s device call. $SWEEP, $PROFILE_C: the concurrencies
# (default 1,8,32 each).
# AB=gemv: the same A/B of the projections' Triton GEMV (OMNISTAGE_THINKER_GEMV on / off, issue 40
# point 4), after bench/gemv_gpu.py (the kernel vs cuBLAS per shape and M, a config sweep of
# $GEMV_SWEEP_S s; $OUT/gemv.json); its defaults keep the call under 5 minutes: concurrencies 1,8,
# WALL_S 100, no GPU tests (TESTS=1 runs them, GEMV on):
#   run("AB=gemv bash bench/decode_fusions_gpu.sh", kind="nvidia-h200",
#       carry=[".cache/transport-whl", ".cache/pytest-whl"])
# AB=qkv-rope: the same A/B of the qkv projection's QK-norm + rope epilogue (OMNISTAGE_THINKER_QKV_ROPE
# on / off: one or two sequences, whose decode attention does not fold it), after
# bench/resident_gemv_gpu.py (the chains with and without it; $OUT/resident_gemv.json), at
# concurrencies 1,2, then its GPU tests (tests/services/thinker/engine/test_qkv_rope_gpu.py):
#   run("AB=qkv-rope bash bench/decode_fusions_gpu.sh", kind="nvidia-h200",
#       carry=[".cache/transport-whl", ".cache/pytest-whl"])
# AB=gateup-select: the same A/B of one token's experts selected in the gate-up launch
# (OMNISTAGE_THINKER_GATEUP_SELECT on / off, issue 40), after `bench/moe_one_token_gpu.py --select-only`
# (the layer's launches alone, their bits; $OUT/moe_select.json); concurrencies 1,8, WALL_S 100, no
# GPU tests unless TESTS=1 (then tests/services/thinker/engine/test_gate_up_select_gpu.py too).
# AB=fused-embed: the step's embedding lookup in one launch or in torch (OMNISTAGE_THINKER_FUSED_EMBED
# on / off, issue 40: the step's first kernels), concurrencies 1,8, then its GPU tests
# (tests/services/thinker/engine/test_embed_gather_gpu.py).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/decode-fusions-out}
mkdir -p "$OUT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
AB=${AB:-fusions}
tests_file=tests/services/thinker/engine/test_decode_fusions_gpu.py
case $AB in
  fusions) conc=1,8,32 wall=170 tests=1 ;;
  gemv) conc=1,8 wall=100 tests=0 ;;
  qkv-rope) conc=1,2 wall=120 tests=1 tests_file=tests/services/thinker/engine/test_qkv_rope_gpu.py ;;
  gateup-select) conc=1,8 wall=100 tests=0 tests_file=tests/services/thinker/engine/test_gate_up_select_gpu.py ;;
  fused-embed) conc=1,8 wall=120 tests=1 tests_file=tests/services/thinker/engine/test_embed_gather_gpu.py ;;
  *) echo "AB=$AB: expected fusions, gemv, qkv-rope, gateup-select or fused-embed" >&2; exit 2 ;;
esac
common=(--profile-c "${PROFILE_C:-$conc}" --sweep "${SWEEP:-$conc}" --sweep-tokens 128
  --real-requests 2 --max-model-len 4096)
source bench/gpu_steps.sh

bench() {  # bench on|off: Ling-mini decode with $AB on or off; its lines also in $OUT/<AB>_<x>.out
  timeout "${WALL_S:-$wall}" python3 bench/ling_mini_gpu.py "${common[@]}" "--$AB" "$1" \
    --out "$OUT/ling_mini_${AB}_$1.json" 2>&1 | grep -v "layers (dummy weights)\|loading weights" \
    | tee "$OUT/${AB}_$1.out"
  return "${PIPESTATUS[0]}"
}

(
  device_preamble
  if [[ $AB == gemv ]]; then
    step "GEMV vs cuBLAS per shape" timeout 150 python3 bench/gemv_gpu.py --out "$OUT/gemv.json" \
      --sweep-s "${GEMV_SWEEP_S:-45}"
  fi
  if [[ $AB == qkv-rope ]]; then
    step "resident chains with and without the epilogue" timeout 120 python3 bench/resident_gemv_gpu.py \
      --out "$OUT/resident_gemv.json"
  fi
  if [[ $AB == gateup-select ]]; then
    step "one token's MoE layer: the gate-up selecting vs the router" timeout 150 \
      python3 bench/moe_one_token_gpu.py --select-only --out "$OUT/moe_select.json"
  fi
  step "bench: $AB on" bench on
  step "bench: $AB off" bench off
  if ((${TESTS:-$tests})); then
    step "pytest wheels" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/site .cache/pytest-whl/*.whl
    step "GPU tests" timeout "${TEST_S:-190}" python3 -m pytest -q -rs -p no:cacheprovider \
      $([[ $AB == gateup-select ]] && echo tests/services/thinker/engine/test_decode_fusions_gpu.py) \
      "$tests_file"
  fi
  echo "=== per step (graphs): device ops, wall ms, kernel ms ==="
  for x in on off; do
    echo "$AB $x:"
    grep "^\[profile\].*graphs:.*wall\|^\[sweep\]\|^SUMMARY" "$OUT/${AB}_$x.out" 2>/dev/null || echo "  (no profile lines)"
  done | tee "$OUT/decode_${AB}_summary.txt"
  steps_done
) 2>&1 | tee "$OUT/log"
exit "${PIPESTATUS[0]}"
