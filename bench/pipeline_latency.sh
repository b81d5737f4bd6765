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
config=""
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then config=$1; shift; fi
source bench/device_select.sh
args=()
case "$config" in *local-tiny*) args+=(--tiny) ;; esac
[ -f .cache/ming-flash-config/config.json ] && [ "$gpus" -gt 0 ] && args+=(--checkpoint .cache/ming-flash-config)
if [[ " $* " != *" --variant"* ]]; then
  args+=(--variant mps=off --variant mps=on --variant mps=off,first=off,only=speech)
fi
exec $PY bench/pipeline_latency.py --config "$config" --command "bench/pipeline_latency.sh $config $*" \
  "${args[@]}" "$@"
