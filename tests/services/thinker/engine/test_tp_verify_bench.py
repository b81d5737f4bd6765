"""bench/tp_verify_gpu.py works before its first GPU run: its --tiny CPU mode (gloo, TP=2) passes
every check — starts, SIGKILL while streaming, TP=2 == TP=1 greedy tokens (TP=2's from the start
before the SIGKILL: in --tiny it has the parity's shape), warm-up OOM on each rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[4] / "bench" / "tp_verify_gpu.py"


@pytest.mark.slow
def test_tiny_tp2_passes_every_check(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--tiny",
            "--tp",
            "2",
            "--starts",
            "1",
            "--streams",
            "4",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(out.read_text())
    names = [c["name"] for c in report["checks"]]
    assert report["ok"] and len(names) == 6, names  # a, b, e, c (TP=2 vs 1), d on rank 1 and on rank 0
    sigkill = next(c for c in report["checks"] if c["name"].startswith("(e)"))
    assert "thinker rank 1 died while serving" in sigkill["data"]["client_message"]
