"""pyproject's explicit package list matches the folders with __init__.py (auto-discovery cannot)."""

from __future__ import annotations

import os
import shutil
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


def _recipes(makefile: str) -> dict[str, list[str]]:
    """Each Makefile rule's target → its recipe lines (tab-indented), continuation lines joined."""
    rules: dict[str, list[str]] = {}
    target = None
    for line in makefile.replace("\\\n", " ").splitlines():
        if line.startswith("\t") and target is not None:
            rules[target].append(line.strip())
        elif ":" in line and not line.startswith(("#", "\t")) and "=" not in line.split(":")[0]:
            target = line.split(":")[0].strip()  # (a `NAME := value` line reads as a rule with no recipe)
            rules[target] = []
    return rules


def test_make_test_installs_no_system_package():
    """`make test` (CI, as root) takes prometheus and docker-compose without side effects: unpacked into
    .tools/ by deploy/test-tools.sh, never `apt-get install` / `dpkg -i` (which on a systemd host starts
    a Prometheus service on :9090)."""
    makefile = (ROOT / "Makefile").read_text()
    recipes = _recipes(makefile)
    script = (ROOT / "deploy" / "test-tools.sh").read_text()
    for where, text in [("Makefile", makefile), ("deploy/test-tools.sh", script)]:
        for forbidden in ("apt-get install", "apt install", "dpkg -i", "dpkg --install", "systemctl"):
            assert forbidden not in text, f"{where} runs {forbidden!r}"
    assert "TOOLS_STAMP := .tools/bin/docker-compose" in makefile
    assert recipes["$(TOOLS_STAMP)"][0].startswith("deploy/test-tools.sh ")
    assert "deploy-tools" in makefile.split("\ntest:", 1)[1].splitlines()[0]
    assert "$(TOOLS_STAMP)" in makefile.split("\ndeploy-tools:", 1)[1].splitlines()[0]
    assert "Dir::State::Lists=$apt_dir/lists" in script and "dpkg-deb -x" in script
    assert "/.tools/" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_projects_tools_come_first_on_path():
    tools = ROOT / ".tools" / "bin"
    if not tools.is_dir():
        return  # nothing unpacked yet (a run without `make test`): nothing to put first
    assert os.environ["PATH"].split(os.pathsep)[0] == str(tools)
    for tool in ("prometheus", "promtool", "docker-compose"):
        assert shutil.which(tool) == str(tools / tool)
