"""bench/ling_mini_gpu.py keeps working (its --tiny CPU mode): it must pass its own checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[4] / "bench" / "ling_mini_gpu.py"


def _run(tmp_path, *args: str) -> dict:
    out = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--tiny", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_tiny_profile_and_max_load_pass_the_bench_checks(tmp_path):
    report = _run(tmp_path, "--peer-gib", "0.05", "--real-requests", "1")
    (rank,) = report["ranks"]
    assert report["summary"]["ok"] and rank["peers_bytes"] == int(0.05 * (1 << 30))
    assert rank["stress_peak_reserved_bytes"] <= rank["cap_bytes"]


@pytest.mark.slow
def test_tiny_tp2_injected_oom_fails_both_ranks(tmp_path):
    report = _run(tmp_path, "--tp", "2", "--inject-oom-rank", "1")
    assert report["summary"]["ok"]
    assert all("rank 1 failed in warm-up shape" in r["message"] for r in report["ranks"])
