"""Wait helpers that always carry a deadline and say what was awaited, where, and in which phase.

An untimed wait turns a lost message into a silent hang; these turn it into one line naming the
stage, rank and phase (`timed out after 30s waiting for rank 1 weights (stage thinker, rank 0, ...)`).

Async code bounds a wait with `within`, never `asyncio.wait_for` (ruff bans it outside tests): on
Python 3.11 wait_for returns the result, and drops the caller's cancellation, when the awaited thing
finishes as the caller is cancelled (CPython gh-86296). A task cancelled then runs on, and a task
that must stop before its owner can go on (a pump feeding a buffer nobody reads any more) hangs it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Generic, TypeVar

from omnistage.common.runtime.errors import StartupTimeout

T = TypeVar("T")
_log = logging.getLogger(__name__)


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


def timeout_message(
    timeout_s: float, what: str, stage: str = "", rank: int | None = None, phase: str = ""
) -> str:
    """`timed out after 5s waiting for X (stage thinker, rank 1, phase loading_weights)`."""
    where = [
        f"stage {stage}" if stage else "",
        f"rank {rank}" if rank is not None else "",
        f"phase {phase}" if phase else "",
    ]
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


class _Polls(Generic[T]):
    """The pauses of one polling wait, shared by `wait_for` and `wait_for_async` (which sleep them
    their own way): iterating checks `predicate` and yields the next pause until it returns something
    truthy (then in `value`), and raises StartupTimeout once `timeout_s` has passed."""

    def __init__(self, predicate: Callable[[], T], timeout_s: float, message: str, poll_s: float) -> None:
        self.predicate, self.message, self.poll_s = predicate, message, poll_s
        self.deadline = Deadline(timeout_s)
        self.value: T

    def __iter__(self) -> Iterator[float]:
        while True:
            value = self.predicate()
            if value:
                self.value = value
                return
            if self.deadline.expired():
                raise StartupTimeout(self.message)
            yield min(self.poll_s, self.deadline.remaining())


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
    polls = _Polls(predicate, timeout_s, timeout_message(timeout_s, what, stage, rank, phase), poll_s)
    for pause in polls:
        time.sleep(pause)
    return polls.value


def wait_event(
    event: threading.Event,
    timeout_s: float,
    what: str,
    stage: str = "",
    rank: int | None = None,
    phase: str = "",
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
    polls = _Polls(predicate, timeout_s, timeout_message(timeout_s, what, stage, rank, phase), poll_s)
    for pause in polls:
        await asyncio.sleep(pause)
    return polls.value


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
        return await within(awaitable, timeout_s)
    except TimeoutError as exc:
        raise StartupTimeout(timeout_message(timeout_s, what, stage, rank, phase)) from exc


async def wait_event_async(
    event: asyncio.Event,
    timeout_s: float,
    what: str,
    stage: str = "",
    rank: int | None = None,
    phase: str = "",
) -> None:
    """`asyncio.Event.wait` with a deadline and a message."""
    await with_deadline(event.wait(), timeout_s, what, stage, rank, phase)
