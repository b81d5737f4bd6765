#!/usr/bin/env bash
# The decode step's kernel fusions (issue 40 point 2) on one GPU, Ling-mini shape, TP=1, graphs:
# the same build with OMNISTAGE_THINKER_FUSIONS on, then off — per-step device ops (graph nodes),
# wall and kernel ms at c=1/8/32, the decode sweep — then the GPU tests (bf16 graphs = bf16 eager
# with the fusions on, fp32 = the reference, the kernels at Ling-mini's MoE shapes).
#   run("bash bench/decode_fusions_gpu.sh", kind="nvidia-h200",
#       carry=[".cache/transport-whl", ".cache/pytest-whl"])
# $WALL_S bounds each bench run (default 180 s; the whole script stays under 10 minutes), $SWEEP its concurrencies (default 1,8,32).
set -o pipefail
source bench/device_env.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
log="$OUT/decode_fusions.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$log"
common=(--profile-c "${PROFILE_C:-1,8,32}" --sweep "${SWEEP:-1,8,32}" --sweep-tokens 128
  --real-requests 2 --max-model-len 4096)
for fusions in on off; do
  echo "=== fusions $fusions ===" | tee -a "$log"
  timeout "${WALL_S:-180}" python3 bench/ling_mini_gpu.py "${common[@]}" --fusions "$fusions" \
    --out "$OUT/ling_mini_fusions_$fusions.json" 2>&1 | grep -v "layers (dummy weights)\|loading weights" \
    | tee -a "$log" | grep "^\[profile\].*wall\|^\[sweep\]\|^SUMMARY"
done
echo "=== GPU tests ===" | tee -a "$log"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .cache/pytest-whl/*.whl
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/services/thinker/engine/test_decode_fusions_gpu.py 2>&1 \
  | tail -25 | tee -a "$log"
echo "=== per step (graphs): device ops, wall ms, kernel ms ===" | tee -a "$log"
grep "^\[profile\].*graphs:.*wall\|^=== fusions" "$log" | tee "$OUT/decode_fusions_summary.txt"
