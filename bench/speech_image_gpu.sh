#!/usr/bin/env bash
# Issue 21 in one device call: GPU correctness of the fast paths (talker step graphs on/off and
# against eager, the DiT's Triton kernels against torch, flash varlen vision attention), then the
# talker and image benchmarks. Here first (a machine with PyPI): `bash bench/device_wheels.sh bench`
# (diffusers for the same-run DiT comparison → .cache/bench-whl). On the device machine, from the
# repo root, carrying .cache/bench-whl:
#     bash bench/speech_image_gpu.sh
# Everything is teed to $OUT/log; the results JSON land in $OUT/bench/results/ (talker_speech.json,
# imagegen_speed.json; the repo's layout: `cp -r <files_at>/bench/results bench/`). About 5 minutes
# on one H100/H200; each part has its own time limit (150 + 150 + 250 s: the whole stays inside one
# 600 s device call), and a failing check does not stop the benchmarks (the exit status says).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/speech-image-out}
mkdir -p "$OUT/bench/results"
source bench/device_env.sh  # the carried wheels (transport-whl, bench-whl) into /tmp/site; omnistage on PYTHONPATH
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
(
  status=0
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import diffusers; print('diffusers', diffusers.__version__)" || echo "diffusers: not carried"
  echo "== checks"
  timeout 150 python3 bench/speech_image_gpu_check.py || status=1
  echo "== talker benchmark"
  timeout 150 python3 bench/talker_speech.py --concurrency 1,4,8,16 --rounds 2 --graphs both \
    --out "$OUT/bench/results/talker_speech.json" || status=1
  echo "== image benchmark"
  timeout 250 python3 bench/imagegen_speed.py --sizes 512,1024 --concurrency '' --steps 30 --iters 3 \
    --fbcache 0.05 --out "$OUT/bench/results/imagegen_speed.json" || status=1
  echo "== exit status $status"
  exit $status
) 2>&1 | tee "$OUT/log"
exit "${PIPESTATUS[0]}"
