#!/usr/bin/env bash
# One device call before a whole-model measurement (bench/decode_variants_gpu.sh): the decode step's
# GPU tests (each kernel against torch, graphs against eager, every switch on and off) and the kernel
# micro-benches whose choices the variants then set (the decode attention's tiles before its wait,
# one token's MoE layer with the gate-up selecting, the resident projections with the qk-rope
# epilogue and the dense gate-up + SiLU·mul).
#   run("bash bench/decode_checks_gpu.sh", kind="nvidia-h200",
#       carry=[".cache/transport-whl", ".cache/pytest-whl"])
# $TEST_FILES (default: every thinker GPU test but the peer all-reduce's, which wants two GPUs),
# $TEST_S bounds them (default 240 s); $BENCHES: which micro-benches (default "attention moe resident";
# "" none). A step that fails is named and the rest still run. Everything is teed to $OUT/log; the
# benches' JSON lands in $OUT/{attn_preload,moe_select,resident_gemv}.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/decode-checks-out}
mkdir -p "$OUT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
source bench/gpu_steps.sh
default_tests=$(find tests/services/thinker -name "test_*_gpu.py" ! -name "test_peer_allreduce_gpu.py" | sort)

(
  device_preamble
  step "pytest wheels" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .cache/pytest-whl/*.whl
  # shellcheck disable=SC2086 # the file list splits on spaces
  step "GPU tests" timeout "${TEST_S:-240}" python3 -m pytest -q -rs -p no:cacheprovider ${TEST_FILES:-$default_tests}
  for bench in ${BENCHES-attention moe resident}; do
    case $bench in
      attention) step "decode attention: tiles before the wait x warps x a split's fewest tokens" timeout 150 \
        python3 bench/attention_decode_gpu.py --preload --seqs 1 --contexts 128,256,384 --min-chunks 128,256 \
        --out "$OUT/attn_preload.json" ;;
      moe) step "one token's MoE layer: the gate-up selecting vs the router" timeout 100 python3 \
        bench/moe_one_token_gpu.py --select-only --out "$OUT/moe_select.json" ;;
      resident) step "resident projections, the qk-rope epilogue, the dense gate-up" timeout 120 python3 \
        bench/resident_gemv_gpu.py --out "$OUT/resident_gemv.json" ;;
      *) echo "BENCHES: $bench is not one of attention, moe, resident" ;;
    esac
  done
  steps_done
) 2>&1 | tee "$OUT/log"
exit "${PIPESTATUS[0]}"
