"""RequestRun: one Generate request or Converse turn in the gateway, from its admission to its last event.

The stages of a request (the thinker's call, the talker's, the image stage's) run as tasks of its run
and push their events into its one bounded queue (`emit`); the servicer reads `events()`, the only
generator between a stage and the client. A slow client fills the queue and pauses this request's
stage streams (gRPC flow control), nobody else's. `cancel` ends every stage call of the run at once
(Converse's barge-in, a client gone); the run releases what it holds when it ends: its tasks, the
media's leases no thinker took, its admission ticket.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from omnistage.common.runtime.deadlines import cancel_and_wait
from omnistage.v1 import omni_pb2

# How long a run's tasks have to end once cancelled; a task still running then is logged and left
# behind, so that the request ends whatever it does.
TASK_STOP_S = 5.0
_END = object()  # the run's last item: after the Finish, or at once when it was cancelled or failed


class RequestRun:
    """One request's (or turn's) tasks, output queue, leases, usage and audio status."""

    def __init__(self, request_id: str, buffer_events: int, arrived_at: float | None = None) -> None:
        self.request_id = request_id
        self.arrived_at = time.monotonic() if arrived_at is None else arrived_at
        self._queue: asyncio.Queue = asyncio.Queue(max(1, buffer_events))
        self._tasks: set[asyncio.Task] = set()
        self._on_end: list[Callable[[], None]] = []
        self.over = False  # no more events go out: the run ended, failed or was cancelled
        self.error: BaseException | None = None
        self.cancelled = ""  # why the run was cancelled ("" while it was not)
        self.handed_over = False  # the thinker took the request (its `started`): no asking again
        self.prompt_tokens = 0  # the thinker's count at its `started` (the usage of an answer cut short)
        self.audio: omni_pb2.AudioStatus | None = None  # set by a spoken answer: what the client was sent
        # When its media were ready for the thinker, and when its first text was queued for the client
        # (None: not yet, or none): a Converse turn's phases (converse.py's metrics).
        self.media_at: float | None = None
        self.first_text_at: float | None = None

    # -- the stages' side ---------------------------------------------------------------------------

    def start(self, step: Coroutine[Any, Any, None], name: str) -> asyncio.Task:
        """Run `step` as a task of the run: its error fails the run (the client gets it)."""
        task = asyncio.create_task(step, name=f"{name} of {self.request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    async def emit(self, event: omni_pb2.GenerateEvent) -> None:
        """Queue `event` for the client (waits while the client is this many events behind)."""
        if not self.over:
            await self._queue.put(event)
            kind = event.WhichOneof("event")
            if self.audio is not None and kind == "audio":
                self._count_audio(event.audio, 1)
            elif kind == "text" and self.first_text_at is None:
                self.first_text_at = time.monotonic()

    async def finish(self, event: omni_pb2.GenerateEvent) -> None:
        """Queue the run's last event: nothing follows it (a `cancel` from now on is too late)."""
        await self.emit(event)
        if not self.over:
            self.over = True
            await self._queue.put(_END)

    def on_end(self, release: Callable[[], None]) -> None:
        """Call `release` once the run has ended (its tasks over): leases, slots, tickets."""
        self._on_end.append(release)

    def fail(self, exc: BaseException) -> None:
        """End the run with `exc` (the client's error): the stage calls are cancelled."""
        if not self.over:
            self.error = exc
            self._stop()

    def cancel(self, reason: str) -> None:
        """End the run now (a newer user turn, the client's `cancel`, the client gone): every stage call
        is cancelled; events not read yet are dropped."""
        if not self.over:
            self.cancelled = reason
            self._stop()

    # -- the client's side --------------------------------------------------------------------------

    async def __aenter__(self) -> RequestRun:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def events(self) -> AsyncIterator[omni_pb2.GenerateEvent]:
        """The run's events until its last (its error raised). Its owner closes the run (`async with`)."""
        while (event := await self._queue.get()) is not _END:
            yield event
        if self.error is not None:
            raise self.error

    async def close(self) -> None:
        """Cancel what still runs (bounded wait), then release what the run holds."""
        self.cancel("the run was closed")
        for task in self._tasks:
            task.cancel()
        try:
            await cancel_and_wait(list(self._tasks), TASK_STOP_S, f"request {self.request_id}")
        finally:
            releases, self._on_end = self._on_end, []
            for release in reversed(releases):
                release()

    # -- internals ----------------------------------------------------------------------------------

    def _count_audio(self, chunk: omni_pb2.AudioChunk, sign: int) -> None:
        """The audio status counts what the client is sent: queued (+1), or dropped unread (-1)."""
        status = self.audio
        if chunk.pcm16 and not status.samples and sign > 0:
            status.time_to_first_audio_ms = (time.monotonic() - self.arrived_at) * 1000
        status.samples += sign * (len(chunk.pcm16) // 2)

    def _ended(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.fail(exc)

    def _stop(self) -> None:
        """No more events: the queue keeps only the end mark, every task is cancelled."""
        self.over = True
        while not self._queue.empty():
            event = self._queue.get_nowait()
            if self.audio is not None and event is not _END and event.WhichOneof("event") == "audio":
                self._count_audio(event.audio, -1)
        self._queue.put_nowait(_END)
        for task in self._tasks:
            task.cancel()
