"""Admission by capacity: a request enters a stage only when the stage has room for it in time."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from omnistage.common import metrics
from omnistage.common.runtime.deadlines import within
from omnistage.common.runtime.errors import DeadlineExceeded, Overloaded

# The weight of the newest service time in the running mean (about the last 10 requests count).
_EWMA_WEIGHT = 0.2


@dataclass(frozen=True)
class GateConfig:
    """How one stage admits requests (the gateway config's admission keys)."""

    # Requests the stage runs at once; 0: unknown, no limit here (the stage's own queue decides).
    max_running: int = 0
    # Requests that may wait here for a slot, beyond the running ones.
    max_waiting: int = 64
    # Service time assumed before the first request finished, in seconds.
    initial_service_s: float = 1.0


class StageGate:
    """Slots of one stage held by this gateway's requests, and the requests waiting for one."""

    def __init__(self, stage: str, cfg: GateConfig, service: str | None = None) -> None:
        self.stage = stage
        self.cfg = cfg
        self.running = 0
        # Requests admitted at arrival that have not reached this gate yet (a burst is judged before
        # any of it holds a slot): counted like waiters, ahead of later arrivals.
        self.coming = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.service_s = cfg.initial_service_s
        self.finished = 0
        self.refused = 0
        labels = (metrics.process_service() if service is None else service, stage)
        metrics.gauge(
            "gateway_admission_running",
            "Requests holding a slot of a stage (admitted by this gateway) now",
            ("stage",),
        ).labels(*labels).set_function(lambda: self.running)
        metrics.gauge(
            "gateway_admission_waiting",
            "Requests waiting in this gateway for a slot of a stage now",
            ("stage",),
        ).labels(*labels).set_function(lambda: self.waiting)
        self._wait = metrics.histogram(
            "gateway_admission_wait_seconds",
            "Time an admitted request waited for a slot of a stage (0 when one was free)",
            ("stage",),
        ).labels(*labels)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def expect(self) -> Coming:
        """Count one admitted request as on its way to this gate until it `arrived()`."""
        self.coming += 1
        return Coming(self)

    @contextlib.contextmanager
    def on_its_way(self) -> Iterator[Coming]:
        """`expect` for the block."""
        coming = self.expect()
        try:
            yield coming
        finally:
            coming.arrived()

    def set_capacity(self, max_running: int, max_waiting: int | None = None) -> None:
        """The stage's capacity changed (read again after a restart); waiters take new slots at once."""
        waiting = self.cfg.max_waiting if max_waiting is None else max_waiting
        self.cfg = GateConfig(max_running, waiting, self.cfg.initial_service_s)
        self._wake()

    @property
    def idle(self) -> bool:
        """Nothing of this gateway's in the stage or on its way: a lone request is never refused for its
        cost here (its deadline is the client's choice)."""
        return not (self.running or self.waiting or self.coming)

    def has_room(self) -> bool:
        return not self.cfg.max_running or (self.running < self.cfg.max_running and not self._waiters)

    def estimated_wait_s(
        self, ahead: int | None = None, service_s: float | None = None, *, coming: bool = True
    ) -> float:
        """Seconds until a request arriving now (behind `ahead` waiters) gets a slot: the running and
        waiting requests drain `max_running` at a time, each taking the mean service time (or
        `service_s`: what requests like this one take at the measured pace). `coming`: count the
        requests admitted but not at the gate yet as ahead (at arrival; not at the gate itself, where
        those are the later ones)."""
        if not self.cfg.max_running:
            return 0.0
        queued = self.waiting if ahead is None else ahead
        on_way = self.coming if coming else 0
        if self.running + on_way < self.cfg.max_running and queued == 0:
            return 0.0
        # The requests on their way take the free slots first; the rest of them queue ahead too.
        ahead = queued + max(0, on_way - max(0, self.cfg.max_running - self.running))
        # Each wave of `max_running` requests takes service_s, the running ones counted as just started.
        # Pessimistic on purpose: counting them half done (steady load) admitted requests that then
        # missed their deadlines (17 of 161 on the H100 Poisson run, bench/RESULTS.md); this admits
        # only what finishes in time (0 misses), at about the same goodput.
        waves = math.ceil((ahead + 1) / self.cfg.max_running)
        return (self.service_s if service_s is None else service_s) * waves

    def check(self, remaining_s: float | None, work_s: float = 0.0, *, coming: bool = True) -> float:
        """Refuse now (Overloaded) when a request with `remaining_s` to its deadline cannot get a slot
        and `work_s` more of service in time; returns the estimated wait."""
        wait = self.check_room(coming=coming)
        if wait and remaining_s is not None and wait + max(work_s, self.service_s) > remaining_s:
            raise self._late(wait, max(work_s, self.service_s), remaining_s)
        return wait

    def check_room(self, *, coming: bool = True) -> float:
        """Refuse now when the waiting room is full; else the estimated wait for a slot."""
        wait = self.estimated_wait_s(coming=coming)
        if wait and self.waiting >= self.cfg.max_waiting:
            raise self.refuse(
                f"{self.waiting} requests waiting, the most that may wait for it ({self.running} running "
                f"of {self.cfg.max_running}); retry in about {wait:.1f}s",
                wait,
                "queue_full",
            )
        return wait

    def refuse(self, why: str, retry_s: float, cause: str = "deadline") -> Overloaded:
        """A refusal of this stage's, counted: `why` after the stage's name, a retry hint of `retry_s`
        (at least 1 ms) and the metrics reason `<stage>_<cause>`."""
        self.refused += 1
        return Overloaded(
            f"{self.stage}: {why}", retry_after_ms=max(1, int(retry_s * 1000)), reason=f"{self.stage}_{cause}"
        )

    def _late(self, wait: float, work_s: float, remaining_s: float, path: str = "") -> Overloaded:
        state = "at capacity " if wait else ""
        return self.refuse(
            f"{state}({self.running} running, {self.waiting} waiting); the estimated wait {wait:.1f}s plus "
            f"{work_s:.1f}s of service{path} exceeds the {remaining_s:.1f}s left to the deadline",
            wait or self.service_s,
        )

    async def take(self, remaining_s: float | None, *, first: bool = False) -> Slot:
        """One slot of the stage, waited for in FIFO order within `remaining_s` (DeadlineExceeded past
        it); the caller releases it. `first`: ahead of every waiter, never refused for the waiting room
        (work already begun that lost its slot: a spoken answer whose talker replica went down)."""
        arrived = time.monotonic()
        await self._acquire(remaining_s, first)
        started = time.monotonic()
        self._wait.observe(started - arrived)
        return Slot(self, started)

    @contextlib.asynccontextmanager
    async def slot(self, remaining_s: float | None) -> AsyncIterator[Slot]:
        """Hold one slot of the stage for the block (`take`, released at its end or before)."""
        held = await self.take(remaining_s)
        try:
            yield held
        finally:
            held.release()

    async def _acquire(self, remaining_s: float | None, first: bool = False) -> None:
        if not first:
            self.check(remaining_s, coming=False)
        if self.has_room() or (first and self.running < self.cfg.max_running):
            self.running += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if first:
            self._waiters.appendleft(fut)
        else:
            self._waiters.append(fut)
        try:
            await within(asyncio.shield(fut), remaining_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if fut.done() and not fut.cancelled():  # a slot came as the wait ended: hand it on
                self.running -= 1
                self._wake()
            else:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise DeadlineExceeded(f"{self.stage}: the deadline passed while waiting for a slot") from None

    def _release(self, held_s: float) -> None:
        self.running -= 1
        self.finished += 1
        self.service_s += _EWMA_WEIGHT * (held_s - self.service_s)
        self._wake()

    def _wake(self) -> None:
        """Give free slots to the oldest waiters (the slot is counted as theirs before they run)."""
        while self._waiters and (not self.cfg.max_running or self.running < self.cfg.max_running):
            fut = self._waiters.popleft()
            if not fut.done():
                self.running += 1
                fut.set_result(None)


class Coming:
    """One admitted request counted as on its way to a gate (its `coming`), until it arrives there."""

    def __init__(self, gate: StageGate) -> None:
        self.gate: StageGate | None = gate

    def arrived(self) -> None:
        """It reached the gate (it takes or waits for a slot now), or will not come (once)."""
        if self.gate is not None:
            self.gate.coming -= 1
            self.gate = None


class Slot:
    """One slot of a stage held by a request; `release` gives it back (once) and times its hold."""

    def __init__(self, gate: StageGate, started: float) -> None:
        self.gate: StageGate | None = gate
        self.started = started

    def release(self) -> None:
        if self.gate is not None:
            gate, self.gate = self.gate, None
            gate._release(time.monotonic() - self.started)


def check_path(
    gates: list[StageGate], remaining_s: float | None, work_s: dict[str, float] | None = None
) -> None:
    """A request that passes `gates` one after another (encoder, thinker, image stage): refused now
    when a waiting room on its path is full, or when the sum of every stage's estimated wait and
    service time does not fit in the `remaining_s` to its deadline (the stage that makes it wait
    longest, or whose work is largest, is named). `work_s`: stage → this request's own service time
    (the thinker's: its tokens at the measured pace, pace.py), judged even when a slot is free; other
    stages count their mean service time, and only when one of them has to wait. Each slot is judged
    again when it is taken. A stage that is idle does not judge the request's own work: a lone request
    is never refused for cost."""
    by_stage = {gate.stage: gate for gate in gates}
    work_s = {
        stage: w for stage, w in (work_s or {}).items() if stage in by_stage and not by_stage[stage].idle
    }
    waits = [(gate.check_room(), gate) for gate in gates]
    if remaining_s is None or not (
        any(wait for wait, _ in waits) or any(g.stage in work_s for _, g in waits)
    ):
        return
    service = {gate.stage: work_s.get(gate.stage, gate.service_s) for _, gate in waits}
    # Where the request's own cost is known, the requests ahead of it are taken to cost as much
    # (a burst of alike requests), when that is more than their measured mean.
    waits = [
        (
            gate.estimated_wait_s(service_s=max(gate.service_s, work_s[gate.stage]))
            if wait and gate.stage in work_s
            else wait,
            gate,
        )
        for wait, gate in waits
    ]
    total = sum(wait + service[gate.stage] for wait, gate in waits)
    if total > remaining_s:
        wait, worst = max(waits, key=lambda wg: (wg[0] + service[wg[1].stage], wg[0]))
        others = total - wait - service[worst.stage]
        path = f" (and {others:.1f}s at the other stages of its path)" if others > 0 else ""
        raise worst._late(wait, service[worst.stage], remaining_s, path)
