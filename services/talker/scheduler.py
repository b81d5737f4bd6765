"""Which segments a talker step takes. Every stream speaking holds one slot of the caches (its LM, CFM
and VAE state) for as long as it speaks; a step advances at most `step_batch` of them: the due ones,
earliest deadline first (ARCHITECTURE §7b). A paced stream is due when its audio runs out within its
lead, so a slot is cheap and streams are bounded by memory, not by the step."""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from omnistage.services.talker.models.audio_vae import DecodeStream
from omnistage.services.talker.models.prompt import PromptIds
from omnistage.services.talker.pacing import StreamPace
from omnistage.services.talker.voice_prompt import Voice


@dataclass(frozen=True)
class JobAudio:
    samples: np.ndarray  # float32 mono at the VAE rate; may be empty


@dataclass(frozen=True)
class JobDone:
    steps: int
    stopped_by_model: bool


@dataclass(frozen=True)
class JobFailed:
    error: BaseException


JobEvent = JobAudio | JobDone | JobFailed


@dataclass(eq=False)
class SegmentJob:
    """One segment to speak. `emit` runs on the device thread and must not block."""

    prompt: PromptIds
    voice: Voice
    max_steps: int
    generator: torch.Generator
    emit: Callable[[JobEvent], None]
    min_steps: int = 10
    pace: StreamPace | None = None  # the stream's real-time pace (None: as fast as the device goes)
    cancelled: bool = False
    queued: float = 0.0  # the scheduler's clock at put()
    last_step: float = 0.0  # the scheduler's clock at its last step
    turn: int = 0  # the order it was last stepped in (ties of `last_step` go to the longer wait)
    # device-thread state
    slot: int = -1
    position: int = 0  # LM cache positions filled
    steps: int = 0
    history: torch.Tensor | None = None
    next_input: torch.Tensor | None = None
    stream: DecodeStream | None = field(default=None, repr=False)

    @property
    def prefilled(self) -> bool:
        return self.history is not None


def deadline(job: SegmentJob, now: float) -> float:
    """When the job must be stepped: a paced stream that has spoken, when its listener runs out of
    audio; a stream's first audio, when it was asked for; an unpaced one, when it was last stepped
    (round robin). Earlier is more urgent."""
    if job.pace is not None and job.pace.origin is not None:
        return job.pace.runs_out_at()
    if job.steps == 0:
        return job.queued
    return job.last_step


def urgency(job: SegmentJob, now: float) -> tuple[float, int]:
    return deadline(job, now), job.turn


def due(job: SegmentJob, now: float) -> bool:
    return job.pace is None or job.pace.due(now)


@dataclass(frozen=True)
class StepPick:
    """What one step runs: `batch` (every job stepped), of which `new` are prefilled in it."""

    new: list[SegmentJob]
    batch: list[SegmentJob]


class StreamScheduler:
    """Slots, the jobs waiting for one, and the earliest-deadline-first pick of each step. Thread-safe:
    `put` from any thread, everything else from the device thread."""

    def __init__(self, slots: int, step_batch: int, clock: Callable[[], float]) -> None:
        if slots < 1 or step_batch < 1:
            raise ValueError(f"talker scheduler: slots {slots} and step_batch {step_batch} must be >= 1")
        self.slots = slots
        self.step_batch = min(step_batch, slots)
        self.clock = clock
        self._lock = threading.Lock()
        self._pending: deque[SegmentJob] = deque()
        self._active: list[SegmentJob] = []
        self._free = list(range(slots - 1, -1, -1))
        self._turns = itertools.count(1)

    def put(self, job: SegmentJob) -> None:
        with self._lock:
            job.queued = self.clock()
            self._pending.append(job)

    @property
    def jobs_in_flight(self) -> int:
        with self._lock:
            return len(self._active) + len(self._pending)

    @property
    def jobs_queued(self) -> int:
        """Jobs waiting for a slot (none while streams stay within the slots)."""
        with self._lock:
            return len(self._pending)

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def has_work(self) -> bool:
        now = self.clock()
        with self._lock:
            if self._pending and self._free:
                return True
            return any(not j.cancelled and due(j, now) for j in self._active) or any(
                j.cancelled for j in self._active
            )

    def wake_in(self) -> float | None:
        now = self.clock()
        with self._lock:
            waits = [j.pace.due_in(now) for j in self._active if j.pace is not None and not j.cancelled]
        return min(waits) if waits else None

    def pick(self) -> StepPick:
        """Free the cancelled, give waiting jobs their slots, then take the due jobs by deadline (at
        most `step_batch`), and fill what room is left with paced jobs nearly due."""
        now = self.clock()
        with self._lock:
            for job in [j for j in self._active if j.cancelled]:
                self._release_locked(job)
            while self._pending and self._free:
                job = self._pending.popleft()
                if job.cancelled:
                    continue
                job.slot = self._free.pop()
                self._active.append(job)
            ready = sorted((j for j in self._active if due(j, now)), key=lambda j: urgency(j, now))
            batch = ready[: self.step_batch]
            if batch and len(batch) < self.step_batch:
                taken = set(map(id, batch))
                joining = sorted(
                    (
                        j
                        for j in self._active
                        if id(j) not in taken and j.prefilled and j.pace is not None and j.pace.may_join(now)
                    ),
                    key=lambda j: urgency(j, now),
                )
                batch += joining[: self.step_batch - len(batch)]
        for job in batch:
            job.last_step, job.turn = now, next(self._turns)
        return StepPick([j for j in batch if not j.prefilled], batch)

    def release(self, job: SegmentJob) -> None:
        with self._lock:
            self._release_locked(job)

    def release_all(self) -> list[SegmentJob]:
        """Every job held, freed (the loop is failing them); returns them."""
        with self._lock:
            jobs = [*self._active, *self._pending]
            for job in list(self._active):
                self._release_locked(job)
            self._pending.clear()
        return jobs

    def _release_locked(self, job: SegmentJob) -> None:
        if job in self._active:
            self._active.remove(job)
            self._free.append(job.slot)
        job.history = job.next_input = job.stream = None
