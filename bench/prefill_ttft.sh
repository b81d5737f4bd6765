#!/usr/bin/env bash
# Issue 39 in ONE device-machine call: time to first token through `omnistage serve`, the attention
# backends side by side, the breakdown of a short request, and the GPU correctness check:
#   bench/prefill_ttft.sh [CONFIG] [prefill_ttft.py args]
# CONFIG defaults by the GPUs present (bench/device_select.sh): 2 or 3 → deploy/h200x2.yaml; none → the
# CPU tiny run (deploy/local-tiny.yaml: how this script is checked here; it never writes the GPU file).
# Here, first (a machine with PyPI):
#   bash bench/device_wheels.sh --skip silero-vad       # .cache/transport-whl, ~50 MB
#   bash bench/flashinfer_carry.sh                       # .cache/flashinfer-carry, ~4.9 MB
# then carry .cache/transport-whl and .cache/flashinfer-carry (~58 MiB with the tree). On the device:
#   1. the carried wheels into /tmp/site (device_env.sh), FlashInfer unpacked into /tmp/flashinfer,
#      the config-only Ming-flash checkpoint into .cache/ming-flash-config;
#   2. FlashInfer's kernels built (bench/flashinfer_prebuild.py: fa3 and fa2 in parallel, ~70 s of nvcc)
#      while bench/prefill_check.py runs the fp32 / bf16 correctness check on GPU 0 (~1-2 min);
#   3. bench/prefill_ttft.py: one serve per backend (triton, then flashinfer; ~1 min to start each),
#      every case, results written as they come.
# $BUDGET_S (default 150 on GPUs) bounds each backend's cases after start-up, so the call fits its
# 10 minutes. Results in $OUT (default bench/results): prefill_ttft.{json,md}, prefill_check.json,
# flashinfer_prebuild.json and each serve's log.
set -uo pipefail
cd "$(dirname "$0")/.."
config=""
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then config=$1; shift; fi
source bench/device_select.sh
out=${OUT:-bench/results}
mkdir -p "$out"
args=()
case "$config" in *local-tiny*) args+=(--tiny --free-ports) ;; esac
if [ "$gpus" -gt 0 ]; then
  args+=(--budget-s "${BUDGET_S:-150}")
  carry=.cache/flashinfer-carry
  if [ -f "$carry/ming-flash-config.tar.xz" ] && [ ! -f .cache/ming-flash-config/config.json ]; then
    python3 -c "import tarfile, sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
      "$carry/ming-flash-config.tar.xz" .cache
  fi
  [ -f .cache/ming-flash-config/config.json ] && args+=(--checkpoint .cache/ming-flash-config)
  if [ -d "$carry/silero" ]; then export PYTHONPATH=$PWD/$carry/silero:${PYTHONPATH:-}; fi
  if ls "$carry"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$carry"/*.whl
  fi
  if [ -f "$carry/flashinfer.tar.xz" ]; then
    mkdir -p /tmp/flashinfer
    python3 -c "import tarfile, sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
      "$carry/flashinfer.tar.xz" /tmp/flashinfer
    export PYTHONPATH=/tmp/flashinfer:${PYTHONPATH:-}
    $PY -c "import flashinfer; print('flashinfer', flashinfer.__version__)" || echo "flashinfer does not import"
    $PY bench/flashinfer_prebuild.py --out "$out" > /tmp/flashinfer_family 2> "$out/flashinfer_prebuild.log" &
    prebuild=$!
  fi
  $PY bench/prefill_check.py --out "$out" 2>&1 | tail -20
  if [ -n "${prebuild:-}" ]; then
    wait "$prebuild"
    cat "$out/flashinfer_prebuild.log"
    family=$(tail -1 /tmp/flashinfer_family)
    echo "FlashInfer family: ${family:-none}"
    if [ -n "$family" ] && [ "$family" != none ]; then export OMNISTAGE_FLASHINFER_BACKEND=$family; fi
  fi
  args+=(--checks "$out/prefill_check.json")
fi
exec $PY bench/prefill_ttft.py --config "$config" --out "$out" --command "bench/prefill_ttft.sh $config $*" \
  "${args[@]}" "$@"
