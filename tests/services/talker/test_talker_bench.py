"""bench/talker_speech.py keeps working: its --tiny CPU mode runs through the engine, with the static
(graph) steps and eagerly, and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench" / "talker_speech.py"


def test_tiny_run_writes_a_row_per_concurrency(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--tiny", "--concurrency", "1,2", "--steps", "3", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "| concurrency | requests | TTFA p50 ms |" in proc.stdout
    doc = json.loads(out.read_text())
    assert {"device", "date", "command", "rows"} <= doc.keys() and "talker_speech.py" in doc["command"]
    assert doc["meta"]["graphs"] is True  # rows: the static-step (graph) path; eager_rows: the baseline
    assert "graphs on" in proc.stdout and "graphs off" in proc.stdout
    for rows in (doc["rows"], doc["eager_rows"]):
        assert [(r["concurrency"], r["requests"]) for r in rows] == [(1, 1), (2, 2)]
        for r in rows:
            assert 0 < r["ttfa_p50_ms"] <= r["ttfa_p95_ms"] and r["rtf_mean"] > 0 and r["req_s"] > 0
            assert r["step_ms"] > 0
            assert abs(r["audio_s_per_request"] - 3 * 0.32) < 1e-9
