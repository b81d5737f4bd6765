"""`omnistage serve`: start every service of a deploy file as child processes and watch them.

Readiness is pulled, never pushed: the launcher reads each process's status file (phase, progress,
heartbeat), watches its exit at once through a pidfd, and confirms SERVING with the service's own
health Check. Every phase has a deadline, so a start-up ends either ready or with one line per
stage/rank naming the phase and the cause; children die with the launcher (see stage_main).
After ready it supervises: a service that dies, fails or falls silent (liveness beat, health) is
restarted as a whole TP group with backoff (the rules: `supervision.py`) until its budget is spent.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnistage.common import mps, run_record
from omnistage.common.config import (
    CAPABILITY_HEALTH_PREFIX,
    STARTUP_PHASES,
    ConfigError,
    DeployConfig,
    ServiceConfig,
    StartupConfig,
    load_config,
)
from omnistage.common.oom_kills import oom_kill_count, oom_killed_since
from omnistage.common.preflight import preflight
from omnistage.common.runtime import auth
from omnistage.common.runtime.orphan import LAUNCHER_PID_ENV
from omnistage.common.runtime.status_file import StatusRecord, read_status, status_path
from omnistage.common.stages import CAPABILITIES, MODULES
from omnistage.common.supervision import HealthProbe, RestartBudget, hung_cause

if TYPE_CHECKING:
    from omnistage.common.memory.ledger import LedgerReport

# A restarted stage is announced "serving again" once the gateway admits it, or after this long.
_ADMIT_WAIT_S = 60.0
# After SIGKILL, how long to wait for the kernel to reap a child before reporting it.
_KILL_WAIT_S = 5.0
# The stale-shm sweep runs beside the start; the launcher waits at most this long for it at exit.
_SWEEP_WAIT_S = 30.0
# Ranks > 0 are stopped after rank 0: they get this long to leave on rank 0's exit plan before their
# SIGTERM, and at least this long after it (within stop_grace_s where it allows).
_FOLLOWER_GRACE_S = 1.0


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


def stuck_cause(startup: StartupConfig, phase: str, in_phase_s: float, silent_s: float) -> str:
    """'' while a start-up phase is within its deadline and heartbeat timeout; else why not."""
    deadline = startup.phase_deadlines_s.get(phase, StartupConfig().phase_deadlines_s.get(phase, 60.0))
    reasons = []
    if silent_s > startup.heartbeat_timeout_s:
        reasons.append(
            f"no progress for {silent_s:.0f}s (heartbeat timeout {startup.heartbeat_timeout_s:g}s)"
        )
    if in_phase_s > deadline:
        reasons.append(f"phase deadline {deadline:g}s exceeded")
    return "stuck: " + ", ".join(reasons) if reasons else ""


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


class Launcher:
    """Starts the services of one deploy file side by side (the gateway too) and supervises them:
    a service that dies or hangs after ready is restarted with backoff until its budget is spent."""

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

    # -- spawning ----------------------------------------------------------------------------

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

    # -- waiting -----------------------------------------------------------------------------

    def pause(self, timeout_s: float) -> None:
        """Sleep up to `timeout_s`, waking at once when any child exits."""
        fds = [c.pidfd for c in self.live_children() if c.pidfd is not None and c.proc.returncode is None]
        if not fds:
            time.sleep(timeout_s)
            return
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        poller.poll(timeout_s * 1000)

    def _root_cause(self, first: Child) -> Child:
        """The child whose failure `first`'s is. A TP peer copies the failing rank's diagnostic into
        its own status and may be noticed first: it names the rank at fault (`culprit_rank`: one
        that failed, died or stopped answering), else the rank that failed earliest is blamed —
        among ranks that blame themselves: a peer may write its copy before the failing rank writes
        its own status. A child that died or hung without reporting a failure (crash, SIGKILL) is
        its own root cause."""
        mine = first.refresh()
        if mine is None or mine.phase != "failed":
            return first
        named = self._rank_of(first, mine.culprit_rank)
        if named is not None:
            if not named.cause:
                rec = named.refresh()
                if named.proc.poll() is not None:
                    named.cause = exit_cause(named.proc.returncode, rec, named.oom_kills_before)
                else:  # alive but silent (stopped, hung): the peer's diagnostic says what it saw
                    named.cause = rec.failure if rec is not None and rec.failure else mine.failure
            return named
        earliest, when = first, mine.phase_started_unix
        for c in self.children:
            rec = c.refresh() if c is not first and c.svc.name == first.svc.name else None
            if rec is None or rec.phase != "failed" or rec.culprit_rank not in (-1, c.rank):
                continue
            if rec.phase_started_unix < when:
                earliest, when = c, rec.phase_started_unix
        if earliest is not first and not earliest.cause:
            rec = earliest.status
            exited = earliest.proc.poll() is not None
            earliest.cause = (
                exit_cause(earliest.proc.returncode, rec, earliest.oom_kills_before)
                if exited
                else f"failed: {rec.failure}"
            )
        return earliest

    def _rank_of(self, child: Child, rank: int) -> Child | None:
        """Another rank of `child`'s service, or None."""
        if rank < 0 or rank == child.rank:
            return None
        return next((c for c in self.children if c.svc.name == child.svc.name and c.rank == rank), None)

    def dead_child(self, groups: Sequence[Group] | None = None) -> Child | None:
        children = self.live_children() if groups is None else [c for g in groups for c in g.children]
        for c in children:
            if c.proc.poll() is not None:
                c.refresh()
                c.cause = exit_cause(c.proc.returncode, c.status, c.oom_kills_before)
                return c
        return None

    def health_address(self, child: Child) -> str:
        """Where the launcher asks health: the main port, or the admin port of a TLS service (both follow the phase)."""
        if child.svc.tls is not None:
            return self.cfg.admin_address(child.svc.name)
        return (child.status.address if child.status else "") or self.cfg.address(child.svc.name)

    def healthy(self, child: Child, service: str = "") -> bool:
        """The service itself confirms SERVING (an acknowledgment, not a message that could be lost);
        `service`: a health name other than the whole server's (a gateway capability)."""
        if child.channel is None:
            child.channel = grpc.insecure_channel(self.health_address(child))
        try:
            reply = health_pb2_grpc.HealthStub(child.channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=self.cfg.startup.rpc_timeout_s
            )
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def capabilities_pending(self, child: Child) -> list[str]:
        """A serving gateway's capabilities that are not ready yet (it serves text before speech and
        images); none for other services, TP ranks > 0 and gateways with allow_degraded."""
        if child.svc.kind != "gateway" or child.rank > 0 or child.svc.gateway.allow_degraded:
            return []
        return [c for c in self.cfg.capabilities() if not self.healthy(child, CAPABILITY_HEALTH_PREFIX + c)]

    def check(self, child: Child, now: float) -> None:
        """Update one starting child: print progress, mark it ready, or set its failure cause."""
        rec = child.refresh()
        phase = child.phase
        if rec is not None and phase in STARTUP_PHASES:
            key = (phase, rec.done, rec.total, rec.detail)
            if key != child.printed:
                child.printed = key
                progress = rec.progress_text()
                elapsed = now - rec.phase_started_unix
                self.say(" ".join(p for p in (child.label, phase, progress, f"{elapsed:.1f}s") if p))
        if phase == "failed":
            child.cause = f"failed: {rec.failure if rec else 'unknown'}"
            return
        if phase in STARTUP_PHASES:
            started = (
                rec.phase_started_unix if rec is not None and phase != "starting" else child.spawned_unix
            )
            beat = rec.heartbeat_unix if rec is not None else child.spawned_unix
            child.cause = stuck_cause(self.cfg.startup, phase, now - started, now - beat)
            return
        if phase == "serving":
            if child.rank > 0 or self.healthy(child):
                pending = self.capabilities_pending(child)
                if not pending:
                    child.ready, child.ready_unix = True, now
                    self.say(f"{child.label} serving ({now - child.spawned_unix:.1f}s after start)")
                    return
                self.wait_capabilities(
                    child, pending, now - (rec.phase_started_unix if rec else child.spawned_unix)
                )
                return
            # Status says serving but health does not (yet): bounded by the starting deadline.
            waited = now - (rec.phase_started_unix if rec else child.spawned_unix)
            limit = self.cfg.startup.phase_deadlines_s.get("starting", 60.0)
            if waited > limit:
                child.cause = f"stuck: phase serving but health not SERVING after {limit:g}s"
            return
        child.cause = f"left start-up in phase {phase}"

    def wait_capabilities(self, child: Child, pending: list[str], waited_s: float) -> None:
        """A gateway that serves some capabilities but not yet `pending`: say so when that changes;
        bounded by gateway.stage_wait_s (its stages have their own start-up deadlines)."""
        ready = [c for c in self.cfg.capabilities() if c not in pending]
        key = ("capabilities", *pending)
        if key != child.printed:
            child.printed = key
            self.say(
                f"{child.label} serving {', '.join(ready) or 'nothing'}; waiting for {', '.join(pending)}"
            )
        limit = child.svc.gateway.stage_wait_s
        if waited_s > limit:
            child.cause = (
                f"stuck: serving, but {', '.join(pending)} not ready after {limit:g}s "
                f"(gateway.stage_wait_s; `omnistage status` tells why)"
            )

    def wait_serving(self, groups: list[Group]) -> Child | None:
        """Wait until every child of `groups` (started side by side) is ready; the child that failed, or None."""
        while True:
            if self.stop_signal is not None:
                return None
            dead = self.dead_child(groups)
            if dead is not None:
                return self._root_cause(dead)
            now = time.time()
            for child in (c for g in groups for c in g.children):
                if not child.ready:
                    self.check(child, now)
                    if child.cause:
                        return self._root_cause(child)
            if all(c.ready for g in groups for c in g.children):
                for g in groups:
                    g.state = "serving"
                return None
            self.pause(self.cfg.startup.poll_interval_s)

    # -- supervision after ready -------------------------------------------------------------

    def supervise(self) -> int:
        """Until SIGTERM/SIGINT (0): restart what dies or hangs; 1 when a service's restarts are spent."""
        while self.stop_signal is None:
            now = time.time()
            for g in self.groups:
                if g.state == "backoff" and now >= g.restart_at:
                    self.respawn(g)
            for g in self.groups:
                now = time.time()
                failure = self.group_failure(g, now)
                if failure is not None and not self.restart(g, *failure, now):
                    return 1
            self.watch_phases()
            waits = [g.restart_at - time.time() for g in self.groups if g.state == "backoff"]
            self.pause(max(0.0, min([self.cfg.startup.poll_interval_s, *waits])))
        self.say(f"omnistage: {signal.Signals(self.stop_signal).name}, stopping")
        return 0

    def group_failure(self, g: Group, now: float) -> tuple[Child, str] | None:
        """(culprit, what happened to it) for a group that died, failed or hung; None while it is fine."""
        if not g.active:
            return None
        dead = self.dead_child([g])
        if dead is not None:
            culprit = self._root_cause(dead)
            verb = "died" if culprit.proc.poll() is not None else "failed"
            return culprit, _what(
                verb + (" while restarting" if g.state == "starting" else ""), culprit.cause
            )
        if g.state == "starting":
            return self._restart_progress(g, now)
        sv, timeout = self.cfg.supervision, self.cfg.startup.rpc_timeout_s
        for c in g.children:
            rec = c.refresh()
            if rec is not None and rec.phase == "failed":
                culprit = self._root_cause(c)
                return culprit, _what("failed", culprit.cause or rec.failure)
            if c.probe is None and c.rank == 0:
                if c.channel is None:
                    c.channel = grpc.insecure_channel(self.health_address(c))
                c.probe = HealthProbe(c.channel)
            if c.probe is not None:
                c.probe.poll(now, sv.health_interval_s, timeout)
            alive = max(rec.alive_unix or rec.heartbeat_unix if rec else 0.0, c.ready_unix)
            answer = c.probe.silent_s(now) if c.probe is not None else None
            cause = hung_cause(sv, c.phase, now - alive, answer)
            if cause:
                c.cause, c.hung = cause, True
                return c, cause
        return None

    def _restart_progress(self, g: Group, now: float) -> tuple[Child, str] | None:
        """A restarting group: start-up rules (phase deadlines, progress), then 'serving again'."""
        for c in g.children:
            if not c.ready:
                self.check(c, now)
                if c.cause:
                    culprit = self._root_cause(c)
                    return culprit, f"failed while restarting: {culprit.cause}"
        if all(c.ready for c in g.children):
            if not g.admit_since:
                g.admit_since = now
            pending = self.admission_pending(g)
            restart = f"restart {g.attempt}/{self.cfg.supervision.max_restarts}"
            if pending and now - g.admit_since <= _ADMIT_WAIT_S:
                return None  # up, but clients cannot reach it through the gateway yet
            g.state, g.admit_since = "serving", 0.0
            if pending:
                self.say(
                    f"omnistage: {g.svc.name} serving again ({restart}), but the gateway has not admitted it "
                    f"after {_ADMIT_WAIT_S:g}s: {', '.join(pending)} not ready (`omnistage status` tells why)",
                    self.err,
                )
            else:
                self.say(f"omnistage: {g.svc.name} serving again ({restart})")
        return None

    def admission_pending(self, g: Group) -> list[str]:
        """The capabilities that need the restarted stage `g` and that a serving gateway does not serve
        yet: the gateway admits a stage that is back only after its own health check and warm-up."""
        needed = [
            c for c, kinds in CAPABILITIES.items() if g.svc.kind in kinds and c in self.cfg.capabilities()
        ]
        gateways = [
            c
            for gw in self.groups
            if gw.svc.kind == "gateway" and gw.state == "serving" and gw is not g
            for c in gw.children
            if c.rank == 0
        ]
        return [c for gw in gateways for c in needed if not self.healthy(gw, CAPABILITY_HEALTH_PREFIX + c)]

    def restart(self, g: Group, culprit: Child, what: str, now: float) -> bool:
        """Stop the whole group and schedule its restart after the backoff; False when none is left."""
        sv = self.cfg.supervision
        attempt = g.budget.attempt(now)
        if attempt is None:
            spent = (
                f"restarts exhausted ({sv.max_restarts} within {sv.restart_window_s:g}s), "
                if sv.max_restarts
                else ""
            )
            self.report(f"{culprit.label} {what}; {spent}stopping the others", culprit)
            return False
        delay = g.budget.delay_s(attempt)
        self.say(
            f"omnistage: {culprit.label} {what}; restarting {g.svc.name} "
            f"(attempt {attempt}/{sv.max_restarts}, in {delay:.1f}s)",
            self.err,
        )
        self.stop_group(g, kill_first=[culprit] if culprit.hung else [])
        g.state, g.attempt, g.restart_at = "backoff", attempt, time.time() + delay
        return True

    def respawn(self, g: Group) -> None:
        """Start every rank of a stopped group again (the start-up deadlines apply)."""
        self.say(
            f"omnistage: restarting {g.svc.name} (attempt {g.attempt}/{self.cfg.supervision.max_restarts})"
        )
        g.children = [self.spawn(g.svc, r) for r in range(g.svc.tp_size)]
        g.state, g.admit_since = "starting", 0.0

    def watch_phases(self) -> None:
        """After start-up: say when a service enters or leaves draining (Control.Drain / Resume)."""
        for c in (c for g in self.groups if g.state == "serving" for c in g.children):
            before, rec = c.announced or "serving", c.refresh()
            if rec is None or rec.phase == before:
                continue
            c.announced = rec.phase
            why = f" ({rec.detail})" if rec.detail else ""
            if rec.phase == "draining":
                self.say(f"{c.label} draining{why}")
            elif before == "draining" and rec.phase == "serving":
                self.say(f"{c.label} serving again{why}")

    # -- stopping ----------------------------------------------------------------------------

    def stop_all(self) -> None:
        """Stop each group (gateway first); bounded."""
        for g in reversed(self.groups):
            self.stop_group(g)

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

    def report(self, headline: str, culprit: Child) -> None:
        now = time.time()
        self.say(f"omnistage: {headline}", self.err)
        for c in self.children:
            if c is not culprit and not c.cause:
                c.refresh()
                if c.proc.poll() is not None:
                    c.cause = exit_cause(c.proc.returncode, c.status, c.oom_kills_before)
                elif not c.ready:
                    c.cause = self.group_cause(c, now)
            cause = c.cause or ("ready" if c.ready else "not ready yet")
            self.say(f"{c.summary(now)} {cause}", self.err)

    def group_cause(self, child: Child, now: float) -> str:
        """State of a still-starting rank when another one failed, with its TP group's phase clock.

        The ranks of a group pass each phase together (they meet in collectives), so the phase
        deadline runs from the first rank's entry: of two silent ranks, one hung and one waiting for
        it, both are named, whichever entered the phase first.
        """
        phase = child.phase
        rec = child.status
        beat = rec.heartbeat_unix if rec is not None else child.spawned_unix
        if phase not in STARTUP_PHASES:
            return f"not ready yet (phase {phase})"
        own = rec.phase_started_unix if rec is not None and phase != "starting" else child.spawned_unix
        starts = [
            c.entered[phase] for c in self.children if c.svc.name == child.svc.name and phase in c.entered
        ]
        started = min([own, *starts])
        cause = stuck_cause(self.cfg.startup, phase, now - started, now - beat)
        return cause or f"not ready yet (no progress for {now - beat:.1f}s)"

    # -- main --------------------------------------------------------------------------------

    def ready_address(self) -> str:
        gateways = self.cfg.services_of("gateway")
        first = gateways[0] if gateways else next(iter(self.cfg.services.values()))
        child = next(c for c in self.children if c.svc.name == first.name and c.rank == 0)
        return (child.status.address if child.status else "") or self.cfg.address(first.name)

    def start_groups(self, services: Sequence[ServiceConfig]) -> list[Group]:
        groups = []
        for svc in services:
            g = Group(svc, RestartBudget(self.cfg.supervision))
            g.children = [self.spawn(svc, r) for r in range(svc.tp_size)]
            groups.append(g)
        self.groups += groups
        return groups

    def run(self, ready_file: Path | None, exit_after_ready: bool) -> int:
        # Every service side by side, the gateway too: it serves text as soon as the thinker is
        # admitted and each other capability when its stage is; ready = every capability ready.
        try:
            if not self.start_mps():
                return 1
            culprit = self.wait_serving(self.start_groups(list(self.cfg.services.values())))
            if culprit is not None:
                self.report(f"start-up failed: {culprit.label} {culprit.cause}", culprit)
                return 1
            if self.stop_signal is not None:
                self.say(f"omnistage: {signal.Signals(self.stop_signal).name} during start-up, stopping")
                return 0
            address = self.ready_address()
            what = "gateway" if self.cfg.services_of("gateway") else "services"
            self.say(f"omnistage: ready in {time.monotonic() - self.started:.1f}s, {what} at {address}")
            if ready_file is not None:
                _write_atomic(ready_file, address + "\n")
            if exit_after_ready:
                return 0
            return self.supervise()
        finally:
            self.stop_all()
            self.say("omnistage: all services stopped")
            self.stop_mps()

    def start_mps(self) -> bool:
        """The CUDA MPS daemon, where the deploy file wants one (common/mps.py), before any stage
        starts; False when `devices.mps.mode: on` and it could not start (the start fails)."""
        if not mps.wanted(self.cfg):
            return True
        mode = self.cfg.devices.mps.mode
        daemon = mps.MpsDaemon(self.cfg.devices.mps, self.run_dir)
        try:
            daemon.start()
        except mps.MpsError as exc:
            if mode == "on":
                self.say(
                    f"omnistage: start-up failed: CUDA MPS (devices.mps.mode: on) did not start: {exc}",
                    self.err,
                )
                return False
            self.say(
                f"omnistage: warning: CUDA MPS did not start, the stages that share a GPU will time-slice "
                f"it (devices.mps.mode: auto; 'off' silences this): {exc}",
                self.err,
            )
            return True
        self.mps = daemon
        shared = "; ".join(f"GPU {g}: {', '.join(n)}" for g, n in mps.shared_gpus(self.cfg).items())
        assert daemon.proc is not None
        self.say(
            f"omnistage: CUDA MPS control daemon started (pid {daemon.proc.pid}, pipe {daemon.pipe_dir})"
            + (f" for {shared}" if shared else "")
        )
        return True

    def stop_mps(self) -> None:
        """Stop this run's MPS daemon, after every stage (its clients) has gone."""
        if self.mps is None:
            return
        problem = self.mps.stop()
        self.mps = None
        if problem:
            self.say(f"omnistage: warning: CUDA MPS control daemon: {problem}", self.err)
        else:
            self.say("omnistage: CUDA MPS control daemon stopped")

    def remove_segments_of(self, children: Sequence[Child]) -> None:
        """Shared memory of exited children that could not close it (killed, or stopped before their
        pools closed: a TP rank 0 stuck behind a stopped peer) goes as soon as they are gone: at each
        group's stop, so also before a restart, not at the next start's sweep."""
        from omnistage.common.transport.host import sweep_stale_segments

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


