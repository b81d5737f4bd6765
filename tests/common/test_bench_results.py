"""Benchmark result files (common/bench_results.py): a GPU run's record is never written over by a
CPU, tiny or dry run (issue 43.12: a CPU run of local-tiny replaced the 4 x H100 record), every bench
script writes its JSON through the one helper, and the committed records are GPU runs."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from omnistage.common.bench_results import ResultRefused, is_gpu_run, refusal, write_result

ROOT = Path(__file__).resolve().parents[2]
GPU = {"device": "4 x NVIDIA H100 80GB HBM3", "date": "2026-11-26T11:25:42+00:00", "rows": [1]}
CPU = {"device": "cpu (x86_64, 2 cores)", "rows": [2]}


def test_a_cpu_or_dry_run_never_replaces_a_gpu_run_and_a_gpu_run_may(tmp_path):
    path = write_result(tmp_path / "r.json", GPU, gpu=True)
    with pytest.raises(ResultRefused) as refused:
        write_result(path, CPU, gpu=False)
    assert str(refused.value).startswith(f"{path} holds a GPU run (4 x NVIDIA H100 80GB HBM3, 2026-11-26")
    assert json.loads(path.read_text())["rows"] == [1], "left as it was"
    write_result(path, {**GPU, "rows": [3]}, gpu=True)  # a newer GPU run replaces it
    assert json.loads(path.read_text()) == {**GPU, "rows": [3], "gpu": True}
    cpu = write_result(tmp_path / "cpu.json", CPU, gpu=False)
    write_result(cpu, {**CPU, "rows": [4]}, gpu=False)  # a CPU record, rewritten by a CPU run
    assert refusal(tmp_path / "none.json", gpu=False) == ""


def test_records_older_than_the_helper_are_told_by_their_device():
    assert is_gpu_run({"device": "NVIDIA H100 80GB HBM3"})
    assert is_gpu_run({"device": "4 x NVIDIA H200"})
    assert not is_gpu_run({"device": "cpu (x86_64, 2 cores)"})
    assert not is_gpu_run({"device": "cpu (simulated)"})
    assert not is_gpu_run({"device": "x86_64"}) and not is_gpu_run([{"batch": 1}])
    assert not is_gpu_run({"device": "NVIDIA H100", "gpu": False}), "a tiny run on a GPU says so"


def test_the_real_size_bench_stops_before_its_load_when_it_may_not_write(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "pipeline_real_size", ROOT / "bench" / "pipeline_real_size.py"
    )
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    (tmp_path / "pipeline_real_size.json").write_text(json.dumps(GPU))
    with pytest.raises(ResultRefused):
        bench.Results(tmp_path, CPU, gpu=False).save()
    assert not (tmp_path / "pipeline_real_size.md").exists()
    assert json.loads((tmp_path / "pipeline_real_size.json").read_text()) == GPU


def test_every_bench_script_writes_its_json_through_the_helper():
    """Only the per-rank hand-off files of two GPU scripts (never results) are written directly."""
    hand_offs = {"ling_mini_gpu.py": 1, "tp_verify_gpu.py": 1}
    direct = {
        path.name: n
        for path in sorted((ROOT / "bench").glob("*.py"))
        if (n := len(re.findall(r"\.write_text\(json\.dumps\(", path.read_text())))
    }
    assert direct == hand_offs


def test_the_committed_results_are_gpu_runs():
    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        assert is_gpu_run(json.loads(path.read_text())), path.name
