"""Dynamic batcher: concurrent requests' items share one forward per modality, never above the tested cap.

Each item first takes a slot of its modality's `ConcurrencyLimiter` (limit = the batch the start-up
stress proved to fit), then queues. One device thread takes everything queued for one modality
(oldest modality first) and runs it as one forward, so at most `limit` items of a modality are ever
in a forward, and the two modalities never run at once (their stress peaks were measured apart).
A slot is held until the item's forward has finished, even when its caller gave up, so a cancelled
request can never let more than the tested batch onto the device. `on_queued(seconds)` hears, as
each item's forward starts, how long it waited since `submit` (slot wait + queue); a skipped
(cancelled) item is never reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from omnistage.common import metrics
from omnistage.common.log import get_logger
from omnistage.common.memory.stress import ConcurrencyLimiter

log = get_logger(__name__)

RunBatch = Callable[[Sequence[Any]], Sequence[Any]]


def batches_counter():
    return metrics.counter("encoder_batches", "Encoder forwards run, by modality", ("modality",))


def batched_items_counter():
    return metrics.counter("encoder_batched_items", "Items encoded in those forwards, by modality", ("modality",))


def batch_size_histogram():
    return metrics.histogram("encoder_batch_items", "Items per encoder forward, by modality", ("modality",),
                             buckets=(1, 2, 4, 8, 16, 32, 64))


def queue_time_histogram():
    return metrics.histogram("encoder_queue_time_seconds", "Time an item waited in the encoder: its arrival "
                             "in the batcher (slot wait included) to the start of the forward that encodes it")


@dataclass(eq=False)
class _Entry:
    item: Any
    future: asyncio.Future
    arrived: float  # submit() called: before the slot wait
    enqueued: float = field(default_factory=time.monotonic)
    cancelled: bool = False


class Batcher:
    """`await submit(modality, item, timeout_s)` → that item's output from a batched forward."""

    def __init__(self, service: str, runners: dict[str, RunBatch], limits: dict[str, int]) -> None:
        self.service = service
        self.runners = runners
        self.limiters = {m: ConcurrencyLimiter(f"{service} {m}", limits[m]) for m in runners}
        self.batches = dict.fromkeys(runners, 0)
        self.largest_batch = dict.fromkeys(runners, 0)
        self.on_queued: Callable[[float], None] | None = None  # metrics: set after the warm-up
        self._queues: dict[str, deque[_Entry]] = {m: deque() for m in runners}
        self._cv = threading.Condition()
        self._stopped = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name=f"{service}-batcher", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the forward in progress, fail what is still queued, join the device thread."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout_s)

    @property
    def queued(self) -> int:
        with self._cv:
            return sum(len(q) for q in self._queues.values())

    async def submit(self, modality: str, item: Any, timeout_s: float) -> Any:
        """Queue `item` once a slot is free (waits at most `timeout_s`: TimeoutError) and await its output."""
        assert self._loop is not None, "start() first"
        arrived = time.monotonic()
        async with self.limiters[modality].slot(timeout_s):
            entry = _Entry(item, self._loop.create_future(), arrived)
            with self._cv:
                if self._stopped:
                    raise RuntimeError(f"{self.service}: batcher stopped")
                self._queues[modality].append(entry)
                self._cv.notify()
            try:
                return await asyncio.shield(entry.future)
            except asyncio.CancelledError:
                entry.cancelled = True  # skipped if its forward has not started
                with contextlib.suppress(BaseException):
                    await entry.future  # keep the slot until the device is done with the item
                raise

    # -- device thread -----------------------------------------------------------------------

    def _next_batch(self) -> tuple[str, list[_Entry]] | None:
        with self._cv:
            while not self._stopped and not any(self._queues.values()):
                self._cv.wait()
            if self._stopped:
                return None
            modality = min((m for m, q in self._queues.items() if q), key=lambda m: self._queues[m][0].enqueued)
            queue, cap = self._queues[modality], self.limiters[modality].limit
            entries = [queue.popleft() for _ in range(min(len(queue), cap))]
        return modality, entries

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            modality, entries = batch
            live = [e for e in entries if not e.cancelled]
            outputs: Sequence[Any] | BaseException = []
            if live:
                self._report_waits(live)
                try:
                    outputs = self.runners[modality]([e.item for e in live])
                    self._count(modality, len(live))
                except BaseException as exc:  # noqa: BLE001 - handed to every waiting request
                    log.exception("%s forward of %d items failed", modality, len(live))
                    outputs = exc
            for i, e in enumerate(live):
                self._resolve(e, outputs if isinstance(outputs, BaseException) else outputs[i])
            for e in entries:
                if e.cancelled and e not in live:
                    self._resolve(e, asyncio.CancelledError())
        self._fail_queued()

    def _report_waits(self, entries: Sequence[_Entry]) -> None:
        if self.on_queued is not None:
            now = time.monotonic()
            for e in entries:
                self.on_queued(now - e.arrived)

    def _count(self, modality: str, n: int) -> None:
        self.batches[modality] += 1
        self.largest_batch[modality] = max(self.largest_batch[modality], n)
        batches_counter().labels(self.service, modality).inc()
        batched_items_counter().labels(self.service, modality).inc(n)
        batch_size_histogram().labels(self.service, modality).observe(n)

    def _resolve(self, entry: _Entry, value: Any) -> None:
        def settle() -> None:
            if entry.future.done():
                return
            if isinstance(value, asyncio.CancelledError):
                entry.future.cancel()
            elif isinstance(value, BaseException):
                entry.future.set_exception(value)
            else:
                entry.future.set_result(value)

        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self._loop.call_soon_threadsafe(settle)

    def _fail_queued(self) -> None:
        with self._cv:
            entries = [e for q in self._queues.values() for e in q]
            for q in self._queues.values():
                q.clear()
        for e in entries:
            self._resolve(e, RuntimeError(f"{self.service}: batcher stopped"))
