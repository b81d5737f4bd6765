"""bench/imagegen_speed.py keeps working: its --tiny CPU mode runs every measurement and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench" / "imagegen_speed.py"


def test_tiny_run_writes_every_row(tmp_path):
    out = tmp_path / "bench.json"
    # The GPU image has no gRPC or Prometheus packages: the bench must not import them (or our protos).
    run = (
        "import runpy, sys\n"
        "for name in ('grpc', 'prometheus_client', 'omnistage.v1'): sys.modules[name] = None\n"
        f"sys.argv = [{str(BENCH)!r}] + sys.argv[1:]\n"
        f"runpy.run_path({str(BENCH)!r}, run_name='__main__')"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            run,
            "--tiny",
            "--sizes",
            "64",
            "--concurrency",
            "1,2",
            "--steps",
            "2",
            "--fbcache",
            "1e9",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result["tiny"] and result["steps"] == 2 and "imagegen_speed.py" in result["command"]
    assert {"device", "date"} <= result.keys()
    [row] = result["rows"]  # the recorded result: one per size
    assert row["size"] == 64 and row["steps"] == 2 and row["image_s"] > 0
    assert row["ours_forward_ms"] > 0 and row["diffusers_forward_ms"] > 0 and row["ours_torch_forward_ms"] > 0
    assert [(r["size"], r["concurrency"]) for r in result["batched"]] == [(64, 1), (64, 2)]
    assert result["batched"][1]["largest_batch"] == 2 and all(r["images_s"] > 0 for r in result["batched"])
    fb = result["first_block_cache"]  # a huge threshold: every forward after the first reuses
    assert fb["size"] == 64 and fb["reused_forwards"] == fb["forwards"] - 1 and fb["max_pixel_diff"] >= 0
    assert result["single"][0]["steps_s"] > 0 and result["components"][0]["vae_decode_ms"] > 0
    vs = result["dit_vs_diffusers"]
    assert [(d["size"], d["rows"]) for d in vs] == [(64, 2), (64, 4)]
    assert all(d["max_abs_diff"] < 1e-4 * max(1.0, d["ref_abs_max"]) for d in vs)  # same weights, same output
    assert "| 64 | 2 |" in proc.stdout and "diffusers ms" in proc.stdout
