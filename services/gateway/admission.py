"""Admission by capacity: a request enters a stage only when the stage has room for it in time.

Each stage the gateway calls has a `StageGate`: the number of requests the stage runs at once (what
its start-up stress proved, read from its Describe), the requests this gateway has in it now, and a
bounded FIFO of requests waiting for a slot. Arrivals are judged at once against the request's
deadline with the measured service time of the stage (an exponentially weighted mean of how long
requests held a slot): when the estimated wait plus service time does not fit, or the waiting room is
full, the request is refused now with RESOURCE_EXHAUSTED and a `grpc-retry-pushback-ms` hint instead of
waiting to time out. Admitted requests therefore finish in time, and goodput stays near capacity under
any overload (a queue that accepts what it cannot finish collapses goodput to zero).

The gateway is the only client of its stages, so its own count of requests in a stage is the stage's
load; the stage's own bounded queue remains the backstop.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

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

    def __init__(self, stage: str, cfg: GateConfig) -> None:
        self.stage = stage
        self.cfg = cfg
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.service_s = cfg.initial_service_s
        self.finished = 0
        self.refused = 0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def set_capacity(self, max_running: int) -> None:
        """The stage's capacity changed (read again after a restart); waiters take new slots at once."""
        self.cfg = GateConfig(max_running, self.cfg.max_waiting, self.cfg.initial_service_s)
        self._wake()

    def has_room(self) -> bool:
        return not self.cfg.max_running or (self.running < self.cfg.max_running and not self._waiters)

    def estimated_wait_s(self, ahead: int | None = None) -> float:
        """Seconds until a request arriving now (behind `ahead` waiters) gets a slot: the running and
        waiting requests drain `max_running` at a time, each taking the mean service time."""
        if not self.cfg.max_running:
            return 0.0
        ahead = self.waiting if ahead is None else ahead
        if self.running < self.cfg.max_running and ahead == 0:
            return 0.0
        # Each wave of `max_running` requests takes service_s; the running ones count as just started
        # (a burst arrives at once): an admitted request is never promised more than it gets.
        waves = math.ceil((ahead + 1) / self.cfg.max_running)
        return self.service_s * waves

    def check(self, remaining_s: float | None, work_s: float = 0.0) -> float:
        """Refuse now (Overloaded) when a request with `remaining_s` to its deadline cannot get a slot
        and `work_s` more of service in time; returns the estimated wait."""
        wait = self.estimated_wait_s()
        if wait == 0.0:
            return wait
        hint = max(1, int(wait * 1000))
        if self.waiting >= self.cfg.max_waiting:
            self.refused += 1
            raise Overloaded(
                f"{self.stage}: {self.running} requests running and {self.waiting} waiting, its limit; "
                f"retry in about {wait:.1f}s", retry_after_ms=hint,
            )  # fmt: skip
        if remaining_s is not None and wait + max(work_s, self.service_s) > remaining_s:
            self.refused += 1
            raise Overloaded(
                f"{self.stage}: at capacity ({self.running} running, {self.waiting} waiting); the estimated "
                f"wait {wait:.1f}s plus {max(work_s, self.service_s):.1f}s of service exceeds the "
                f"{remaining_s:.1f}s left to the deadline", retry_after_ms=hint,
            )  # fmt: skip
        return wait

    @contextlib.asynccontextmanager
    async def slot(self, remaining_s: float | None) -> AsyncIterator[None]:
        """Hold one slot of the stage for the block; waits in FIFO order within the deadline."""
        await self._acquire(remaining_s)
        started = time.monotonic()
        try:
            yield
        finally:
            self._release(time.monotonic() - started)

    async def _acquire(self, remaining_s: float | None) -> None:
        self.check(remaining_s)
        if self.has_room():
            self.running += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
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
