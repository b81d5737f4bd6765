"""ConcurrencyLimiter: a stage never runs more at once than its stress test proved fits.

One shape for every stage's admission: `admit` gives a request its slot or the stage's refusal
(RESOURCE_EXHAUSTED with pushback when the waiting room is full or the queue wait ran out,
DEADLINE_EXCEEDED when the request's own deadline passes first); `slot` is the bare wait. A request
may take several `units` of the limit at once (the encoder's audio: a clip's mel frames); waiters are
served first come, first served, so a large one is never passed by smaller ones that come after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator

from omnistage.common.runtime.deadlines import within
from omnistage.common.runtime.errors import DeadlineExceeded, Overloaded


class ConcurrencyLimiter:
    """Never run more than the tested batch at once: an asyncio gate with a deadline on every wait.

    Used from the stage's event loop (grpc.aio handlers); `in_use` / `peak_in_use` (units) / `waiting`
    (requests) feed Describe and the stage's gauges. `max_waiting` (None: no bound) is the waiting
    room's size; `unit` names what the limit counts in a refusal (empty: slots).
    """

    def __init__(
        self, stage: str, limit: int, *, max_waiting: int | None = None, waiting_key: str = "", unit: str = ""
    ) -> None:
        if limit < 1:
            raise ValueError(f"{stage}: concurrency limit must be >= 1, got {limit}")
        self.stage = stage
        self.limit = limit
        self.max_waiting = max_waiting
        self.waiting_key = waiting_key  # the config key of `max_waiting`, named in the refusal
        self.unit = unit
        self.in_use = 0
        self.peak_in_use = 0
        self.waiting = 0
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()  # (units, granted), first come first

    @contextlib.asynccontextmanager
    async def slot(self, timeout_s: float, units: int = 1) -> AsyncIterator[None]:
        """Hold `units` of `limit`; waits at most `timeout_s`, then TimeoutError naming the stage."""
        await self._acquire(timeout_s, units)
        try:
            yield
        finally:
            self._release(units)

    @contextlib.asynccontextmanager
    async def admit(
        self,
        deadline: float,
        queue_timeout_s: float,
        *,
        what: str = "a slot",
        retry_after_ms: int = 500,
        units: int = 1,
    ) -> AsyncIterator[None]:
        """Hold `units` for a request due by `deadline` (time.monotonic; inf: none), waiting at most
        `queue_timeout_s`: refused at once when the waiting room is full, DEADLINE_EXCEEDED when the
        deadline comes first, else RESOURCE_EXHAUSTED with `retry_after_ms` of pushback."""
        if self.max_waiting is not None and self.in_use >= self.limit and self.waiting >= self.max_waiting:
            raise Overloaded(
                f"{self.stage}: {self.in_use} running and {self.waiting} waiting"
                + (f" ({self.waiting_key})" if self.waiting_key else ""),
                retry_after_ms=retry_after_ms,
            )
        wait = min(deadline - time.monotonic(), queue_timeout_s)
        if wait <= 0:
            raise DeadlineExceeded(f"{self.stage}: deadline passed before {what}")
        try:
            await self._acquire(wait, units)
        except TimeoutError as exc:
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"{self.stage}: deadline passed waiting for {what}") from exc
            raise Overloaded(str(exc), retry_after_ms=retry_after_ms) from exc
        try:
            yield
        finally:
            self._release(units)

    async def _acquire(self, timeout_s: float, units: int) -> None:
        if not 1 <= units <= self.limit:
            raise ValueError(f"{self.stage}: {units} units asked of a limit of {self.limit}")
        if not self._waiters and self.in_use + units <= self.limit:
            self._take(units)
            return
        granted = asyncio.get_running_loop().create_future()
        waiter = (units, granted)
        self._waiters.append(waiter)
        self.waiting += 1
        try:
            await within(granted, timeout_s)
        except BaseException as exc:
            if granted.done() and not granted.cancelled():
                self._release(units)  # given as the wait ended: handed on
            else:
                granted.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
                self._wake()  # the ones behind it may fit now
            if isinstance(exc, TimeoutError):
                busy = f"{self.in_use}/{self.limit}" + (f" {self.unit}" if self.unit else "")
                raise TimeoutError(
                    f"{self.stage}: no free batch slot within {timeout_s:g}s "
                    f"({busy} busy; the limit is the stress-tested batch)"
                ) from None
            raise
        finally:
            self.waiting -= 1

    def _take(self, units: int) -> None:
        self.in_use += units
        self.peak_in_use = max(self.peak_in_use, self.in_use)

    def _release(self, units: int) -> None:
        self.in_use -= units
        self._wake()

    def _wake(self) -> None:
        """Grant the waiters at the head of the line while they fit (first come, first served)."""
        while self._waiters:
            units, granted = self._waiters[0]
            if granted.done():  # its wait ended (timeout, cancel): it removes itself
                self._waiters.popleft()
                continue
            if self.in_use + units > self.limit:
                return
            self._waiters.popleft()
            self._take(units)
            granted.set_result(None)
