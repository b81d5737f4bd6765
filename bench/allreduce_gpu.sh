#!/usr/bin/env bash
# The peer all-reduce (issue 40 point 3) on a lent GPU machine. $STEPS (default "bench tests"):
#   bench  bench/allreduce_gpu.py on two GPUs next to NCCL ($OUT/allreduce.json) when there are two,
#          and two ranks on GPU 0 ($OUT/allreduce_1gpu.json; on a one-GPU machine $OUT/allreduce.json)
#   tests  the GPU test (tests/services/thinker/tp/test_peer_allreduce_gpu.py)
#   engine (two GPUs) bench/gpu_engine_check.py --tp 2: the tiny thinker's greedy tokens at TP=2
#          through the engine, its decode graphs and the peer path, vs the CPU engine (a call of its own)
#   run("bash bench/allreduce_gpu.sh", kind="nvidia-h200", carry=[".cache/transport-whl", ".cache/pytest-whl"])
#   run("bash bench/allreduce_gpu.sh", kind="nvidia-h200-x2", carry=[".cache/transport-whl", ".cache/pytest-whl"])
#   run("STEPS=engine bash bench/allreduce_gpu.sh", kind="nvidia-h200-x2", carry=[".cache/transport-whl"])
# Everything is teed to $OUT/log; a step that fails is named (`FAILED: <step> (exit N)`, 124: its
# time limit) and the rest still run; exit 1 when any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/allreduce-out}
mkdir -p "$OUT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
source bench/gpu_steps.sh

(
  source bench/device_env.sh || true
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nvidia-smi topo -m || true
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
  gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
  steps=" ${STEPS:-bench tests} "
  if [[ $steps == *" bench "* ]] && [ "$gpus" -ge 2 ]; then
    step "bench: 2 GPUs vs NCCL" timeout 200 python3 bench/allreduce_gpu.py --deadline-s 120 \
      --out "$OUT/allreduce.json"
    one="$OUT/allreduce_1gpu.json"
  else
    one="$OUT/allreduce.json"
  fi
  if [[ $steps == *" bench "* ]]; then
    step "bench: 2 ranks on GPU 0" timeout 170 python3 bench/allreduce_gpu.py --same-gpu --iters 20 \
      --graph-calls 4 --replays 2 --deadline-s 100 --out "$one"
  fi
  if [[ $steps == *" tests "* ]]; then
    step "pytest wheels" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/site .cache/pytest-whl/*.whl
    step "GPU tests" timeout 220 python3 -m pytest -q -rs -p no:cacheprovider \
      tests/services/thinker/tp/test_peer_allreduce_gpu.py
  fi
  if [[ $steps == *" engine "* ]] && [ "$gpus" -ge 2 ]; then
    step "engine: TP=2 tokens" timeout 400 python3 bench/gpu_engine_check.py --tp 2
  fi
  steps_done
) 2>&1 | tee "$OUT/log"
exit "${PIPESTATUS[0]}"
