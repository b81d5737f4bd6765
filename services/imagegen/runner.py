"""ImageGenRunner: the image stage's device step — every admitted request's denoising, step by step."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from omnistage.common.log import get_logger
from omnistage.common.runtime.device_loop import DeviceRunner
from omnistage.services.imagegen.pipeline import DenoiseState, GenerationSpec, ImagePipeline

log = get_logger(__name__)


@dataclass(frozen=True)
class Progress:
    step: int  # denoising steps done (1..total)
    total: int


@dataclass(frozen=True)
class Finished:
    pixels: torch.Tensor  # uint8 [bucket h, bucket w, 3], CPU


@dataclass(frozen=True)
class Failed:
    error: BaseException


Event = Progress | Finished | Failed
_order = itertools.count()


@dataclass(eq=False)
class Job:
    spec: GenerationSpec
    on_event: Callable[[Event], None]  # called on the device thread; must not block
    on_release: Callable[[], None]
    cancelled: bool = False
    state: DenoiseState | None = None
    created: float = field(default_factory=time.monotonic)  # the request's arrival: its queue time starts
    turn: int = field(default_factory=lambda: next(_order))  # lower: waited longer for a step

    def cancel(self) -> None:
        """The client left: the thread drops the job at the next step boundary."""
        self.cancelled = True


class ImageGenRunner(DeviceRunner):
    """`put(job)` (through `DeviceLoop.admit`); the loop's thread calls `step()`; counters for Describe."""

    def __init__(
        self,
        pipeline: ImagePipeline,
        *,
        name: str = "imagegen",
        on_forward: Callable[[int, int], None] | None = None,
        on_admit: Callable[[float], None] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.name = name
        self.on_forward = on_forward
        self.on_admit = on_admit
        self.dropped = 0
        self._inbox: list[Job] = []
        self._active: list[Job] = []
        self._lock = threading.Lock()

    def put(self, job: Job) -> None:
        with self._lock:
            self._inbox.append(job)

    @property
    def held(self) -> int:
        """Jobs the device thread holds (in the loop or about to be prepared)."""
        with self._lock:
            return len(self._inbox) + len(self._active)

    # -- device thread -----------------------------------------------------------------------

    def open(self) -> None:
        device = self.pipeline.device
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._active)

    @torch.inference_mode()
    def step(self) -> int:
        """Prepare new jobs, drop cancelled ones, one forward for the group that waited longest.
        Returns the requests that forward moved (0: none)."""
        self._admit()
        self._drop_cancelled()
        group = self._next_group()
        return self._step(group) if group else 0

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            left = self._inbox + self._active
            self._inbox, self._active = [], []
        for job in left:
            self._finish(job, Failed(error))

    def _admit(self) -> None:
        with self._lock:
            new, self._inbox = self._inbox, []
        for job in new:
            if job.cancelled:
                self._drop(job)
                continue
            if self.on_admit is not None:
                self.on_admit(time.monotonic() - job.created)
            try:
                job.state = self.pipeline.prepare(job.spec)
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                log.exception("%s: preparing a request failed", self.name)
                self._finish(job, Failed(exc))
                continue
            with self._lock:
                self._active.append(job)

    def _drop_cancelled(self) -> None:
        with self._lock:
            gone = [j for j in self._active if j.cancelled]
            self._active = [j for j in self._active if not j.cancelled]
        for job in gone:
            self._drop(job)

    def _next_group(self) -> list[Job]:
        with self._lock:
            if not self._active:
                return []
            first = min(self._active, key=lambda j: j.turn)
            key = first.state.shape_key  # type: ignore[union-attr]
            return [j for j in self._active if j.state.shape_key == key]  # type: ignore[union-attr]

    def _step(self, group: list[Job]) -> int:
        states = [j.state for j in group]
        try:
            moved, rows = self.pipeline.step(states)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - every request of this forward fails, the thread goes on
            log.exception("%s: a denoising step of %d requests failed", self.name, len(group))
            for job in group:
                self._remove(job)
                self._finish(job, Failed(exc))
            return 0
        if moved and self.on_forward is not None:
            self.on_forward(moved, rows)
        for job in group:
            job.turn = next(_order)
            state = job.state
            assert state is not None
            job.on_event(Progress(state.step, state.schedule.steps))
            if state.done:
                self._remove(job)
                self._decode(job)
        return moved

    def _decode(self, job: Job) -> None:
        try:
            pixels = self.pipeline.decode(job.state)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001
            log.exception("%s: decoding an image failed", self.name)
            self._finish(job, Failed(exc))
            return
        self._finish(job, Finished(pixels))

    def _remove(self, job: Job) -> None:
        with self._lock:
            if job in self._active:
                self._active.remove(job)

    def _drop(self, job: Job) -> None:
        self.dropped += 1
        job.state = None
        job.on_release()

    def _finish(self, job: Job, event: Event) -> None:
        job.state = None
        try:
            job.on_event(event)
        finally:
            job.on_release()
