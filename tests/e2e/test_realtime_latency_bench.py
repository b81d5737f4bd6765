"""bench/realtime_latency.py against the CPU tiny pipeline (a smoke run: its figures are no targets
here): it serves (a variant's overrides), speaks turns through /v1/realtime with the protocol's own
events, and writes a row per session count, every turn timed from the VAD's speech end to the first
transcript and audio, with the encoder's forwards counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omnistage.common.config import load_config

from load_tests.chaos_launch import free_ports

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def port_overrides(config: Path) -> list[str]:
    """Every port of the deploy file moved to a free one (tests may run beside a serve)."""
    cfg = load_config(config, [])
    out = []
    for svc in cfg.services.values():
        keys = ["port", "admin_port", "metrics_port"] + (["dist_port"] if svc.kind == "thinker" else [])
        for key, port in zip(keys, free_ports(len(keys)), strict=True):
            out.append(f"services.{svc.name}.{key}={port}")
        if svc.kind == "gateway":
            out.append(f"services.{svc.name}.gateway.http_port={free_ports(1)[0]}")
    return out


def test_the_tiny_run_times_every_turn(tmp_path):
    from omnistage.common.checkpoint.tiny import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", seed=0)
    config = ROOT / "deploy" / "local-tiny.yaml"
    sets = [f"--set=model.checkpoint={ckpt}", *(f"--set={o}" for o in port_overrides(config))]
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "realtime_latency.py"), "--tiny", "--sessions", "1,2"]
        + ["--turns", "2", "--speech-s", "1.0", "--out", str(out), *sets]
        + ["--variant", "services.encoder.encoder.audio_batch_frames=0"],  # one serve: as configured
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    doc = json.loads((out / "realtime_latency.json").read_text())
    assert {"device", "date", "command", "rows"} <= doc.keys()
    assert [(r["sessions"], r["turns"], r["errors"]) for r in doc["rows"]] == [(1, 2, 0), (2, 4, 0)]
    assert list(doc["variants"]) == ["services.encoder.encoder.audio_batch_frames=0"]
    assert doc["sessions_start"].startswith("together")
    for row in doc["rows"]:
        audio, text = row["stopped_to_first_audio_p50_ms"], row["stopped_to_first_text_p50_ms"]
        assert audio is not None and audio > 0 and text is not None and text > 0
        assert row["stopped_to_first_audio_p95_ms"] >= audio
        assert row["first_turn_p50_ms"] is not None and row["later_turns_p50_ms"] is not None
        assert row["server_ttfa_mean_ms"] is not None  # the gateway's own view of the same turns
        assert (
            row["server_turn_media_mean_ms"] is not None and row["server_turn_first_text_mean_ms"] is not None
        )
        assert row["encode_cache"].get("ahead[started]", 0) >= 1  # turns' clips went to the encoder early
        assert row["variant"] == "services.encoder.encoder.audio_batch_frames=0"
        assert row["encoder_forwards"].get("audio", 0) >= 1  # the encoder's own count of its forwards
        assert row["stage_means"].get("encoder/encoder_forward_seconds[audio]") is not None
    assert "| variant | sessions | turns |" in (out / "realtime_latency.md").read_text()
