#!/usr/bin/env bash
# bench/serve_profile.py in one device-machine call:  bench/serve_profile.sh [CONFIG] [serve_profile.py args]
# Carry .cache/transport-whl (bench/device_wheels.sh) and .cache/pyspy-whl (py-spy's manylinux wheel:
# `python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux2014_x86_64 -d .cache/pyspy-whl py-spy`). Results in $OUT (default bench/results).
set -uo pipefail
cd "$(dirname "$0")/.."
config=""
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then config=$1; shift; fi
source bench/device_select.sh
if ls .cache/pyspy-whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .cache/pyspy-whl/*.whl
  export PATH=/tmp/pyspy/bin:$PATH
fi
args=()
case "$config" in *local-tiny*) args+=(--tiny) ;; esac
exec $PY bench/serve_profile.py --config "$config" --command "bench/serve_profile.sh $config $*" "${args[@]}" "$@"
