"""EncoderRunner: the encoder's device step and its model calls — concurrent requests' items share one
forward per modality (vision: frames to patches on the device, then the ViT; audio: the Whisper tower),
as many as the modality's budget takes: items × the largest item's units (audio: mel frames, the clips
padded to the longest; vision: one unit an item)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from omnistage.common import metrics
from omnistage.common.log import get_logger
from omnistage.common.runtime.device_loop import DeviceRunner, call_in_loop
from omnistage.services.encoder import preprocess
from omnistage.services.encoder.items import AudioInput, VisionInput
from omnistage.services.encoder.models.loader import EncoderModels

log = get_logger(__name__)

Forward = Callable[[Sequence[Any]], Sequence[Any]]


def batches_counter():
    return metrics.counter("encoder_batches", "Encoder forwards run, by modality", ("modality",))


def batched_items_counter():
    return metrics.counter(
        "encoder_batched_items", "Items encoded in those forwards, by modality", ("modality",)
    )


def batch_size_histogram():
    return metrics.histogram(
        "encoder_batch_items",
        "Items per encoder forward, by modality",
        ("modality",),
        buckets=(1, 2, 4, 8, 16, 32, 64),
    )


def forward_time_histogram():
    return metrics.histogram(
        "encoder_forward_seconds",
        "Time of one encoder forward, its device work included, by modality",
        ("modality",),
    )


def queue_time_histogram():
    return metrics.histogram(
        "encoder_queue_time_seconds",
        "Time an item waited in the encoder: its arrival "
        "in the batcher (slot wait included) to the start of the forward that encodes it",
    )


def vision_forward(models: EncoderModels, frames: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One forward over vision items given as uint8 frames: to the device, normalise + patchify there."""
    device = models.vision.vision.pos_embed.weight.device
    patches, grids = [], []
    for f in frames:
        p, g = preprocess.pixel_patches(f.to(device, non_blocking=True), models.config.vision)
        patches.append(p)
        grids.append(g)
    return models.vision.encode_items(patches, grids)


@dataclass(eq=False)
class Entry:
    """One item waiting for its forward; `future` (on the request's event loop) gets its output."""

    item: Any
    future: asyncio.Future
    arrived: float  # the request asked for a slot: before the slot wait
    units: int = 1  # its share of its modality's budget (the slot it holds)
    enqueued: float = field(default_factory=time.monotonic)
    cancelled: bool = False


class EncoderRunner(DeviceRunner):
    """Per-modality queues and the batched forward of one modality per step; `budgets` in units (what
    the start-up stress proved: its cap × the largest item's units)."""

    def __init__(self, service: str, models: EncoderModels, budgets: dict[str, int]) -> None:
        self.service = service
        self.models = models
        self.forwards: dict[str, Forward] = {"vision": self.run_vision, "audio": self.run_audio}
        self.budgets = {m: budgets[m] for m in self.forwards}
        self.batches = dict.fromkeys(self.forwards, 0)
        self.largest_batch = dict.fromkeys(self.forwards, 0)
        self.on_queued: Callable[[float], None] | None = None  # metrics: set after the warm-up
        self._queues: dict[str, deque[Entry]] = {m: deque() for m in self.forwards}
        self._lock = threading.Lock()

    def put(self, modality: str, entry: Entry) -> None:
        """Queue an item (through `DeviceLoop.admit`, which refuses once the loop has stopped)."""
        with self._lock:
            self._queues[modality].append(entry)

    @property
    def queued(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    # -- device thread -----------------------------------------------------------------------

    def run_vision(self, inputs: Sequence[VisionInput]) -> list[torch.Tensor]:
        return vision_forward(self.models, [x.frames for x in inputs])

    def run_audio(self, inputs: Sequence[AudioInput]) -> list[torch.Tensor]:
        return self.models.audio.encode_items([x.mel for x in inputs])

    def has_work(self) -> bool:
        with self._lock:
            return any(self._queues.values())

    def step(self) -> int:
        batch = self._next_batch()
        if batch is None:
            return 0
        modality, entries = batch
        live = [e for e in entries if not e.cancelled]
        outputs: Sequence[Any] | BaseException = []
        if live:
            self._report_waits(live)
            try:
                started = time.monotonic()
                outputs = self.forwards[modality]([e.item for e in live])
                _wait_device(outputs)
                forward_time_histogram().labels(self.service, modality).observe(time.monotonic() - started)
                self._count(modality, len(live))
            except BaseException as exc:  # noqa: BLE001 - handed to every waiting request
                log.exception("%s forward of %d items failed", modality, len(live))
                outputs = exc
        for i, e in enumerate(live):
            _settle(e, outputs if isinstance(outputs, BaseException) else outputs[i])
        for e in entries:
            if e.cancelled and e not in live:
                _settle(e, asyncio.CancelledError())
        return len(live) if not isinstance(outputs, BaseException) else 0

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            entries = [e for q in self._queues.values() for e in q]
            for q in self._queues.values():
                q.clear()
        for e in entries:
            _settle(e, error)

    def _next_batch(self) -> tuple[str, list[Entry]] | None:
        with self._lock:
            if not any(self._queues.values()):
                return None
            modality = min(
                (m for m, q in self._queues.items() if q), key=lambda m: self._queues[m][0].enqueued
            )
            return modality, take_batch(self._queues[modality], self.budgets[modality])

    def _report_waits(self, entries: Sequence[Entry]) -> None:
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


def _wait_device(outputs: Sequence[Any]) -> None:
    """Outputs on a GPU are complete before their items hear of them: the hand-over copies them on a
    stream of its own (request_flow.py), which does not wait for the forward this thread launches next."""
    first = outputs[0] if outputs else None
    if isinstance(first, torch.Tensor) and first.is_cuda:
        torch.cuda.current_stream(first.device).synchronize()


def take_batch(queue: deque[Entry], budget: int) -> list[Entry]:
    """The queue's oldest items while items × the largest one's units stay within `budget` (padding:
    each item of a forward costs what its largest does); the oldest one always, whatever its size."""
    batch = [queue.popleft()]
    widest = batch[0].units
    while queue and (len(batch) + 1) * max(widest, queue[0].units) <= budget:
        widest = max(widest, queue[0].units)
        batch.append(queue.popleft())
    return batch


def _settle(entry: Entry, value: Any) -> None:
    """Hand an item's output (or error, or cancellation) to its request's event loop."""

    def settle() -> None:
        if entry.future.done():
            return
        if isinstance(value, asyncio.CancelledError):
            entry.future.cancel()
        elif isinstance(value, BaseException):
            entry.future.set_exception(value)
        else:
            entry.future.set_result(value)

    call_in_loop(entry.future.get_loop(), settle)
