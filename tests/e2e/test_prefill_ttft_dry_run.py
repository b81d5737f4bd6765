"""bench/prefill_ttft.py's CPU dry run (tiny sizes) against the full tiny pipeline the e2e tests share
(`--attach`: tests/e2e/full_pipeline.py, its API key presented over gRPC and HTTP): every case gives a
row with the issue's keys and no error, the cached cases take their prefix from the cache and the new
ones do not, each row carries its breakdown and the backend the serve's output names, and the dry run
writes only its own file (never bench/results/prefill_ttft.json). Figures are not targets here. (The
serve the bench starts itself, without --attach, is the path of every GPU run.)"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from prefill_cases import ROW_KEYS  # noqa: E402

from tests.e2e.full_pipeline import KEY  # noqa: E402

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


def test_the_dry_run_measures_every_case_on_the_cpu_tiny_pipeline(tmp_path, shared_pipeline):
    gpu_file = ROOT / "bench" / "results" / "prefill_ttft.json"
    before = gpu_file.stat().st_mtime if gpu_file.exists() else None
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "prefill_ttft.py"),
            "--tiny",
            "--attach",
            f"--config={shared_pipeline['config']}",
            f"--key={KEY}",
            f"--serve-log={shared_pipeline['serve'].out}",
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
    # The gaps were measured (on a loaded CPU a stream's deltas can arrive back to back: a p50 of 0).
    itl = rows["itl_5k"]
    assert itl["itl_max_ms"] > 0 and itl["itl_p50_ms"] >= 0 and rows["text_c8"]["decode_tok_s"] > 0
    assert not (tmp_path / "prefill_ttft.json").exists()
    assert (gpu_file.stat().st_mtime if gpu_file.exists() else None) == before


def test_without_attach_each_backend_is_its_own_serve_of_dummy_weights_on_free_ports(tmp_path, monkeypatch):
    """The bench's own serve (every GPU run's): one per backend, the config-only checkpoint with dummy
    weights, every port of the deploy file moved to a free one, the backend asked of the thinker; the
    cases timed against it with its output (checked without starting it: the cases are checked above)."""
    import prefill_ttft as bench
    from omnistage.common.config import load_config

    serves, timed = [], []

    @contextlib.contextmanager
    def pipeline(config, overrides, log):
        serves.append((config, list(overrides), log.name))
        yield "127.0.0.1:1"

    monkeypatch.setattr(bench, "pipeline", pipeline)
    monkeypatch.setattr(bench, "time_cases", lambda args, cfg, address, serve, *_: timed.append(serve[:2]))
    argv = ["--tiny", "--free-ports", "--backends", "torch,triton", "--out", str(tmp_path)]
    assert bench.main(argv + ["--checkpoint", str(tmp_path / "ckpt")]) == 0
    tiny = str(ROOT / "deploy" / "local-tiny.yaml")
    assert [(config, log) for config, _, log in serves] == [
        (tiny, "prefill_ttft.serve0.log"),
        (tiny, "prefill_ttft.serve1.log"),
    ]
    assert [(asked, log.name) for asked, log in timed] == [
        ("torch", "prefill_ttft.serve0.log"),
        ("triton", "prefill_ttft.serve1.log"),
    ]
    plain = load_config(tiny, [])
    for (_, overrides, _), backend in zip(serves, ("torch", "triton"), strict=True):
        assert f"model.checkpoint={tmp_path / 'ckpt'}" in overrides and "model.load_format=dummy" in overrides
        assert (tmp_path / "ckpt" / "config.json").is_file()
        cfg = load_config(tiny, overrides)
        assert cfg.services["thinker"].engine.attention_backend == backend
        for name, svc in cfg.services.items():
            assert (
                svc.port != plain.services[name].port
                and svc.metrics_port != plain.services[name].metrics_port
            )
    with pytest.raises(SystemExit):  # a running serve is timed as it is
        bench.parse_args(["--attach", "--backends", "triton"])
