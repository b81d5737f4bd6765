"""After ready: a service that dies, fails or falls silent is restarted as a whole TP group with
backoff (the rules: common/supervision.py) until its restart budget is spent."""

from __future__ import annotations

import signal
import time

import grpc
from omnistage.common.config import CAPABILITY_HEALTH_PREFIX
from omnistage.common.launcher.children import Child, Group
from omnistage.common.launcher.watch import StartupWatch
from omnistage.common.stages import CAPABILITIES
from omnistage.common.supervision import HealthProbe, hung_cause

# A restarted stage is announced "serving again" once the gateway admits it, or after this long.
_ADMIT_WAIT_S = 60.0


class Supervisor(StartupWatch):
    """Restarts what dies or hangs after ready; stops everything once a service's budget is spent."""

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
            return culprit, _what(
                _verb(culprit) + (" while restarting" if g.state == "starting" else ""), culprit.cause
            )
        if g.state == "starting":
            return self._restart_progress(g, now)
        sv, timeout = self.cfg.supervision, self.cfg.startup.rpc_timeout_s
        for c in g.children:
            rec = c.refresh()
            if rec is not None and rec.phase == "failed":
                culprit = self._root_cause(c)  # a peer it names may have died (SIGKILL)
                return culprit, _what(_verb(culprit), culprit.cause or rec.failure)
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


def _verb(culprit: Child) -> str:
    """What happened to the rank at fault: it died (has exited), or it failed (still leaving)."""
    return "died" if culprit.proc.poll() is not None else "failed"


def _what(verb: str, cause: str) -> str:
    """`verb: cause` for the launcher's line, unless the cause already says it failed."""
    return cause if cause.startswith("failed: ") else f"{verb}: {cause}"
