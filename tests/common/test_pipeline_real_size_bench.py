"""bench/pipeline_real_size.py: the plan is issue 22's, each results row has its keys and numbers from the
run's records (rates over the wall time, latencies and RTF over the OK requests), the table has the
seeds' columns, and the shell wrapper picks the deploy file by the GPUs present."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from omnistage.common.load_stats import Record, summarize

ROOT = Path(__file__).resolve().parents[2]
KEYS = {
    "kind",
    "concurrency",
    "req_s",
    "tok_s",
    "e2e_p50_ms",
    "e2e_p95_ms",
    "ttft_p50_ms",
    "ttfa_p50_ms",
    "rtf_mean",
    "errors",
}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "pipeline_real_size", ROOT / "bench" / "pipeline_real_size.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_real_plan_is_the_issues(bench):
    plan = {p.kind: p for p in bench.real_plan(120.0)}
    assert list(plan) == ["text", "vision", "speech", "image", "mixed"]
    assert plan["text"].levels == (1, 2, 4, 8, 16, 32, 64) and plan["text"].shape.max_tokens == 150
    image = plan["image"].shape
    assert (image.image_size, image.image_steps) == (1024, 30) and plan["mixed"].shape.image_size == 1024
    assert all(p.requests(c) >= c for p in plan.values() for c in p.levels)


def test_a_row_has_the_issues_keys_from_the_records(bench):
    part = bench.real_plan(60.0)[2]  # speech
    recs = [
        Record(
            "speech",
            0.0,
            2.0,
            60.0,
            completion_tokens=10,
            first_text_s=0.5,
            first_audio_s=1.0,
            audio_seconds=4.0,
        ),
        Record(
            "speech",
            0.0,
            3.0,
            60.0,
            completion_tokens=10,
            first_text_s=0.7,
            first_audio_s=1.5,
            audio_seconds=2.0,
        ),
        Record("speech", 0.0, 1.0, 60.0, code="UNAVAILABLE", detail="stage talker is down"),
    ]
    row = bench.row(part, 2, summarize("closed", "speech", "2", recs, 4.0), recs)
    assert KEYS <= set(row)
    assert (row["kind"], row["concurrency"], row["errors"], row["errors_by_status"]) == (
        "speech",
        2,
        1,
        {"UNAVAILABLE": 1},
    )
    assert (row["req_s"], row["tok_s"]) == (0.5, 5.0)  # 2 OK over 4 s; 20 tokens over 4 s
    assert row["rtf_mean"] == pytest.approx((2.0 / 4.0 + 3.0 / 2.0) / 2)
    assert row["ttfa_p50_ms"] == pytest.approx(1250.0) and row["e2e_p50_ms"] == pytest.approx(2500.0)
    table = bench.table([row]).splitlines()
    assert table[-1] == "- speech c=2 UNAVAILABLE: stage talker is down"  # the first error's words, below
    line = table[-4]
    assert line.startswith("| speech | 2 | 3 (1 errors) | 4.0 s | 2500 ms |") and line.endswith("| 1.00 |")


@pytest.mark.parametrize("name", ["pipeline_real_size", "pipeline_latency", "realtime_latency"])
def test_the_wrapper_runs_the_cpu_tiny_plan_without_gpus(tmp_path, name):
    """Without nvidia-smi the wrapper picks deploy/local-tiny.yaml and --tiny (checked by its dry parse)."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    wrapper = ROOT / "bench" / f"{name}.sh"
    out = subprocess.run(
        ["bash", str(wrapper), "--kinds", "text"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PY": str(fake)},
    )
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith(f"bench/{name}.py --config deploy/local-tiny.yaml") and "--tiny" in last
    assert "--kinds text" in last and wrapper.stat().st_mode & 0o111
