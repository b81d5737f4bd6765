"""The launcher's processes: start a service's ranks (own process group, pidfd), stop them bounded."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TextIO

from omnistage.common import mps
from omnistage.common.config import ConfigError, DeployConfig, ServiceConfig
from omnistage.common.launcher.children import Child, Group, exit_cause
from omnistage.common.oom_kills import oom_kill_count
from omnistage.common.runtime import auth
from omnistage.common.runtime.orphan import LAUNCHER_PID_ENV
from omnistage.common.runtime.status_file import status_path
from omnistage.common.supervision import RestartBudget

# After SIGKILL, how long to wait for the kernel to reap a child before reporting it.
_KILL_WAIT_S = 5.0
# Ranks > 0 are stopped after rank 0: they get this long to leave on rank 0's exit plan before their
# SIGTERM, and at least this long after it (within stop_grace_s where it allows).
_FOLLOWER_GRACE_S = 1.0


class Processes:
    """The deployment's processes, grouped by service: what every part of the launcher shares."""

    def __init__(
        self,
        cfg: DeployConfig,
        cfg_path: Path,
        overrides: Sequence[str],
        run_dir: Path,
        modules: dict[str, str],
        out: TextIO,
        err: TextIO,
    ) -> None:
        self.cfg = cfg
        self.cfg_path = cfg_path
        self.overrides = list(overrides)
        self.run_dir = run_dir
        self.modules = modules
        self.out = out
        self.err = err
        self.groups: list[Group] = []
        self.stop_signal: int | None = None
        self.started = time.monotonic()
        self.stage_key = auth.new_stage_key()  # this run's, unless $OMNISTAGE_STAGE_KEY pins one
        self.mps: mps.MpsDaemon | None = None  # the CUDA MPS daemon of this run, while it runs

    @property
    def children(self) -> list[Child]:
        return [c for g in self.groups for c in g.children]

    def live_children(self) -> list[Child]:
        """Children of the groups that are starting or serving (not those stopped for a restart)."""
        return [c for g in self.groups if g.active for c in g.children]

    def say(self, line: str, stream: TextIO | None = None) -> None:
        print(line, file=stream or self.out, flush=True)

    def command(self, svc: ServiceConfig, rank: int) -> list[str]:
        target = self.modules.get(svc.kind)
        if target is None:
            raise ConfigError(f"services.{svc.name}.kind: no program for kind {svc.kind!r}")
        run = [target] if target.endswith(".py") or os.sep in target else ["-m", target]
        args = [
            "--config",
            str(self.cfg_path),
            "--service",
            svc.name,
            "--rank",
            str(rank),
            "--run-dir",
            str(self.run_dir),
        ]
        for text in self.overrides:
            args += ["--set", text]
        return [sys.executable, *run, *args]

    def spawn(self, svc: ServiceConfig, rank: int) -> Child:
        path = status_path(self.run_dir, svc.name, rank)
        path.unlink(missing_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMNISTAGE_SERVICE=svc.name)
        env[LAUNCHER_PID_ENV] = str(os.getpid())
        env[auth.STAGE_KEY_ENV] = self.stage_key  # stages take calls only from the deployment's processes
        if self.mps is not None and svc.device == "cuda":
            env |= self.mps.env(svc.mps_active_thread_percentage, svc.mps_client_priority)
        # Own process group: stopping a service reaches its helpers too, and only ours.
        oom_kills = oom_kill_count()
        proc = subprocess.Popen(self.command(svc, rank), env=env, start_new_session=True)
        child = Child(svc, rank, proc, path, time.time(), oom_kills_before=oom_kills)
        with contextlib.suppress(OSError, AttributeError):
            child.pidfd = os.pidfd_open(proc.pid)
        self.say(f"omnistage: started {child.label} (pid {proc.pid})")
        return child

    def start_groups(self, services: Sequence[ServiceConfig]) -> list[Group]:
        groups = []
        for svc in services:
            g = Group(svc, RestartBudget(self.cfg.supervision))
            g.children = [self.spawn(svc, r) for r in range(svc.tp_size)]
            groups.append(g)
        self.groups += groups
        return groups

    def stop_all(self) -> None:
        """Stop the gateways first (no new request reaches a stage), then every other service at once:
        each takes its own drain and clean-up (~0.3-1 s on the tiny CPU pipeline), one after the other
        they added up (its five services: ~3.4 s); bounded (each group by stop_grace_s)."""
        groups = list(reversed(self.groups))
        for g in groups:
            if g.svc.kind == "gateway":
                self.stop_group(g)
        rest = [g for g in groups if g.svc.kind != "gateway"]
        if len(rest) < 2:
            for g in rest:
                self.stop_group(g)
            return
        with ThreadPoolExecutor(len(rest), thread_name_prefix="omnistage-stop") as pool:
            for done in [pool.submit(self.stop_group, g) for g in rest]:
                done.result()

    def stop_group(self, g: Group, kill_first: Sequence[Child] = ()) -> None:
        """SIGTERM the ranks of one service, SIGKILL what is left after stop_grace_s; bounded.

        `kill_first`: ranks that stopped answering get SIGKILL at once (a stopped or stuck process
        cannot act on SIGTERM; waiting out the grace would only delay the restart).
        """
        group = [c for c in g.children if not c.stopped]
        grace = self.cfg.startup.stop_grace_s
        for c in kill_first:
            _signal_group(c, signal.SIGKILL)
        # TP rank 0 first: its engine sends the exit plan, so the other ranks leave on their own
        # (a rank stopped while it waits in a collective dies there, not cleanly).
        deadline = time.monotonic() + grace
        leaders, followers = [c for c in group if c.rank == 0], [c for c in group if c.rank > 0]
        for c in leaders:
            _signal_group(c, signal.SIGTERM)
        if followers:
            _wait_exit(leaders, grace)
            _wait_exit(followers, min(max(deadline - time.monotonic(), 0.0), _FOLLOWER_GRACE_S))
            for c in followers:
                _signal_group(c, signal.SIGTERM)
        _wait_exit(group, max(deadline - time.monotonic(), min(grace, _FOLLOWER_GRACE_S)))
        for c in group:
            if c.proc.poll() is None:
                self.say(f"omnistage: {c.label} (pid {c.proc.pid}) ignored SIGTERM, killing", self.err)
                _signal_group(c, signal.SIGKILL)
        _wait_exit(group, _KILL_WAIT_S)
        for c in group:
            if c.proc.returncode is None:
                self.say(f"omnistage: {c.label} (pid {c.proc.pid}) did not exit after SIGKILL", self.err)
            else:  # helpers left in the child's process group go too
                _signal_group(c, signal.SIGKILL, leader_gone=True)
                if c.proc.returncode != 0 and not c.cause and c.proc.returncode != -signal.SIGKILL:
                    self.say(
                        f"omnistage: {c.label} {exit_cause(c.proc.returncode, None, c.oom_kills_before)} while stopping",
                        self.err,
                    )
            c.stopped = True
            if c.probe is not None:
                c.probe.cancel()
                c.probe = None
            if c.pidfd is not None:
                os.close(c.pidfd)
                c.pidfd = None
            if c.channel is not None:
                c.channel.close()
                c.channel = None
        self.remove_segments_of(group)

    def remove_segments_of(self, children: Sequence[Child]) -> None:
        """Shared memory of exited children that could not close it (killed, or stopped before their
        pools closed: a TP rank 0 stuck behind a stopped peer) goes as soon as they are gone: at each
        group's stop, so also before a restart, not at the next start's sweep."""
        from omnistage.common.shm_sweep import sweep_stale_segments

        pids = {c.proc.pid for c in children if c.proc.poll() is not None}
        if not pids:
            return
        try:
            removed = sweep_stale_segments(owners=pids)
        except Exception as exc:  # noqa: BLE001 - the stop goes on; the next start's sweep retries
            self.say(f"omnistage: warning: shm clean-up failed: {exc}", self.err)
            return
        if removed:
            names = ", ".join(sorted({c.label for c in children if c.proc.pid in pids}))
            self.say(
                f"omnistage: removed {len(removed)} shared-memory segment(s) that {names} left", self.err
            )


def _signal_group(child: Child, sig: int, *, leader_gone: bool = False) -> None:
    """Signal the child's process group, only while it is ours (leader alive, or just reaped)."""
    if child.proc.returncode is not None and not leader_gone:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.proc.pid, sig)


def _wait_exit(children: list[Child], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for c in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
