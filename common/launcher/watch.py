"""Waiting for the start-up: status files, pidfds and health Checks, until every rank is ready or
one is named with its phase and cause; the diagnostics of a failure; draining announced after."""

from __future__ import annotations

import select
import time
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnistage.common.config import CAPABILITY_HEALTH_PREFIX, STARTUP_PHASES, StartupConfig
from omnistage.common.launcher.children import Child, Group, exit_cause
from omnistage.common.launcher.spawn import Processes

# How long a rank its peers blame may take to be reaped: a SIGKILLed process the peers saw gone may not
# have been reaped yet when the launcher reads their reports.
_REAP_WAIT_S = 1.0


def _reaped(child: Child, timeout_s: float) -> bool:
    """Whether `child` has exited, waiting at most `timeout_s` for it."""
    deadline = time.monotonic() + timeout_s
    while child.proc.poll() is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


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


class StartupWatch(Processes):
    """Reads what the children say (status files, exits, health) and decides ready or failed."""

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
                leaving = rec is not None and rec.phase == "failed" and bool(rec.failure)
                if leaving and named.proc.poll() is None:  # failed, still exiting
                    named.cause = f"failed: {rec.failure}"
                elif _reaped(named, 0.0 if leaving else _REAP_WAIT_S):
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
