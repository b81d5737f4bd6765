"""What the launcher decides about a service after start-up: is it hung, and may it be restarted, when.

Kept apart from the process handling in `common/launcher/` so the rules (restart budget, backoff, the
hung test, the non-blocking health probe) are plain code with unit tests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnistage.common.config import SupervisionConfig


@dataclass
class RestartBudget:
    """Restarts of one service inside a sliding window, and the exponential backoff before each."""

    cfg: SupervisionConfig
    times: deque[float] = field(default_factory=deque)

    def attempt(self, now: float) -> int | None:
        """Record one failure at `now`: the number of the restart it earns (1-based), None when exhausted."""
        while self.times and now - self.times[0] > self.cfg.restart_window_s:
            self.times.popleft()
        if len(self.times) >= self.cfg.max_restarts:
            return None
        self.times.append(now)
        return len(self.times)

    def delay_s(self, attempt: int) -> float:
        """backoff_initial_s doubled per restart already made in the window, capped at backoff_max_s."""
        return min(self.cfg.backoff_initial_s * 2 ** (attempt - 1), self.cfg.backoff_max_s)


def hung_cause(cfg: SupervisionConfig, phase: str, beat_age_s: float, answer_age_s: float | None) -> str:
    """'' while a ready process beats and (rank 0) answers health; else a sentence saying how long it
    has been silent. `answer_age_s` is None for a process without a gRPC server."""
    limit = cfg.heartbeat_timeout_s
    if beat_age_s > limit:
        return f"stopped answering for {beat_age_s:.1f}s (heartbeat timeout {limit:g}s) while {phase}"
    if answer_age_s is not None and answer_age_s > limit:
        return f"has not answered health for {answer_age_s:.1f}s (heartbeat timeout {limit:g}s) while {phase}"
    return ""


class HealthProbe:
    """One health Check in flight at a time, never waited on: the supervision loop keeps polling.

    Any answer (SERVING or NOT_SERVING: a draining service is alive) counts as alive; only silence
    past the deadline or a broken connection does not. Silence is timed from the sending of the
    first probe that got no answer, so it never overstates how long the service has been silent.
    """

    def __init__(self, channel: grpc.Channel) -> None:
        self.stub = health_pb2_grpc.HealthStub(channel)
        self.last_sent = 0.0
        # When the oldest probe still without an answer was sent; None after an answer.
        self.unanswered_since: float | None = None
        self.future: grpc.Future | None = None

    def silent_s(self, now: float) -> float:
        return 0.0 if self.unanswered_since is None else now - self.unanswered_since

    def poll(self, now: float, interval_s: float, timeout_s: float) -> None:
        """Collect a finished probe; send the next one when `interval_s` has passed."""
        if self.future is not None:
            if not self.future.done():
                return
            try:
                self.future.result()
                self.unanswered_since = None
            except grpc.RpcError:
                pass
            self.future = None
        if now - self.last_sent >= interval_s:
            self.last_sent = now
            if self.unanswered_since is None:
                self.unanswered_since = now
            self.future = self.stub.Check.future(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)

    def cancel(self) -> None:
        if self.future is not None:
            self.future.cancel()
            self.future = None
