"""Replicas of one stage kind: the deploy file's services of that kind (`services.talker`,
`services.talker_b`, ... each with its own GPUs, ports and supervision), one client and one watch each."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from omnistage.common import metrics
from omnistage.common.runtime.errors import StageUnavailable
from omnistage.services.gateway.stages import StageClient

C = TypeVar("C", bound=StageClient)


class Replicas(Generic[C]):
    """The clients of one stage kind's replicas, in deploy-file order."""

    def __init__(self, kind: str, clients: Sequence[C], service: str | None = None) -> None:
        if not clients:
            raise ValueError(f"{kind}: no replicas")
        self.kind = kind
        self.clients = list(clients)
        self._next = 0  # where the round-robin among equally loaded replicas starts
        service = metrics.process_service() if service is None else service
        up = metrics.gauge(
            "gateway_stage_up",
            "1 while a stage replica is admitted (SERVING and warmed up), else 0",
            ("stage", "replica"),
        )
        calls = metrics.gauge(
            "gateway_stage_calls_in_flight",
            "Calls of this gateway in flight on a stage replica",
            ("stage", "replica"),
        )
        for c in self.clients:
            up.labels(service, kind, c.name).set_function(lambda c=c: float(c.up))
            calls.labels(service, kind, c.name).set_function(lambda c=c: c.calls_in_flight)

    def __len__(self) -> int:
        return len(self.clients)

    @property
    def first(self) -> C:
        return self.clients[0]

    def up(self) -> list[C]:
        return [c for c in self.clients if c.up]

    def pick(self, load: Callable[[C], float], fits: Callable[[C], bool] = lambda c: True) -> C | None:
        """The up replica that `fits` accepts with the least `load`; equal loads take turns. None when
        no replica is up and fits."""
        n = len(self.clients)
        order = [self.clients[(self._next + i) % n] for i in range(n)]
        candidates = [c for c in order if c.up and fits(c)]
        if not candidates:
            return None
        best = min(candidates, key=load)  # the first of the least loaded in turn order
        self._next = (self.clients.index(best) + 1) % n
        return best

    def unavailable(self) -> StageUnavailable:
        """UNAVAILABLE when no replica can take a call: the one replica's own error, or every replica's reason."""
        if len(self.clients) == 1:
            return self.first.unavailable()
        reasons = "; ".join(f"'{c.name}': {c.down_reason or 'up'}" for c in self.clients)
        return StageUnavailable(f"stage {self.kind} is unavailable: no replica can take the call ({reasons})")


def in_flight_share(capacity: Callable[[C], int]) -> Callable[[C], float]:
    """A replica's load: its calls in flight over its `capacity` (the calls alone when that is unknown)."""

    def load(c: C) -> float:
        cap = capacity(c)
        return c.calls_in_flight / cap if cap else float(c.calls_in_flight)

    return load
