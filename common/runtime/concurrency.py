"""ConcurrencyLimiter: a stage never runs more at once than its stress test proved fits.

One shape for every stage's admission: `admit` gives a request its slot or the stage's refusal
(RESOURCE_EXHAUSTED with pushback when the waiting room is full or the queue wait ran out,
DEADLINE_EXCEEDED when the request's own deadline passes first); `slot` is the bare wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from omnistage.common.runtime.deadlines import within
from omnistage.common.runtime.errors import DeadlineExceeded, Overloaded


class ConcurrencyLimiter:
    """Never run more than the tested batch at once: an asyncio gate with a deadline on every wait.

    Used from the stage's event loop (grpc.aio handlers); `in_use` / `peak_in_use` / `waiting` feed
    Describe and the stage's gauges. `max_waiting` (None: no bound) is the waiting room's size.
    """

    def __init__(
        self, stage: str, limit: int, *, max_waiting: int | None = None, waiting_key: str = ""
    ) -> None:
        if limit < 1:
            raise ValueError(f"{stage}: concurrency limit must be >= 1, got {limit}")
        self.stage = stage
        self.limit = limit
        self.max_waiting = max_waiting
        self.waiting_key = waiting_key  # the config key of `max_waiting`, named in the refusal
        self.in_use = 0
        self.peak_in_use = 0
        self.waiting = 0
        self._sem = asyncio.Semaphore(limit)

    @contextlib.asynccontextmanager
    async def slot(self, timeout_s: float) -> AsyncIterator[None]:
        """Hold one of `limit` slots; waits at most `timeout_s`, then TimeoutError naming the stage."""
        await self._acquire(timeout_s)
        try:
            yield
        finally:
            self._release()

    @contextlib.asynccontextmanager
    async def admit(
        self, deadline: float, queue_timeout_s: float, *, what: str = "a slot", retry_after_ms: int = 500
    ) -> AsyncIterator[None]:
        """Hold one slot for a request due by `deadline` (time.monotonic; inf: none), waiting at most
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
            await self._acquire(wait)
        except TimeoutError as exc:
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"{self.stage}: deadline passed waiting for {what}") from exc
            raise Overloaded(str(exc), retry_after_ms=retry_after_ms) from exc
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, timeout_s: float) -> None:
        self.waiting += 1
        try:
            await within(self._sem.acquire(), timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"{self.stage}: no free batch slot within {timeout_s:g}s "
                f"({self.in_use}/{self.limit} busy; the limit is the stress-tested batch)"
            ) from None
        finally:
            self.waiting -= 1
        self.in_use += 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)

    def _release(self) -> None:
        self.in_use -= 1
        self._sem.release()
