"""Status files are written atomically and read defensively."""

from __future__ import annotations

import json

from omnistage.common.runtime.status_file import StatusRecord, read_status, status_path, write_status


def test_round_trip_and_path(tmp_path):
    path = status_path(tmp_path / "run", "thinker", 2)
    assert path.name == "thinker.r2.json"
    rec = StatusRecord(
        service="thinker", rank=2, pid=123, phase="warming_up", done=1, total=4, unit="batches"
    )
    write_status(path, rec)
    assert read_status(path) == rec
    assert [p.name for p in path.parent.iterdir()] == ["thinker.r2.json"]  # no temp file left behind


def test_missing_partial_or_foreign_files_read_as_none(tmp_path):
    path = tmp_path / "x.r0.json"
    assert read_status(path) is None
    path.write_text('{"service": "x", "rank": 0, "pi')
    assert read_status(path) is None
    path.write_text(json.dumps({"hello": 1}))
    assert read_status(path) is None


def test_unknown_fields_are_ignored(tmp_path):
    path = tmp_path / "x.r0.json"
    path.write_text(json.dumps({"service": "x", "rank": 0, "pid": 1, "phase": "serving", "future_field": 3}))
    assert read_status(path).phase == "serving"


def test_progress_text():
    base = dict(service="s", rank=0, pid=1, phase="loading_weights")
    assert StatusRecord(**base, done=2, total=3, unit="shards").progress_text() == "2/3 shards"
    assert StatusRecord(**base, done=5, unit="graphs").progress_text() == "5 graphs"
    assert StatusRecord(**base).progress_text() == ""
    assert StatusRecord(**base, detail="compiling").progress_text() == "compiling"
