"""bench/prefill_ttft.py's CPU dry run through `omnistage serve` (deploy/local-tiny.yaml, tiny sizes):
every case gives a row with the issue's keys and no error, the cached cases take their prefix from
the cache and the new ones do not, each row carries its breakdown, and the dry run writes only its own
file (never bench/results/prefill_ttft.json). Figures are not targets here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from prefill_cases import ROW_KEYS  # noqa: E402

CASES = [
    "short",
    "short_http",
    "prompt_1k",
    "prompt_1k_cached",
    "prompt_5k",
    "prompt_5k_cached",
    "text_c4",
    "text_c8",
    "image_256",
    "audio_3s",
    "itl_5k",
]

pytestmark = pytest.mark.timeout(2400)


def test_the_dry_run_measures_every_case_on_the_cpu_tiny_pipeline(tmp_path):
    gpu_file = ROOT / "bench" / "results" / "prefill_ttft.json"
    before = gpu_file.stat().st_mtime if gpu_file.exists() else None
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "prefill_ttft.py"),
            "--tiny",
            "--free-ports",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=2300,
        cwd=ROOT,
    )
    out = tmp_path / "prefill_ttft.dry.json"
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]} if out.exists() else {}
    errors = {c: (r["errors_by_status"], r["error_details"]) for c, r in rows.items() if r["errors"]}
    assert run.returncode == 0 and not errors, f"{errors}\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
    assert list(rows) == CASES
    for r in rows.values():
        assert set(ROW_KEYS) <= set(r) and r["errors"] == 0 and r["ttft_p50_ms"] > 0, r
        assert r["backend"] == "torch"  # a CPU: the reference kernels
    for size in ("1k", "5k"):
        new, cached = rows[f"prompt_{size}"], rows[f"prompt_{size}_cached"]
        assert cached["cached_tokens"] >= cached["prompt_tokens"] - 16  # all but the last block
        assert new["cached_tokens"] < new["prompt_tokens"] // 2  # at most the chat template's blocks
    short = rows["short"]["breakdown"]
    assert short["engine_ttft_ms"] > 0 and short["prefill_step_launch_ms"] > 0
    assert short["gateway_ttft_ms"] >= short["engine_ttft_ms"]
    assert rows["itl_5k"]["itl_p50_ms"] > 0 and rows["text_c8"]["decode_tok_s"] > 0
    assert not (tmp_path / "prefill_ttft.json").exists()
    assert (gpu_file.stat().st_mtime if gpu_file.exists() else None) == before
