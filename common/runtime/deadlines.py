"""Deadlines for waits: `within` bounds an async wait, `cancel_and_wait` stops tasks within a bound,
`Deadline` feeds the timeouts of successive waits, `deadline_after` turns a call's time left into
the time.monotonic() it ends."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")
_log = logging.getLogger(__name__)


def deadline_after(time_remaining: float | None) -> float:
    """time.monotonic() when a call with `time_remaining` seconds left (gRPC's
    `context.time_remaining()`, None: no deadline) ends; inf when it has none."""
    return math.inf if time_remaining is None else time.monotonic() + time_remaining


async def within(awaitable: Awaitable[T], timeout_s: float | None) -> T:
    """`await awaitable` for at most `timeout_s` seconds (None: unbounded), else TimeoutError (the
    awaitable is cancelled). A cancellation of the caller always propagates (see the module doc)."""
    async with asyncio.timeout(timeout_s):
        return await awaitable


async def cancel_and_wait(tasks: Iterable[asyncio.Task], timeout_s: float, what: str) -> list[asyncio.Task]:
    """Cancel `tasks` and wait at most `timeout_s` for them to end; those still running are logged as an
    error naming `what` and returned (their owner goes on: a task that ignores its cancellation must
    not hang the request that holds it)."""
    tasks = [t for t in tasks if not t.done()]
    for task in tasks:
        task.cancel()
    if not tasks:
        return []
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    if pending:
        names = ", ".join(sorted(t.get_name() for t in pending))
        _log.error(
            "%s: %d task(s) still running %gs after their cancellation: %s",
            what,
            len(pending),
            timeout_s,
            names,
        )
    return list(pending)


class Deadline:
    """A point in monotonic time; `remaining()` feeds the timeouts of successive waits."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.expires = time.monotonic() + timeout_s

    def remaining(self) -> float:
        return max(0.0, self.expires - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.expires
