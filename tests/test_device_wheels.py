"""bench/device_wheels.py carries what `omnistage serve` imports: every third-party module that
services/ and common/ import is a pyproject dependency (or an extra) or something the device image
holds, so deriving the carried wheels from pyproject misses nothing."""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import device_wheels  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def imported_modules() -> set[str]:
    names: set[str] = set()
    for path in [*ROOT.joinpath("services").rglob("*.py"), *ROOT.joinpath("common").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "omnistage"}


def test_every_imported_package_is_declared_or_in_the_image():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {device_wheels.requirement_name(r) for r in project["dependencies"]}
    for group in project.get("optional-dependencies", {}).values():
        declared |= {device_wheels.requirement_name(r) for r in group}
    dists = importlib.metadata.packages_distributions()
    missing = []
    for module in sorted(imported_modules()):
        names = {device_wheels.canonical(d) for d in dists.get(module, [module])}
        if not names & declared and not any(device_wheels.image_has(n) for n in names):
            missing.append(f"{module} ({', '.join(sorted(names))})")
    assert not missing, f"imported but neither in pyproject nor in the device image: {missing}"


def test_the_carried_list_is_pyprojects_less_the_image():
    reqs = {device_wheels.requirement_name(r) for r in device_wheels.requirements([])}
    assert {"grpcio", "protobuf", "starlette", "uvicorn", "av"} <= reqs
    assert not reqs & {"torch", "numpy", "safetensors"}  # the image's own builds stay
