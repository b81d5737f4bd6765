"""ConcurrencyLimiter: a stage never runs more at once than its stress test proved fits."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from omnistage.common.runtime.deadlines import within


class ConcurrencyLimiter:
    """Never run more than the tested batch at once: an asyncio gate with a deadline on every wait.

    Used from the stage's event loop (grpc.aio handlers); `in_use` / `peak_in_use` feed Describe.
    """

    def __init__(self, stage: str, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"{stage}: concurrency limit must be >= 1, got {limit}")
        self.stage = stage
        self.limit = limit
        self.in_use = 0
        self.peak_in_use = 0
        self._sem = asyncio.Semaphore(limit)

    @contextlib.asynccontextmanager
    async def slot(self, timeout_s: float) -> AsyncIterator[None]:
        """Hold one of `limit` slots; waits at most `timeout_s`, then TimeoutError naming the stage."""
        try:
            await within(self._sem.acquire(), timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"{self.stage}: no free batch slot within {timeout_s:g}s "
                f"({self.in_use}/{self.limit} busy; the limit is the stress-tested batch)"
            ) from None
        self.in_use += 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        try:
            yield
        finally:
            self.in_use -= 1
            self._sem.release()
