"""Polling waits for tests: each has a deadline and its timeout names what was awaited and where."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from omnistage.common.runtime.deadlines import Deadline

T = TypeVar("T")


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


class _Polls(Generic[T]):
    """The pauses of one polling wait, shared by `wait_for` and `wait_for_async`: iterating checks
    `predicate` and yields the next pause until it returns something truthy (then in `value`), and
    raises TimeoutError once `timeout_s` has passed."""

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
                raise TimeoutError(self.message)
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
    """Poll `predicate` until it returns something truthy (returned), or raise TimeoutError."""
    polls = _Polls(predicate, timeout_s, timeout_message(timeout_s, what, stage, rank, phase), poll_s)
    for pause in polls:
        time.sleep(pause)
    return polls.value


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


def wait_event(
    event: threading.Event, timeout_s: float, what: str, stage: str = "", rank: int | None = None
) -> None:
    """`event.wait` that raises TimeoutError instead of returning False."""
    if not event.wait(timeout_s):
        raise TimeoutError(timeout_message(timeout_s, what, stage, rank))
