#!/usr/bin/env bash
# Time to first audio and co-located stages through `omnistage serve` at the real sizes (issue 35), in
# one device-machine call:  bench/pipeline_latency.sh [CONFIG] [pipeline_latency.py args]
# CONFIG defaults by the GPUs present: 4 or more → deploy/h200x4.yaml (80 GB cards: deploy/h100x4.yaml);
# none → the CPU tiny run (how this script is checked here). Variants default to
# `--variant mps=off --variant mps=on --variant mps=off,first=off,only=speech` (each its own serve).
# On the device carry .cache/transport-whl (`bench/device_wheels.sh --skip silero-vad`: the load speaks
# gRPC, the HTTP front is off) and .cache/ming-flash-config
# (`omnistage make-config-checkpoint --shape ming-flash .cache/ming-flash-config`). Results in $OUT
# (default bench/results): pipeline_latency.{json,md} and each variant's serve log.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  source bench/device_env.sh
  nvidia-smi -L
  gpus=$(nvidia-smi -L | grep -c '^GPU')
fi
config=""
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then config=$1; shift; fi
args=()
if [ -z "$config" ]; then
  mib=0
  [ "$gpus" -gt 0 ] && mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "$gpus" -ge 4 ] && [ "$mib" -lt 100000 ]; then config=deploy/h100x4.yaml
  elif [ "$gpus" -ge 4 ]; then config=deploy/h200x4.yaml
  else config=deploy/local-tiny.yaml; args+=(--tiny)
  fi
fi
[ -f .cache/ming-flash-config/config.json ] && [ "$gpus" -gt 0 ] && args+=(--checkpoint .cache/ming-flash-config)
if [[ " $* " != *" --variant"* ]]; then
  args+=(--variant mps=off --variant mps=on --variant mps=off,first=off,only=speech)
fi
exec $PY bench/pipeline_latency.py --config "$config" --command "bench/pipeline_latency.sh $config $*" \
  "${args[@]}" "$@"