def _what(verb: str, cause: str) -> str:
    """`verb: cause` for the launcher's line, unless the cause already says it failed."""
    return cause if cause.startswith("failed: ") else f"{verb}: {cause}"


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


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def launch(
    cfg_path: str | Path,
    overrides: Sequence[str] = (),
    *,
    run_dir: str | Path | None = None,
    modules: dict[str, str] | None = None,
    ready_file: str | Path | None = None,
    exit_after_ready: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
    check_only: bool = False,
) -> int:
    """Run a deployment until SIGTERM/SIGINT (0), a failed start or a dead service (1), a bad config (2).

    Before anything starts: the config, the per-GPU memory ledger, then the checkpoint, every secret
    the config names and every port it binds (`preflight`), each refused with one line naming the key.
    `check_only` (`serve --check`): those checks and the ledger's table, then 0; nothing starts.

    `modules` maps stage kinds to a module name or a script path (tests substitute synthetic stages).
    """
    out, err = out or sys.stdout, err or sys.stderr
    checked = _checked_deploy(cfg_path, overrides, err)
    if isinstance(checked, int):
        return checked
    cfg, ledger = checked
    if check_only:
        print(ledger.table() if ledger.devices else "memory ledger: no device budgets", file=out)
        print(
            f"omnistage: {cfg_path}: the config, memory ledger, checkpoint, secrets and ports are fine "
            f"({len(cfg.services)} services); nothing started",
            file=out,
            flush=True,
        )
        return 0
    if ledger.devices:
        print(ledger.summary(), file=out, flush=True)
    sweep = _start_sweep(err)
    own_run_dir = run_dir is None
    rdir = Path(tempfile.mkdtemp(prefix="omnistage-run-")) if run_dir is None else Path(run_dir)
    rdir.mkdir(parents=True, exist_ok=True)
    launcher = Launcher(
        cfg, Path(cfg_path).resolve(), overrides, rdir, {**MODULES, **(modules or {})}, out, err
    )
    previous = _install_signals(launcher)
    key_file = _publish_stage_key(cfg_path, launcher.stage_key, err)
    record = _publish_run(cfg, cfg_path, overrides, rdir, err)
    try:
        return launcher.run(Path(ready_file) if ready_file else None, exit_after_ready)
    except ConfigError as exc:
        print(f"omnistage: config error: {exc}", file=err, flush=True)
        return 2
    finally:
        if key_file is not None:
            auth.withdraw_stage_key(key_file, launcher.stage_key)
        if record is not None:
            run_record.withdraw(record)
        sweep.join(timeout=_SWEEP_WAIT_S)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if own_run_dir:
            shutil.rmtree(rdir, ignore_errors=True)


