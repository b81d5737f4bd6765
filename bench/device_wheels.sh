#!/usr/bin/env bash
# Run HERE (a machine with PyPI), once, before device runs that start `omnistage serve` or use gRPC:
# downloads the wheels the device image lacks or has too old for Python 3.12 x86-64 into
# .cache/transport-whl (git-ignored): protobuf (our generated code needs >= 7.35.1), grpcio,
# grpcio-health-checking and grpcio-reflection (the service runtime), the talker's and encoder's
# pure-Python extras and PyAV. Carry `.cache/transport-whl`
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
mkdir -p .cache/transport-whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .cache/transport-whl \
  protobuf==7.36.2 grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
# The talker's text normalisation (inflect and what it imports) and the media decoders (PyAV).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .cache/transport-whl \
  inflect==7.6.0 typeguard==4.6.0 more-itertools==11.2.1 jaraco.functools==4.6.0 importlib-metadata==10.2.0 av==18.1.0
# The thinker's grammar-constrained sampling (structured outputs): xgrammar and its FFI runtime
# (xgrammar imports pydantic and transformers: the device image must have them); the HTTP front's
# multipart parser (/v1/audio/transcriptions).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .cache/transport-whl \
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 python-multipart==0.0.34
ls -l .cache/transport-whl
