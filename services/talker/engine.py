"""TalkerEngine: one device thread runs talker steps for every segment being spoken, batched.

A `SegmentJob` is one text segment of one stream (ming.md §5.3): prefill its prompt, then one patch
per step until the stop head fires (after `min_steps`) or its step budget is spent; every step's
latents are decoded to audio at once (streaming VAE) and handed to the job's `emit` callback on the
device thread. All jobs in flight share each step: one LM prefill of the newly admitted prompts
(right-padded, together), one LM decode of the others,
one CFM sample, one aggregator and stop-head forward, one VAE forward. A job holds one cache slot
from admission to its last chunk; a cancelled job is dropped at the next step boundary, its slot
free again. Work that needs the device between steps (a custom voice's VAE encode) goes through
`call`. A failing step fails the jobs in it, never the engine. `on_admit(seconds)` hears, once per
job, how long it waited from `submit` to the step that first runs it (a job cancelled before that
is never reported).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from omnistage.common.log import get_logger
from omnistage.services.talker.models.audio_vae import DecodeStream
from omnistage.services.talker.models.prompt import PromptIds
from omnistage.services.talker.runner import TalkerRunner
from omnistage.services.talker.voice_prompt import Voice

log = get_logger(__name__)


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
    cancelled: bool = False
    queued: float = 0.0  # monotonic time of submit()
    # device-thread state
    slot: int = -1
    position: int = 0  # LM cache positions filled
    steps: int = 0
    history: torch.Tensor | None = None
    next_input: torch.Tensor | None = None
    stream: DecodeStream | None = field(default=None, repr=False)


class TalkerEngine:
    def __init__(self, runner: TalkerRunner, *, service: str = "talker", idle_wait_s: float = 0.5,
                 on_step: Callable[[int, float], None] | None = None,
                 on_admit: Callable[[float], None] | None = None) -> None:
        self.runner = runner
        self.on_step = on_step  # (segments in the step, seconds) after every step: metrics
        self.on_admit = on_admit  # (seconds a job waited for its first step) once per job: metrics
        self.service = service
        self.idle_wait_s = idle_wait_s
        self._cv = threading.Condition()
        self._pending: deque[SegmentJob] = deque()
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._active: list[SegmentJob] = []
        self._free = list(range(runner.slots - 1, -1, -1))
        self._stopped = False
        self.steps = 0
        self.largest_batch = 0
        self._thread = threading.Thread(target=self._run, name=f"{service}-engine", daemon=True)

    # -- life cycle and API (any thread) -----------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the step in progress, fail what is left, join the device thread."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout_s)

    @property
    def jobs_in_flight(self) -> int:
        with self._cv:
            return len(self._active) + len(self._pending)

    @property
    def jobs_queued(self) -> int:
        with self._cv:
            return len(self._pending)

    def submit(self, job: SegmentJob) -> None:
        with self._cv:
            if self._stopped:
                raise RuntimeError(f"{self.service}: engine stopped")
            job.queued = time.monotonic()
            self._pending.append(job)
            self._cv.notify()

    def cancel(self, job: SegmentJob) -> None:
        """Drop `job` at the next step boundary (its state and slot are freed there; no more events)."""
        with self._cv:
            job.cancelled = True
            self._cv.notify()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the device thread between two steps; its result (or exception) in the future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopped:
                raise RuntimeError(f"{self.service}: engine stopped")
            self._calls.append((fn, fut))
            self._cv.notify()
        return fut

    # -- device thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and not (self._pending or self._calls or self._active):
                    self._cv.wait(self.idle_wait_s)
                if self._stopped:
                    break
                call = self._calls.popleft() if self._calls else None
            if call is not None:
                fn, fut = call
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(exc)
            self.step()
        self._fail_all(RuntimeError(f"{self.service}: engine stopped"))

    def _admit(self) -> list[SegmentJob]:
        with self._cv:
            for job in [j for j in self._active if j.cancelled]:
                self._release(job)
            admitted = []
            while self._pending and self._free:
                job = self._pending.popleft()
                if job.cancelled:
                    continue
                job.slot = self._free.pop()
                self._active.append(job)
                admitted.append(job)
        if self.on_admit is not None and admitted:
            now = time.monotonic()
            for job in admitted:
                self.on_admit(now - job.queued)
        return admitted

    def _release(self, job: SegmentJob) -> None:
        """Caller holds the lock."""
        if job in self._active:
            self._active.remove(job)
            self._free.append(job.slot)
        job.history = job.next_input = job.stream = None

    def step(self) -> None:
        """One talker step for every active job (device thread; tests call it directly)."""
        new = self._admit()
        with self._cv:
            batch = list(self._active)
        if not batch:
            return
        started = time.monotonic()
        try:
            outputs = self._forward(batch, new)
        except BaseException as exc:  # noqa: BLE001 - one failed step fails its jobs, not the engine
            log.exception("talker step of %d segments failed", len(batch))
            with self._cv:
                for job in batch:
                    self._release(job)
            for job in batch:
                job.emit(JobFailed(exc))
            return
        self.steps += 1
        self.largest_batch = max(self.largest_batch, len(batch))
        if self.on_step is not None:
            self.on_step(len(batch), time.monotonic() - started)
        for job, (audio, done) in zip(batch, outputs, strict=True):
            if job.cancelled:
                continue
            job.emit(JobAudio(audio))
            if done is not None:
                with self._cv:
                    self._release(job)
                job.emit(done)

    def _forward(self, batch: list[SegmentJob], new: list[SegmentJob]) -> list[tuple[np.ndarray, JobDone | None]]:
        run, cfg = self.runner, self.runner.config
        hidden: dict[int, torch.Tensor] = {}
        if new:  # every newly admitted prompt in one padded forward
            prompts = [run.prompt_embeddings(job.prompt, job.voice) for job in new]
            for job, x, h in zip(new, prompts, run.prefill_batch([j.slot for j in new], prompts), strict=True):
                hidden[id(job)] = h
                job.position = x.shape[0]
        for job in new:
            job.history = torch.zeros(cfg.history_patch_size, cfg.latent_dim, device=run.device)
            prompt = job.voice.latents[-cfg.history_patch_size:]
            job.history[cfg.history_patch_size - prompt.shape[0]:] = prompt
            job.stream = DecodeStream(job.slot)
        going = [j for j in batch if id(j) not in hidden]
        if going:
            out = run.decode([j.slot for j in going], [j.position for j in going],
                             torch.stack([j.next_input for j in going]))
            for j, h in zip(going, out, strict=True):
                hidden[id(j)] = h
                j.position += 1
        h = torch.stack([hidden[id(j)] for j in batch])
        patches, next_inputs, stop = run.sample(h, torch.stack([j.history for j in batch]),
                                                [j.generator for j in batch])
        stop = stop.tolist()  # host sync 1 of 2: which rows end decides the VAE's flush
        ends: list[JobDone | None] = []
        for i, job in enumerate(batch):
            job.next_input = next_inputs[i]
            job.history = torch.cat((job.history[cfg.patch_size:], patches[i]))
            stopped = job.steps > job.min_steps and stop[i] > 0.5
            job.steps += 1
            ends.append(JobDone(job.steps, stopped) if stopped or job.steps >= job.max_steps else None)
        audio = run.vae([j.stream for j in batch], list(patches), [e is not None for e in ends])
        # Host sync 2 of 2: one device→host copy for the whole batch (each row's length is known on the host).
        flat = torch.cat([a.float().reshape(-1) for a in audio]).cpu().numpy()
        pieces = np.split(flat, np.cumsum([a.numel() for a in audio])[:-1])
        return list(zip(pieces, ends, strict=True))

    def _fail_all(self, exc: BaseException) -> None:
        with self._cv:
            jobs = [*self._active, *self._pending]
            for job in list(self._active):
                self._release(job)
            self._pending.clear()
            calls = list(self._calls)
            self._calls.clear()
        for job in jobs:
            if not job.cancelled:
                job.emit(JobFailed(exc))
        for _, fut in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(exc)
