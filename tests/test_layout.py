"""The formatter owns the layout: the tree is `ruff format`-clean, and no code opts out of it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_tree_is_formatted_by_the_formatter():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"run `ruff format .`:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"


def test_no_code_opts_out_of_the_formatter():
    marked = [
        str(p.relative_to(ROOT))
        for d in ("common", "services", "tests", "bench", "load_tests", "protos")
        for p in (ROOT / d).rglob("*.py")
        if "fmt: " + "skip" in p.read_text() or "fmt: " + "off" in p.read_text()
    ]
    assert marked == []
