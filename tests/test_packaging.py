"""pyproject's explicit package list matches the folders with __init__.py (auto-discovery cannot)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def packages_on_disk() -> set[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found = set()
    for name, folder in pyproject["tool"]["setuptools"]["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            if "__pycache__" in rel.parts:
                continue
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    return found


def test_package_list_matches_the_tree():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    on_disk = packages_on_disk()
    assert sorted(on_disk - listed) == [], "packages with __init__.py missing from pyproject.toml"
    assert sorted(listed - on_disk) == [], "packages listed in pyproject.toml without __init__.py"


def test_package_dirs_exist():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for name, folder in pyproject["tool"]["setuptools"]["package-dir"].items():
        assert (ROOT / folder / "__init__.py").exists(), f"{name} -> {folder} has no __init__.py"
