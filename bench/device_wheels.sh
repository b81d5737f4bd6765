#!/usr/bin/env bash
# Run HERE (a machine with PyPI), once, before device runs that start `omnistage serve` or use gRPC:
# downloads the wheels the device image lacks or has too old for Python 3.12 x86-64 into
# .cache/transport-whl (git-ignored): pyproject's runtime dependencies resolved by pip, less what the
# image holds (bench/device_wheels.py; `--extra NAME` adds an optional group, `--skip NAME` leaves one
# behind: `--skip silero-vad` for the gRPC-only benchmarks, to stay within a call's 64 MiB). Carry `.cache/transport-whl`
# in the device call; `source bench/device_env.sh` there installs them into /tmp/site.
# `bash bench/device_wheels.sh bench` instead downloads only what the benchmarks compare against
# (diffusers, pure Python) into .cache/bench-whl (carry it for bench/speech_image_gpu.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = bench ]; then
  mkdir -p .cache/bench-whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    -d .cache/bench-whl diffusers==0.42.1
  ls -l .cache/bench-whl
  exit 0
fi
# Everything `omnistage serve` imports that the device image lacks, derived from pyproject.toml.
exec python3 bench/device_wheels.py --dest .cache/transport-whl "$@"
