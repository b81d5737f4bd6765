#!/usr/bin/env bash
# Decode CUDA graphs under tensor parallelism, Ming-flash thinker shape at TP=4 (dummy weights):
# aligned capture (ranks agree before each size) with a decode sweep, the eager baseline in the
# same run, then the unaligned capture that hung once (each rank's stacks land in $OUT/stacks-*).
# $MODES picks the modes (default "aligned off unaligned"), $SWEEP the concurrencies, $WALL_S each run's limit.
#   run("bash bench/tp_graphs_gpu.sh", kind="nvidia-h100-x4", carry=[".cache/transport-whl"])
set -o pipefail
source bench/device_env.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SWEEP=${SWEEP:-1,8,32}
common=(--shape ming-flash --tp 4 --real-requests 2 --sweep "$SWEEP" --sweep-tokens 128)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/tp_graphs.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())" | tee -a "$OUT/tp_graphs.log"
for mode in ${MODES:-aligned off unaligned}; do
  echo "=== tp graphs: $mode ===" | tee -a "$OUT/tp_graphs.log"
  python3 bench/ling_mini_gpu.py "${common[@]}" --tp-graphs "$mode" --stacks-dir "$OUT/stacks-$mode" \
    --stacks-after-s 45 --wall-s "${WALL_S:-170}" --out "$OUT/tp4_$mode.json" 2>&1 | grep -v "layers (dummy weights)\|loading weights" | tee -a "$OUT/tp_graphs.log"
done
