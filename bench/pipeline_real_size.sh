#!/usr/bin/env bash
# The whole pipeline at the real Ming sizes through the gateway (issue 22), in one device-machine call:
#   bench/pipeline_real_size.sh [CONFIG] [pipeline_real_size.py args, e.g. --kinds text,vision]
# CONFIG defaults by the GPUs present: 4 or more → deploy/h200x4.yaml (80 GB cards: deploy/h100x4.yaml), 2 or 3 → deploy/h200x2.yaml, none →
# the CPU tiny run (deploy/local-tiny.yaml, tiny sizes, a small plan: how this script is checked here).
# On the device carry .cache/transport-whl (`bench/device_wheels.sh --skip silero-vad`: the load speaks
# gRPC, the HTTP front is off) and .cache/ming-flash-config
# (`omnistage make-config-checkpoint --shape ming-flash .cache/ming-flash-config`, 0.6 MB: writing it
# needs the `onnx` package, which the device image lacks). $BUDGET_S (default 240 on GPUs) bounds the
# seconds of load after start-up: later runs are skipped and listed, so one call fits the device's
# 10 minutes; split the kinds over calls for the whole plan. $TIMEOUT_S is each request's deadline
# (default 120). Results in $OUT (default bench/results): pipeline_real_size.{json,md,serve.log}.
set -uo pipefail
cd "$(dirname "$0")/.."
config=""
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then config=$1; shift; fi
source bench/device_select.sh
args=()
case "$config" in *local-tiny*) args+=(--tiny) ;; esac
if [ "$gpus" -gt 0 ]; then
  args+=(--budget-s "${BUDGET_S:-240}")
  [ -f .cache/ming-flash-config/config.json ] && args+=(--checkpoint .cache/ming-flash-config)
elif [ -n "${BUDGET_S:-}" ]; then
  args+=(--budget-s "$BUDGET_S")
fi
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
exec $PY bench/pipeline_real_size.py --config "$config" --timeout-s "${TIMEOUT_S:-120}" \
  --command "bench/pipeline_real_size.sh $config $*" "${args[@]}" "$@"
