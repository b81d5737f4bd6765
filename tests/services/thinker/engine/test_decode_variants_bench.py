"""bench/decode_variants.py: the table of a variants call reads each run's sweep rows, takes the median and
best a concurrency over the rounds, and tells which variants' greedy tokens differ from the first's."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[4] / "bench" / "decode_variants.py"


def _module():
    spec = importlib.util.spec_from_file_location("decode_variants", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(folder: Path, name: str, rnd: int, rows: list[tuple[int, float]], tokens: list[int]) -> None:
    sweep = [
        {"concurrency": c, "out_tok_s": v, "decode_tok_s": v + 50, "first_tokens": tokens} for c, v in rows
    ]
    (folder / f"{name}_r{rnd}.json").write_text(json.dumps({"ranks": [{"rank": 0, "sweep": sweep}]}))


def test_medians_over_rounds_floor_share_and_token_check(tmp_path):
    folder = tmp_path / "variants"
    folder.mkdir()
    _write(folder, "all", 1, [(1, 900.0), (1, 910.0), (2, 1300.0)], [5, 6, 7])
    _write(folder, "all", 2, [(1, 920.0), (1, 930.0), (2, 1310.0)], [5, 6, 7])
    _write(folder, "tiles2_4", 1, [(1, 950.0)], [5, 6, 8])
    (folder / "notes.txt").write_text("not a run")
    dv = _module()
    assert dv.main([str(tmp_path), "--order", "tiles2_4 all"]) == 0  # the first named is the reference
    report = json.loads((tmp_path / "decode_variants.json").read_text())
    table = report["variants"]
    assert report["gpu"] is False  # the runs' JSON says none was a GPU run
    assert [row["variant"] for row in table] == ["tiles2_4", "all"]
    first, second = table
    assert first["tokens_as_first"] and not second["tokens_as_first"]
    out, decode = second["tok_s"]["1"]["out"], second["tok_s"]["1"]["decode"]
    assert out["runs"] == [900.0, 910.0, 920.0, 930.0] and out["median"] == 915.0 and out["best"] == 930.0
    assert out["floor_pct"] == round(100 * 915.0 / dv.LING_MINI_FLOOR[1], 1)
    assert decode["median"] == 965.0 and decode["floor_pct"] == round(100 * 965.0 / dv.LING_MINI_FLOOR[1], 1)
    assert "floor_pct" not in second["tok_s"]["2"]["out"] and second["rounds"] == 2


def test_no_runs_is_a_failure_not_an_empty_table(tmp_path):
    (tmp_path / "variants").mkdir()
    assert _module().main([str(tmp_path)]) == 1
    assert not (tmp_path / "decode_variants.json").exists()
