"""Per-process status files: `<run_dir>/<service>.r<rank>.json`, rewritten atomically on every change.

The launcher *pulls* these (plus the process exit status), so no "ready" or "failed" message can be
lost in transit, and a TP rank without a gRPC server is still visible with its phase and progress.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StatusRecord:
    """What one process last said about itself (times are Unix seconds)."""

    service: str
    rank: int
    pid: int
    phase: str
    done: int = 0
    total: int = 0
    unit: str = ""
    detail: str = ""
    # Time of the latest progress: tells slow from hung.
    heartbeat_unix: float = 0.0
    phase_started_unix: float = 0.0
    failure: str = ""
    # Phase the process was in when it failed (phase is then "failed").
    failed_in: str = ""
    # Rank of this service whose failure this is: this process's own rank, or a TP peer that died,
    # stopped answering or failed first (this process only copied its diagnostic); -1 when unknown.
    culprit_rank: int = -1
    # gRPC address (rank 0 of a service; empty on ranks without a server).
    address: str = ""
    # Latest liveness beat, written by the process's event loop every supervision.heartbeat_interval_s
    # in every phase (a stuck loop or SIGSTOP stops it). Unlike heartbeat_unix it says nothing about
    # progress, so a start-up step hung in a worker thread is still caught by the progress clock.
    alive_unix: float = 0.0

    def progress_text(self) -> str:
        """`2/3 shards`, `5 graphs`, or '' (plus the detail when there is one)."""
        count = f"{self.done}/{self.total}" if self.total else (str(self.done) if self.done else "")
        text = " ".join(p for p in (count, self.unit if count else "") if p)
        if self.detail:
            text = f"{text} ({self.detail})" if text else self.detail
        return text


def status_path(run_dir: str | Path, service: str, rank: int) -> Path:
    return Path(run_dir) / f"{service}.r{rank}.json"


def write_status(path: Path, record: StatusRecord) -> None:
    """Write to a temp file in the same directory, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(dataclasses.asdict(record), f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_status(path: Path) -> StatusRecord | None:
    """The record at `path`, or None when there is none yet (or it is not one of ours)."""
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    names = {f.name for f in dataclasses.fields(StatusRecord)}
    if not isinstance(data, dict) or not {"service", "rank", "pid", "phase"} <= set(data):
        return None
    return StatusRecord(**{k: v for k, v in data.items() if k in names})
