"""The wheels a bare GPU machine needs to run `omnistage serve`, derived from pyproject.toml.

    python3 bench/device_wheels.py [--extra NAME ...] [--dest .cache/transport-whl]

Resolves the project's runtime dependencies (and the named extras) for the device image's Python
(3.12, x86-64 manylinux) with pip's resolver, drops what the image already holds (torch and the CUDA
stack, numpy, the model-file readers: `IMAGE_HAS`), and downloads the rest, each pinned and without
its dependencies (the resolution already named them). One list, pyproject's: a dependency added there
travels without anyone editing this script. A device call carries 64 MiB in all: the benchmarks that
speak gRPC only (gateway.http_port 0) leave the Realtime endpoint's VAD behind (`--skip silero-vad`).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the device image brings (KINDS.md's package list) and the project uses as it is there.
IMAGE_HAS = {
    "torch",
    "triton",
    "numpy",
    "pillow",
    "onnxruntime",
    "safetensors",
    "tokenizers",
    "pyyaml",
    "prometheus-client",
    "transformers",
    "huggingface-hub",
    "sympy",
    "networkx",
    "jinja2",
    "markupsafe",
    "fsspec",
    "filelock",
    "mpmath",
    "setuptools",
    "packaging",
    "regex",
    "requests",
    "tqdm",
}
IMAGE_PREFIXES = ("nvidia-", "cuda-")
# Files of a wheel the project never reads, left out of the device's copy (a call carries 64 MiB):
# silero-vad ships eight model files, the Realtime VAD loads `data/silero_vad.onnx` alone.
UNUSED_FILES = {"silero-vad": re.compile(r"silero_vad/data/(?!silero_vad\.onnx$)")}
PLATFORM = [
    "--only-binary=:all:",
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    *(f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")),
]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    return canonical(re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0])


def requirements(extras: list[str]) -> list[str]:
    """pyproject's runtime dependencies (and `extras`), less what the image holds."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return [r for r in reqs if not image_has(requirement_name(r))]


def image_has(name: str) -> bool:
    return name in IMAGE_HAS or name.startswith(IMAGE_PREFIXES)


def resolve(reqs: list[str], skip: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """(name, version) of every package the requirements need on the device, by pip's resolver, less
    what only the image's own packages need (their dependencies are the image's too)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
            + ["--report", str(report), "--target", str(Path(tmp) / "t"), *PLATFORM, *reqs],
            check=True,
        )
        items = {
            canonical(i["metadata"]["name"]): i["metadata"] for i in json.loads(report.read_text())["install"]
        }
    needed: set[str] = set()
    todo = [requirement_name(r) for r in reqs]
    while todo:  # walk from the project's requirements, never into a package the image holds
        name = todo.pop()
        if name in needed or image_has(name) or name in skip or name not in items:
            continue
        needed.add(name)
        todo += [requirement_name(r) for r in items[name].get("requires_dist", []) if _applies(r)]
    return [(items[n]["name"], items[n]["version"]) for n in sorted(needed)]


def _applies(requirement: str) -> bool:
    """A requirement the device's Python 3.12 on Linux x86-64 installs (no extras asked for)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.requirements import Requirement
    marker = Requirement(requirement).marker
    env = {"python_version": "3.12", "sys_platform": "linux", "platform_machine": "x86_64", "extra": ""}
    return marker is None or marker.evaluate(env)


def slim(wheel: Path) -> int:
    """Drop the files `UNUSED_FILES` names from `wheel` in place (pip installs what is there and writes
    its own RECORD); returns the bytes saved."""
    unused = UNUSED_FILES.get(canonical(wheel.name.split("-", 1)[0]))
    if unused is None:
        return 0
    before = wheel.stat().st_size
    slimmed = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slimmed, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if not unused.match(item.filename):
                dst.writestr(item, src.read(item))
    slimmed.replace(wheel)
    return before - wheel.stat().st_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--extra", action="append", default=[], help="an optional-dependencies group too")
    ap.add_argument("--dest", default=str(ROOT / ".cache" / "transport-whl"))
    ap.add_argument(
        "--skip",
        action="append",
        default=[],
        help="leave a package (and what only it needs) behind, for a run that never imports it: "
        "silero-vad (11 MiB) is the Realtime endpoint's VAD, loaded only when gateway.http_port is set",
    )
    args = ap.parse_args()
    skip = frozenset(canonical(n) for n in args.skip)
    pins = [f"{n}=={v}" for n, v in resolve(requirements(args.extra), skip)]
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for stale in dest.glob("*.whl"):
        stale.unlink()  # two versions of one package stop the device's install
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(dest), *PLATFORM, *pins],
        check=True,
    )
    saved = sum(slim(w) for w in dest.glob("*.whl"))
    wheels = sorted(dest.glob("*.whl"))
    print(f"left out {saved / 2**20:.1f} MiB of files the project never reads")
    print(f"{len(wheels)} wheels, {sum(w.stat().st_size for w in wheels) / 2**20:.1f} MiB in {dest}:")
    print("\n".join(f"  {w.name}" for w in wheels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
