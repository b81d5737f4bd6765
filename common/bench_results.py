"""Result files of the benchmarks (bench/results/*.json by default): a GPU run's record is never
written over by a CPU or dry run.

Issue 43: a CPU run of deploy/local-tiny.yaml replaced the 4 x H100 record of
bench/pipeline_real_size.py, and was committed with an unrelated change. Every bench script writes
its JSON through `write_result`, saying whether its run is a GPU run; one that is not (CPU, a tiny
or simulated shape, a dry run) is refused where the file holds a GPU run. `check_result` says so
before a run starts, so an hour of load is not measured for nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# What marks a stored result as a GPU run: its `gpu` key (written here), else (files older than
# this module) a device naming a GPU.
_GPU_WORDS = ("nvidia", "cuda", "h100", "h200", "a100", "l40", "gpu")


class ResultRefused(RuntimeError):
    """The file holds a GPU run and this run is not one."""


def is_gpu_run(data: Any) -> bool:
    """Whether a stored result is a GPU run's."""
    if not isinstance(data, dict):
        return False
    if "gpu" in data:
        return bool(data["gpu"])
    device = str(data.get("device", "")).lower()
    return not device.startswith("cpu") and any(word in device for word in _GPU_WORDS)


def refusal(path: str | Path, *, gpu: bool) -> str:
    """'' when a run (`gpu`: on a GPU, in earnest) may write `path`; else why not."""
    if gpu:
        return ""
    try:
        stored = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return ""
    if not is_gpu_run(stored):
        return ""
    when = f", {stored['date']}" if isinstance(stored.get("date"), str) else ""
    return (
        f"{path} holds a GPU run ({stored.get('device', 'a GPU')}{when}); a CPU, tiny or dry run does not "
        "replace it: write elsewhere (--out / $OUT)"
    )


def check_result(path: str | Path, *, gpu: bool) -> None:
    """Raise ResultRefused now (before the run) when its result could not be written at `path`."""
    why = refusal(path, gpu=gpu)
    if why:
        raise ResultRefused(why)


def write_result(path: str | Path, data: dict[str, Any], *, gpu: bool, indent: int = 1) -> Path:
    """Write `data` (with `"gpu": gpu`) as JSON at `path`; ResultRefused over a GPU run's file when
    this run is not one."""
    check_result(path, gpu=gpu)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**data, "gpu": gpu}, indent=indent, default=str) + "\n")
    return path
