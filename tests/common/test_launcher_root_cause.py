"""Which rank the launcher blames when several ranks of a TP group report a failure.

A peer copies the failing rank's diagnostic into its own status, naming that rank (`culprit_rank`);
on a loaded machine its copy can be written before the failing rank's own status (CI saw rank 1
blamed for rank 0's warm-up OOM that way).
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest
from omnistage.common.config import ServiceConfig, SupervisionConfig
from omnistage.common.launcher import Child, Group, Launcher
from omnistage.common.runtime.status_file import StatusRecord, status_path, write_status
from omnistage.common.supervision import RestartBudget


class _ExitedProc:
    """A child process that has exited (only what the launcher reads)."""

    def __init__(self, pid: int, returncode: int = 1) -> None:
        self.pid, self.returncode = pid, returncode

    def poll(self) -> int:
        return self.returncode


def _child(
    run_dir: Path, svc: ServiceConfig, rank: int, failed_at: float, culprit: int, failure: str
) -> Child:
    path = status_path(run_dir, svc.name, rank)
    pid = 1000 + rank
    write_status(
        path,
        StatusRecord(
            svc.name,
            rank,
            pid,
            "failed",
            phase_started_unix=failed_at,
            heartbeat_unix=failed_at,
            failure=failure,
            failed_in="warming_up",
            culprit_rank=culprit,
        ),
    )
    return Child(svc, rank, _ExitedProc(pid), path, failed_at - 10)  # type: ignore[arg-type]


def _launcher(children: list[Child]) -> Launcher:
    launcher = Launcher.__new__(Launcher)
    group = Group(children[0].svc, RestartBudget(SupervisionConfig()), children)
    launcher.groups, launcher.out, launcher.err = [group], io.StringIO(), io.StringIO()
    return launcher


@pytest.mark.parametrize("noticed_first", [0, 1])
def test_a_peer_that_wrote_its_copy_first_is_not_blamed(tmp_path, noticed_first):
    svc = ServiceConfig(name="thinker", kind="thinker", tp_size=2)
    now = time.time()
    own = "rank 0 failed in warm-up: SimulatedOOM: out of memory"
    r0 = _child(tmp_path, svc, 0, now, culprit=0, failure=own)
    r1 = _child(tmp_path, svc, 1, now - 0.05, culprit=0, failure=own)  # the copy, written 50 ms earlier
    launcher = _launcher([r0, r1])
    blamed = launcher._root_cause([r0, r1][noticed_first])
    assert blamed is r0


def test_of_two_ranks_that_blame_themselves_the_earlier_is_the_root_cause(tmp_path):
    svc = ServiceConfig(name="thinker", kind="thinker", tp_size=2)
    now = time.time()
    r0 = _child(tmp_path, svc, 0, now, culprit=0, failure="rank 0 failed: late")
    r1 = _child(tmp_path, svc, 1, now - 1.0, culprit=1, failure="rank 1 failed: first")
    blamed = _launcher([r0, r1])._root_cause(r0)
    assert blamed is r1 and "rank 1 failed: first" in blamed.cause


class _LiveProc(_ExitedProc):
    """A child process still running (leaving after its failure)."""

    def poll(self) -> None:
        return None


def test_a_culprit_still_leaving_after_its_failure_is_named_as_failed(tmp_path):
    """Rank 0 left first (a peer's failure ends it at once); rank 1, at fault, is still exiting: the
    headline is its failure, `failed: ...`, as when it has exited."""
    svc = ServiceConfig(name="thinker", kind="thinker", tp_size=2)
    now = time.time()
    own = "rank 1 failed in warming_up: SimulatedOOM: out of memory"
    r0 = _child(tmp_path, svc, 0, now, culprit=1, failure=own)
    r1 = _child(tmp_path, svc, 1, now - 0.05, culprit=1, failure=own)
    r1.proc = _LiveProc(r1.proc.pid)  # type: ignore[assignment]
    blamed = _launcher([r0, r1])._root_cause(r0)
    assert blamed is r1 and blamed.cause == f"failed: {own}"


class _ReapedLater(_ExitedProc):
    """A SIGKILLed child the kernel has not reaped at the first look."""

    def __init__(self, pid: int) -> None:
        super().__init__(pid, returncode=-9)
        self.looks = 0

    def poll(self) -> int | None:
        self.looks += 1
        return None if self.looks < 3 else self.returncode


def test_a_culprit_its_peers_saw_gone_is_named_by_its_own_exit_once_reaped(tmp_path):
    """The peers report `rank 3 died` before the launcher has reaped the killed rank: its cause is its
    own exit (killed by SIGKILL), not the peers' copy."""
    svc = ServiceConfig(name="thinker", kind="thinker", tp_size=2)
    now = time.time()
    r0 = _child(tmp_path, svc, 0, now, culprit=1, failure="rank 1 died while serving (step 3): process gone")
    r1 = _child(tmp_path, svc, 1, now - 5, culprit=1, failure="")
    write_status(
        r1.status_file, StatusRecord(svc.name, 1, r1.proc.pid, "serving", phase_started_unix=now - 5)
    )
    r1.proc = _ReapedLater(r1.proc.pid)  # type: ignore[assignment]
    blamed = _launcher([r0, r1])._root_cause(r0)
    assert blamed is r1 and blamed.cause == "killed by SIGKILL"
