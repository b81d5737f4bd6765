"""One service process (`Child`: one TP rank), its service's ranks (`Group`) and why a child ended."""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from omnistage.common.config import STARTUP_PHASES, ServiceConfig
from omnistage.common.oom_kills import oom_killed_since
from omnistage.common.runtime.status_file import StatusRecord, read_status
from omnistage.common.supervision import HealthProbe, RestartBudget


@dataclass(eq=False)
class Child:
    """One service process (one TP rank) and what the launcher knows about it."""

    svc: ServiceConfig
    rank: int
    proc: subprocess.Popen
    status_file: Path
    spawned_unix: float
    pidfd: int | None = None
    status: StatusRecord | None = None
    printed: tuple = ()
    ready: bool = False
    cause: str = ""
    channel: grpc.Channel | None = None
    # Unix time it was marked ready; the hung clock of supervision starts there at the latest.
    ready_unix: float = 0.0
    probe: HealthProbe | None = None
    # The phase watch_phases last saw after ready ('' = serving).
    announced: str = ""
    # Silent past the heartbeat timeout after ready (SIGSTOP, a stuck event loop).
    hung: bool = False
    # Stopped by the launcher already (its process group may belong to someone else by now).
    stopped: bool = False
    # phase → when this process entered it, as seen in its status file (kept after it moves on/fails).
    entered: dict[str, float] = field(default_factory=dict)
    # The OOM killer's count when it was started (None: this system tells none).
    oom_kills_before: int | None = None

    @property
    def label(self) -> str:
        return f"{self.svc.name} r{self.rank}"

    @property
    def phase(self) -> str:
        return self.status.phase if self.status else "starting"

    def refresh(self) -> StatusRecord | None:
        rec = read_status(self.status_file)
        if rec is not None and rec.pid == self.proc.pid:  # a stale file of an earlier run is not ours
            self.status = rec
            if rec.phase in STARTUP_PHASES:
                self.entered.setdefault(rec.phase, rec.phase_started_unix)
        return self.status

    def summary(self, now: float) -> str:
        """`thinker r1 loading_weights 1/3 shards (12.0s ago)` — phase, progress, age of the heartbeat."""
        rec = self.status
        phase = (rec.failed_in or "failed") if rec and rec.phase == "failed" else self.phase
        progress = rec.progress_text() if rec else ""
        beat = rec.heartbeat_unix if rec else self.spawned_unix
        return " ".join(p for p in (self.label, phase, progress, f"({now - beat:.1f}s ago)") if p)


def exit_cause(returncode: int, rec: StatusRecord | None, oom_kills_before: int | None = None) -> str:
    """Why a child ended: its exit code or signal, plus the failure it wrote, if any. Exit code 1
    after phase `failed` is the service's own failure exit: just `failed: <why>`. A SIGKILL is called
    out of memory only when the OOM killer's count rose since `oom_kills_before` (its spawn)."""
    if returncode == 1 and rec is not None and rec.phase == "failed" and rec.failure:
        return f"failed: {rec.failure}"
    if returncode < 0:
        name = signal.Signals(-returncode).name
        oom = name == "SIGKILL" and oom_killed_since(oom_kills_before)
        cause = f"killed by {name}" + (
            " (out of memory: the kernel's OOM killer ended it; see dmesg)" if oom else ""
        )
    else:
        cause = f"exited with code {returncode}"
    if rec is not None and rec.failure:
        cause += f": {rec.failure}"
    return cause


@dataclass(eq=False)
class Group:
    """The processes of one service (all its TP ranks): started, stopped and restarted together."""

    svc: ServiceConfig
    budget: RestartBudget
    children: list[Child] = field(default_factory=list)
    # starting (first start or a restart) → serving; a failure after ready → backoff → starting.
    state: str = "starting"
    restart_at: float = 0.0
    # Number of the restart now under way (0: the first start).
    attempt: int = 0
    # A restart: when every rank was ready again (the gateway's admission is awaited from then on).
    admit_since: float = 0.0

    @property
    def active(self) -> bool:
        return self.state in ("starting", "serving")
