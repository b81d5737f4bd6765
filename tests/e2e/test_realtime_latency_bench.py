"""bench/realtime_latency.py against the CPU tiny pipeline (a smoke run: its figures are no targets
here): with `--attach` it times the full tiny pipeline the e2e tests share (tests/e2e/full_pipeline.py,
its API key presented), speaks turns through /v1/realtime with the protocol's own events, and writes a
row per session count, every turn timed from the VAD's speech end to the first transcript and audio,
with the encoder's forwards counted and the sessions' first turns apart from their later ones (on the
client's clock and the gateway's); its sessions start staggered unless `--start lockstep`. Without `--attach` each `--variant` is its own serve with its
overrides and its rows say which (checked without starting them: the serve is the one every GPU run
starts)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.full_pipeline import KEY

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_the_tiny_run_times_every_turn(tmp_path, shared_pipeline):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "realtime_latency.py"), "--tiny", "--sessions", "1,2"]
        + ["--turns", "2", "--speech-s", "1.0", "--out", str(out), "--attach"]
        + [f"--config={shared_pipeline['config']}", f"--key={KEY}"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    doc = json.loads((out / "realtime_latency.json").read_text())
    assert {"device", "date", "command", "rows"} <= doc.keys()
    assert [(r["sessions"], r["turns"], r["errors"]) for r in doc["rows"]] == [(1, 2, 0), (2, 4, 0)]
    assert list(doc["variants"]) == ["as configured"]
    assert doc["sessions_start"].startswith("staggered") and doc["turn_period_s"] > 1.0
    for row in doc["rows"]:
        assert row["start"] == "staggered"
        assert row["first_turn_text_p50_ms"] is not None and row["later_turns_text_p50_ms"] is not None
        for which in ("server_first_turn_mean_ms", "server_later_turns_mean_ms"):  # the gateway's turn label
            assert all(row[which][phase] is not None for phase in ("media", "first_text", "first_audio"))
        audio, text = row["stopped_to_first_audio_p50_ms"], row["stopped_to_first_text_p50_ms"]
        assert audio is not None and audio > 0 and text is not None and text > 0
        assert row["stopped_to_first_audio_p95_ms"] >= audio
        assert row["first_turn_p50_ms"] is not None and row["later_turns_p50_ms"] is not None
        assert row["server_ttfa_mean_ms"] is not None  # the gateway's own view of the same turns
        assert (
            row["server_turn_media_mean_ms"] is not None and row["server_turn_first_text_mean_ms"] is not None
        )
        assert row["encode_cache"].get("ahead[started]", 0) >= 1  # turns' clips went to the encoder early
        assert row["variant"] == ""
        assert row["encoder_forwards"].get("audio", 0) >= 1  # the encoder's own count of its forwards
        assert row["stage_means"].get("encoder/encoder_forward_seconds[audio]") is not None
    assert "| variant | sessions | start | turns |" in (out / "realtime_latency.md").read_text()


TIMES = ("stopped_to_first_audio_p50_ms", "stopped_to_first_audio_p95_ms", "stopped_to_first_text_p50_ms")
TIMES += ("first_turn_p50_ms", "later_turns_p50_ms", "server_ttfa_mean_ms")


def test_each_variant_is_its_own_serve_and_its_rows_say_which(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import realtime_latency as bench

    serves: list[tuple[list[str], str]] = []

    @contextlib.contextmanager
    def pipeline(config, overrides, log):
        serves.append((list(overrides), log.name))
        yield "127.0.0.1:1"

    def time_levels(args, cfg, speech, save, started):
        for n in args.sessions:
            timed = dict.fromkeys(TIMES, 1.0)
            save({"sessions": n, "turns": n * args.turns, "errors": 0, "serve": len(serves), **timed})
        return {"ready_s": 0.0, "not_admitted": []}

    monkeypatch.setattr(bench, "pipeline", pipeline)
    monkeypatch.setattr(bench, "time_levels", time_levels)
    a, b = "services.encoder.encoder.audio_batch_frames=0", "services.talker.talker.max_lm_tokens=256"
    argv = ["--tiny", "--sessions", "1,2", "--out", str(tmp_path), "--set=log_level=debug"]
    assert bench.main(argv + ["--variant", a, "--variant", b]) == 0
    assert serves == [
        (["log_level=debug", a], "realtime_latency.serve0.log"),
        (["log_level=debug", b], "realtime_latency.serve1.log"),
    ]
    doc = json.loads((tmp_path / "realtime_latency.json").read_text())
    assert list(doc["variants"]) == [a, b]
    assert [(r["variant"], r["sessions"], r["serve"]) for r in doc["rows"]] == [
        (a, 1, 1),
        (a, 2, 1),
        (b, 1, 2),
        (b, 2, 2),
    ]
    assert doc["sessions_start"].startswith("staggered")  # the default
    with pytest.raises(SystemExit):  # a running serve is timed as it is
        bench.parse_args(["--attach", "--variant", a])
    assert bench.main(argv[:-1] + ["--start", "lockstep"]) == 0
    doc = json.loads((tmp_path / "realtime_latency.json").read_text())
    assert doc["sessions_start"].startswith("together")


def test_staggered_sessions_start_spread_over_one_turn_period_and_lockstep_ones_at_once(monkeypatch):
    """A level's sessions connect i/N of a turn period (the utterance and VAD's silence) apart, or all at
    once with `--start lockstep`; the rows say which."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import realtime_latency as bench

    started: list[float] = []

    async def session(url, key, turns, speech, timeout_s, delay_s=0.0):
        started.append(delay_s)
        return bench.Session(turns=[bench.Turn(i, 1.0, 1.1, 1.2) for i in range(turns)])

    monkeypatch.setattr(bench, "session", session)
    monkeypatch.setattr(bench, "snapshot", lambda urls: {})
    speech = b"\0\0" * bench.RATE  # 1 s: a turn period of 1.5 s with VAD's 500 ms of silence
    assert bench.turn_period_s(speech) == 1.5
    rows = {}
    for start in bench.STARTS:
        started.clear()
        rows[start] = asyncio.run(bench.level("ws://x", "k", {}, 4, 2, speech, 1.0, start))
        assert rows[start]["start"] == start and rows[start]["first_turn_p50_ms"] == 200.0
        assert rows[start]["later_turns_p50_ms"] == 200.0 and rows[start]["turns"] == 8
        assert started == ([0.0, 0.375, 0.75, 1.125] if start == "staggered" else [0.0] * 4)
    assert bench.parse_args(["--tiny"]).start == "staggered"
    with pytest.raises(SystemExit):
        bench.parse_args(["--tiny", "--start", "together"])