def _checked_deploy(
    cfg_path: str | Path, overrides: Sequence[str], err: TextIO
) -> tuple[DeployConfig, LedgerReport] | int:
    """The config, its per-GPU memory ledger and `preflight`, checked before anything starts.

    Returns the config and its ledger, or 2 after one line per problem on `err`.
    """
    try:
        cfg = load_config(cfg_path, list(overrides))
    except ConfigError as exc:
        print(f"omnistage: config error: {exc}", file=err, flush=True)
        return 2
    if not cfg.services:
        print(f"omnistage: config error: services: {cfg_path} has no services to start", file=err, flush=True)
        return 2
    from omnistage.common.memory.ledger import LedgerError, check_deploy_memory

    try:  # the per-GPU memory ledger: refuse before anything starts
        ledger = check_deploy_memory(cfg)
    except LedgerError as exc:
        print(f"omnistage: {exc}", file=err, flush=True)
        return 2
    problems = preflight(cfg)  # checkpoint, secrets, ports: before anything starts or loads
    if problems:
        for line in problems:
            print(f"omnistage: {line}", file=err, flush=True)
        return 2
    return cfg, ledger


def _publish_run(
    cfg: DeployConfig, cfg_path: str | Path, overrides: Sequence[str], rdir: Path, err: TextIO
) -> run_record.RunRecord | None:
    """Record this run for the CLI (run_record.py); one that cannot be written is a warning."""
    record = run_record.RunRecord.of(cfg, cfg_path, overrides, rdir)
    published = _for_cli(lambda: run_record.publish(record), "the CLI will need --config", err)
    return record if published is not None else None


