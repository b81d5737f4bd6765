"""The wheels a bare GPU machine needs to run `omnistage serve`, derived from pyproject.toml.

    python3 bench/device_wheels.py [--extra NAME ...] [--dest .cache/transport-whl]

Resolves the project's runtime dependencies (and the named extras) for the device image's Python
(3.12, x86-64 manylinux) with pip's resolver, drops what the image already holds (torch and the CUDA
stack, numpy, the model-file readers: `IMAGE_HAS`), and downloads the rest, each pinned and without
its dependencies (the resolution already named them). One list, pyproject's: a dependency added there
travels without anyone editing this script.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import tomllib
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


def resolve(reqs: list[str]) -> list[tuple[str, str]]:
    """(name, version) of every package the requirements need on the device, by pip's resolver."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
            + ["--report", str(report), "--target", str(Path(tmp) / "t"), *PLATFORM, *reqs],
            check=True,
        )
        items = json.loads(report.read_text())["install"]
    return [(m["name"], m["version"]) for m in (i["metadata"] for i in items)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--extra", action="append", default=[], help="an optional-dependencies group too")
    ap.add_argument("--dest", default=str(ROOT / ".cache" / "transport-whl"))
    args = ap.parse_args()
    pins = [f"{n}=={v}" for n, v in resolve(requirements(args.extra)) if not image_has(canonical(n))]
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for stale in dest.glob("*.whl"):
        stale.unlink()  # two versions of one package stop the device's install
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(dest), *PLATFORM, *pins],
        check=True,
    )
    wheels = sorted(dest.glob("*.whl"))
    print(f"{len(wheels)} wheels, {sum(w.stat().st_size for w in wheels) / 2**20:.1f} MiB in {dest}:")
    print("\n".join(f"  {w.name}" for w in wheels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
