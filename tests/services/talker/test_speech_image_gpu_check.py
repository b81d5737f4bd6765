"""bench/speech_image_gpu_check.py (the GPU run's correctness checks) keeps working: its --tiny CPU mode runs
the talker's static-step checks (graphs off CUDA: the static buffers without capture) and the vision
layouts, and every check passes. The DiT kernel checks run on the CPU in tests/services/imagegen."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CHECK = Path(__file__).resolve().parents[3] / "bench" / "speech_image_gpu_check.py"


def test_tiny_checks_pass():
    proc = subprocess.run(
        [sys.executable, str(CHECK), "--tiny", "--only", "talker,vision"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    checks = {d["check"]: d for d in lines if "check" in d}
    assert {
        "talker_capture",
        "talker_step_b1",
        "talker_step_b3",
        "talker_step_b4",
        "talker_vae_backbone_w14",
        "talker_vae_backbone_w18",
        "talker_engine_graphs_on_off",
        "vision_varlen",
    } <= checks.keys()
    assert all(d["ok"] for d in checks.values())
    assert checks["talker_step_b3"]["graphs_on_off_identical"]
    assert lines[-1] == {"failed": []}