def _publish_stage_key(cfg_path: str | Path, stage_key: str, err: TextIO) -> Path | None:
    """Publish this run's stage key for the CLI's Control calls (none when it is '' or `off`)."""
    if not auth.stage_key({auth.STAGE_KEY_ENV: stage_key}):
        return None
    return _for_cli(
        lambda: auth.publish_stage_key(cfg_path, stage_key),
        f"the CLI will need ${auth.STAGE_KEY_ENV} for the stages' Control",
        err,
    )


def _for_cli(publish: Callable[[], Path], without: str, err: TextIO) -> Path | None:
    """`publish()` something the CLI reads; a failure is a warning (`without` says what it costs),
    not a failed start."""
    try:
        return publish()
    except (OSError, auth.SecretError) as exc:
        print(f"omnistage: warning: {without}: {exc}", file=err, flush=True)
        return None


def _install_signals(launcher: Launcher) -> dict[int, object]:
    if threading.current_thread() is not threading.main_thread():
        return {}

    def on_signal(sig: int, frame: object) -> None:
        launcher.stop_signal = sig

    return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}


def _sweep_shm(err: TextIO) -> None:
    """Remove shared-memory segments left by dead processes of an earlier run.

    Safe next to starting children: a segment goes only when its owner pid is dead and no process
    holds its lock. Runs in a thread because the transport package imports torch (seconds).
    """
    from omnistage.common.transport.host import sweep_stale_segments

    try:
        sweep_stale_segments()
    except Exception as exc:  # a failed sweep must not stop the start
        print(f"omnistage: warning: shm sweep failed: {exc}", file=err, flush=True)


def _start_sweep(err: TextIO) -> threading.Thread:
    thread = threading.Thread(target=_sweep_shm, args=(err,), name="shm-sweep", daemon=True)
    thread.start()
    return thread
