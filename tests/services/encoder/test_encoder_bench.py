"""bench/encoder_throughput.py keeps working: its --tiny CPU mode runs and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench" / "encoder_throughput.py"


def test_tiny_run_writes_a_row_per_modality_and_batch(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--tiny", "--batches", "1,2", "--iters", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "| vision | 128x128 | 2 |" in proc.stdout and "| audio | 10 s | 2 |" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    forwards = [(r["modality"], r["input"], r["batch"]) for r in rows if r["modality"] != "preprocess"]
    assert forwards == [
        ("vision", "128x128", 1),
        ("vision", "128x128", 2),
        ("vision", "256x256", 1),
        ("vision", "256x256", 2),
        ("audio", "10 s", 1),
        ("audio", "10 s", 2),
    ]
    assert all(r["items_s"] > 0 for r in rows)
