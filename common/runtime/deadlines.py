"""Wait helpers that always carry a deadline and say what was awaited, where, and in which phase.

An untimed wait turns a lost message into a silent hang; these turn it into one line naming the
stage, rank and phase (`timed out after 30s waiting for rank 1 weights (stage thinker, rank 0, ...)`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from omnistage.common.runtime.errors import StartupTimeout

T = TypeVar("T")


def timeout_message(timeout_s: float, what: str, stage: str = "", rank: int | None = None, phase: str = "") -> str:
    """`timed out after 5s waiting for X (stage thinker, rank 1, phase loading_weights)`."""
    where = [f"stage {stage}" if stage else "", f"rank {rank}" if rank is not None else "",
             f"phase {phase}" if phase else ""]
    where_text = ", ".join(w for w in where if w)
    return f"timed out after {timeout_s:g}s waiting for {what}" + (f" ({where_text})" if where_text else "")


class Deadline:
    """A point in monotonic time; `remaining()` feeds the timeouts of successive waits."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.expires = time.monotonic() + timeout_s

    def remaining(self) -> float:
        return max(0.0, self.expires - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.expires


def wait_for(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str,
    stage: str = "",
    rank: int | None = None,
    phase: str = "",
    *,
    poll_s: float = 0.02,
) -> T:
    """Poll `predicate` until it returns something truthy (returned), or raise StartupTimeout."""
    deadline = Deadline(timeout_s)
    while True:
        value = predicate()
        if value:
            return value
        if deadline.expired():
            raise StartupTimeout(timeout_message(timeout_s, what, stage, rank, phase))
        time.sleep(min(poll_s, deadline.remaining()))


def wait_event(
    event: threading.Event, timeout_s: float, what: str, stage: str = "", rank: int | None = None, phase: str = ""
) -> None:
    """`event.wait` that raises StartupTimeout instead of returning False."""
    if not event.wait(timeout_s):
        raise StartupTimeout(timeout_message(timeout_s, what, stage, rank, phase))


async def wait_for_async(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str,
    stage: str = "",
    rank: int | None = None,
    phase: str = "",
    *,
    poll_s: float = 0.02,
) -> T:
    """Async `wait_for`: polls without blocking the event loop."""
    deadline = Deadline(timeout_s)
    while True:
        value = predicate()
        if value:
            return value
        if deadline.expired():
            raise StartupTimeout(timeout_message(timeout_s, what, stage, rank, phase))
        await asyncio.sleep(min(poll_s, deadline.remaining()))


async def with_deadline(
    awaitable: Awaitable[T],
    timeout_s: float,
    what: str,
    stage: str = "",
    rank: int | None = None,
    phase: str = "",
) -> T:
    """Await `awaitable` for at most `timeout_s` (cancelled after), raising StartupTimeout."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError as exc:
        raise StartupTimeout(timeout_message(timeout_s, what, stage, rank, phase)) from exc


async def wait_event_async(
    event: asyncio.Event, timeout_s: float, what: str, stage: str = "", rank: int | None = None, phase: str = ""
) -> None:
    """`asyncio.Event.wait` with a deadline and a message."""
    await with_deadline(event.wait(), timeout_s, what, stage, rank, phase)
