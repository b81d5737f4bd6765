"""The life-cycle phase of a service process and its progress: one source for Describe, health,
metrics and the status file the launcher reads.

It also applies the test-only fault hook (`ServiceConfig.fault`) when the faulty phase is entered,
so chaos tests exercise the same code paths a real hang, crash or OOM would.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omnistage.common.config import STARTUP_PHASES, FaultConfig
from omnistage.common.log import log_fields
from omnistage.common.runtime.errors import SimulatedOOM
from omnistage.common.runtime.status_file import StatusRecord, write_status
from omnistage.v1 import control_pb2

_log = logging.getLogger(__name__)

PHASES: tuple[str, ...] = (*STARTUP_PHASES, "serving", "draining", "stopped", "failed")
TERMINAL_PHASES = ("stopped", "failed")


def phase_to_proto(phase: str) -> int:
    """`loading_weights` → control_pb2.PHASE_LOADING_WEIGHTS."""
    return control_pb2.Phase.Value(f"PHASE_{phase.upper()}")


@dataclass(frozen=True)
class ProgressSnapshot:
    """Phase and progress at one moment (Unix seconds)."""

    phase: str
    done: int
    total: int
    unit: str
    detail: str
    updated_unix: float
    phase_started_unix: float
    failure: str = ""
    # The phase a failed process was in when it failed.
    failed_in: str = ""
    # The rank whose failure this is (see StatusRecord.culprit_rank).
    culprit_rank: int = -1

    @property
    def elapsed_s(self) -> float:
        return max(0.0, time.time() - self.phase_started_unix)


Listener = Callable[[ProgressSnapshot], None]


class PhaseReporter:
    """Thread-safe phase + progress of one process (weight loading may report from worker threads)."""

    def __init__(
        self,
        service: str,
        rank: int = 0,
        *,
        fault: FaultConfig | None = None,
        status_file: Path | None = None,
        address: str = "",
    ) -> None:
        self.service = service
        self.rank = rank
        self.fault = fault
        self.status_file = status_file
        self.address = address
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._alive_unix = 0.0
        now = time.time()
        self._snap = ProgressSnapshot("starting", 0, 0, "", "", now, now)
        self._write()

    @property
    def phase(self) -> str:
        return self._snap.phase

    def snapshot(self) -> ProgressSnapshot:
        return self._snap

    def set_address(self, address: str) -> None:
        """Record the bound gRPC address in the status file (known only once the port is bound)."""
        self.address = address
        self._write()

    def add_listener(self, fn: Listener) -> None:
        """Call `fn(snapshot)` after every change (from the thread that made it)."""
        self._listeners.append(fn)
        _notify(fn, self._snap)

    def enter(self, phase: str, *, total: int = 0, unit: str = "", detail: str = "") -> None:
        """Start `phase` with fresh progress; applies the fault hook when this phase is the faulty one."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r} (known: {', '.join(PHASES)})")
        now = time.time()
        with self._lock:
            cur = self._snap.phase
            if cur == "failed" or (cur == "stopped" and phase != "failed"):
                return
            self._snap = ProgressSnapshot(phase, 0, total, unit, detail, now, now, self._snap.failure)
        log_fields(_log, logging.INFO, f"phase {phase}", **({"detail": detail} if detail else {}))
        self._changed()
        self._apply_fault(phase)

    def progress(
        self,
        done: int | None = None,
        *,
        total: int | None = None,
        detail: str | None = None,
        advance: int = 0,
    ) -> None:
        """Update progress inside the current phase (also a heartbeat)."""
        with self._lock:
            s = self._snap
            new_done = (s.done if done is None else done) + advance
            self._snap = dataclasses.replace(
                s,
                done=new_done,
                total=s.total if total is None else total,
                detail=s.detail if detail is None else detail,
                updated_unix=time.time(),
            )
        self._changed()

    def advance(self, n: int = 1, detail: str | None = None) -> None:
        self.progress(advance=n, detail=detail)

    def heartbeat(self, detail: str | None = None) -> None:
        """Alive and working, no countable progress (a long compile): resets the stuck timer."""
        self.progress(detail=detail)

    def beat(self) -> None:
        """Liveness only (the status file's `alive_unix`): leaves progress and the stuck timer alone."""
        self._alive_unix = time.time()
        self._write()

    def fail(self, message: str, culprit_rank: int | None = None) -> None:
        """Enter the terminal `failed` phase with a one-line cause; `culprit_rank` names the rank
        whose failure it is when that is another rank of the service (default: this one)."""
        now = time.time()
        culprit = self.rank if culprit_rank is None else culprit_rank
        with self._lock:
            if self._snap.phase == "failed":
                return
            s = self._snap
            self._snap = ProgressSnapshot(
                "failed", s.done, s.total, s.unit, s.detail, now, now, message, s.phase, culprit
            )
        log_fields(_log, logging.ERROR, "phase failed", cause=message)
        self._changed()

    def to_proto(self) -> control_pb2.PhaseProgress:
        s = self._snap
        return control_pb2.PhaseProgress(
            phase=phase_to_proto(s.phase),
            done=s.done,
            total=s.total,
            unit=s.unit,
            detail=s.detail,
            updated_unix_ms=int(s.updated_unix * 1000),
            elapsed_s=s.elapsed_s,
        )

    def _changed(self) -> None:
        self._write()
        snap = self._snap
        for fn in list(self._listeners):
            _notify(fn, snap)

    def _write(self) -> None:
        if self.status_file is None:
            return
        with self._lock:  # build and write under one lock: a stale snapshot never overwrites a newer one
            progress = dataclasses.asdict(self._snap)  # the record's fields of the same names
            progress["heartbeat_unix"] = progress.pop("updated_unix")
            record = StatusRecord(
                service=self.service,
                rank=self.rank,
                pid=os.getpid(),
                address=self.address,
                alive_unix=self._alive_unix,
                **progress,
            )
            write_status(self.status_file, record)

    def _apply_fault(self, phase: str) -> None:
        f = self.fault
        if f is None or f.at or f.phase != phase or f.rank not in (-1, self.rank):
            return  # a fault at a point inside the phase (`at`) is the service's own to fire
        log_fields(_log, logging.WARNING, "fault hook", action=f.action, phase=phase)
        if f.action == "crash":
            os._exit(3)
        if f.action == "oom":
            raise SimulatedOOM(f"simulated out of memory in phase {phase} (fault hook)")
        if f.action == "delay":
            time.sleep(f.delay_s)
            return
        while True:  # hang: no progress, ever; only a signal (or SIGKILL) ends this process
            time.sleep(3600)


def _notify(fn: Listener, snap: ProgressSnapshot) -> None:
    """A broken listener (metrics, health) must not stop the phase change itself."""
    try:
        fn(snap)
    except Exception:
        _log.exception("phase listener failed")
