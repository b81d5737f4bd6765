#!/usr/bin/env bash
# Voice to voice through /v1/realtime (issue 38) in one device-machine call:
#   bench/realtime_latency.sh [CONFIG] [realtime_latency.py args]
# CONFIG defaults by the GPUs present (bench/device_select.sh: 2 → deploy/h200x2.yaml); none → the CPU
# tiny run. On the device carry .cache/transport-whl (`bench/device_wheels.sh`: the HTTP front and its
# VAD, silero-vad included) and .cache/ming-flash-config
# (`omnistage make-config-checkpoint --shape ming-flash .cache/ming-flash-config`). Results in $OUT
# (default bench/results): realtime_latency.{json,md} and the serve log.
set -uo pipefail
cd "$(dirname "$0")/.."
config=""
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then config=$1; shift; fi
source bench/device_select.sh
args=()
case "$config" in *local-tiny*) args+=(--tiny) ;; esac
[ -f .cache/ming-flash-config/config.json ] && [ "$gpus" -gt 0 ] && args+=(--checkpoint .cache/ming-flash-config)
exec $PY bench/realtime_latency.py --config "$config" --command "bench/realtime_latency.sh $config $*" \
  "${args[@]}" "$@"
