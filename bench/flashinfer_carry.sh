#!/usr/bin/env bash
# Run HERE (a machine with PyPI), once, before bench/prefill_ttft.sh on a GPU machine without network:
# packs into .cache/flashinfer-carry/ (git-ignored; carry it, ~4.9 MB) what that run needs beyond
# .cache/transport-whl:
#   flashinfer.tar.xz   flashinfer-python (the version services/thinker/kernels/flashinfer_attention.py
#                       pins: a pure-Python wheel whose kernels are JIT-built by the machine's nvcc) as an
#                       unpacked package without the parts no build reads (CUTLASS's examples, Python
#                       bindings, tests and docs): ~2.1 MB instead of the 7 MB wheel. Unpacked on
#                       PYTHONPATH there. Its other dependencies are in the device image (torch, ninja,
#                       numpy, click, einops, tabulate, nvidia-ml-py, requests, packaging, tqdm,
#                       filelock) or imported only by backends we do not use (nvidia-cudnn-frontend,
#                       nvidia-cutlass-dsl); apache-tvm-ffi comes with .cache/transport-whl (xgrammar
#                       needs it), else its wheel is put here.
#   silero/             the silero-vad package reduced to its ONNX model (2.3 MB instead of 11 MB): the
#                       gateway's HTTP front loads it at start-up (short_http), so transport-whl can be
#                       made with `--skip silero-vad`.
#   ming-flash-config.tar.xz  the config-only Ming-flash checkpoint (`omnistage make-config-checkpoint
#                       --shape ming-flash`: 29 MB, nearly all its tokenizer padded to the release's
#                       vocabulary; 0.3 MB as tar.xz).
# The whole carry for bench/prefill_ttft.sh: .cache/transport-whl (bench/device_wheels.sh --skip
# silero-vad, ~50 MB), .cache/flashinfer-carry (~4.9 MB) and the tree (~4 MB): ~58 MiB of the 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^FLASHINFER_VERSION = "\(.*\)".*/\1/p' services/thinker/kernels/flashinfer_attention.py)
dest=.cache/flashinfer-carry
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${platform[@]}" -d "$tmp" "flashinfer-python==$version" silero-vad
rm -rf "$dest"
mkdir -p "$dest/silero/silero_vad/data" "$tmp/pkg"
python3 - "$tmp" <<'EOF'
import sys, zipfile
from pathlib import Path

tmp = Path(sys.argv[1])
skip = tuple(f"flashinfer/data/cutlass/{d}/" for d in ("examples", "python", "test", "docs", "media"))
with zipfile.ZipFile(next(tmp.glob("flashinfer_python-*.whl"))) as wheel:
    for name in wheel.namelist():
        if not name.startswith(skip):
            wheel.extract(name, tmp / "pkg")
with zipfile.ZipFile(next(tmp.glob("silero_vad-*.whl"))) as wheel:
    onnx = next(n for n in wheel.namelist() if n.endswith("data/silero_vad.onnx"))
    (Path(".cache/flashinfer-carry/silero/silero_vad/data/silero_vad.onnx")).write_bytes(wheel.read(onnx))
EOF
: > "$dest/silero/silero_vad/__init__.py"
tar -C "$tmp/pkg" -cJf "$dest/flashinfer.tar.xz" .
if ! ls .cache/transport-whl/apache_tvm_ffi-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps "${platform[@]}" -d "$dest" "apache-tvm-ffi>=0.1,<0.2"
fi
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
$PY -m omnistage.common.cli make-config-checkpoint --shape ming-flash "$tmp/ming-flash-config" >/dev/null
tar -C "$tmp" -cJf "$dest/ming-flash-config.tar.xz" ming-flash-config
du -sh "$dest" "$dest"/*
