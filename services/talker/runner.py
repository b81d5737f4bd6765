"""SegmentRunner: the talker's device step. The scheduler picks the segments a step takes; the model
runner runs them (new ones prefilled together, the rest one LM decode, then one CFM sample and one
VAE step for all). The stage's `DeviceLoop` thread calls `step`."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from omnistage.common.log import get_logger
from omnistage.common.runtime.device_loop import DeviceRunner
from omnistage.services.talker.model_runner import TalkerRunner
from omnistage.services.talker.models.audio_vae import DecodeStream
from omnistage.services.talker.scheduler import JobAudio, JobDone, JobFailed, SegmentJob, StreamScheduler

log = get_logger(__name__)


class SegmentRunner(DeviceRunner):
    """The segments in flight: a slot of the caches each, one batched step for the due ones."""

    def __init__(self, model: TalkerRunner, clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.scheduler = StreamScheduler(model.slots, model.step_batch, clock)
        self.on_admit: Callable[[float], None] | None = None  # (seconds a job waited for its first step)

    def put(self, job: SegmentJob) -> None:
        """Queue a job (through `DeviceLoop.admit`, which refuses once the loop has stopped)."""
        self.scheduler.put(job)

    @property
    def jobs_in_flight(self) -> int:
        return self.scheduler.jobs_in_flight

    @property
    def jobs_queued(self) -> int:
        return self.scheduler.jobs_queued

    # -- device thread ---------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def wake_in(self) -> float | None:
        return self.scheduler.wake_in()

    def step(self) -> int:
        """One talker step for the due segments, earliest deadline first (a paced stream ahead of its
        listener waits); returns how many it stepped (0: none, or it failed)."""
        pick = self.scheduler.pick()
        if self.on_admit is not None:
            for job in pick.new:
                self.on_admit(max(self.scheduler.clock() - job.queued, 0.0))
        if not pick.batch:
            return 0
        try:
            outputs = self._forward(pick.batch, pick.new)
        except BaseException as exc:  # noqa: BLE001 - one failed step fails its jobs, not the loop
            log.exception("talker step of %d segments failed", len(pick.batch))
            for job in pick.batch:
                self.scheduler.release(job)
            for job in pick.batch:
                job.emit(JobFailed(exc))
            return 0
        now = self.scheduler.clock()
        for job, (audio, done) in zip(pick.batch, outputs, strict=True):
            if job.cancelled:
                continue
            if job.pace is not None:
                job.pace.advance(audio.size, now)
            job.emit(JobAudio(audio))
            if done is not None:
                self.scheduler.release(job)
                job.emit(done)
        return len(pick.batch)

    def fail_all(self, error: BaseException) -> None:
        for job in self.scheduler.release_all():
            if not job.cancelled:
                job.emit(JobFailed(error))

    def _prefill(self, new: list[SegmentJob]) -> dict[int, torch.Tensor]:
        """Every new prompt in one padded forward → each one's last hidden state; their step state set."""
        run, cfg = self.model, self.model.config
        prompts = [run.prompt_embeddings(job.prompt, job.voice) for job in new]
        hidden = {}
        for job, x, h in zip(new, prompts, run.prefill_batch([j.slot for j in new], prompts), strict=True):
            hidden[id(job)] = h
            job.position = x.shape[0]
            job.history = torch.zeros(cfg.history_patch_size, cfg.latent_dim, device=run.device)
            voiced = job.voice.latents[-cfg.history_patch_size :]
            job.history[cfg.history_patch_size - voiced.shape[0] :] = voiced
            job.stream = DecodeStream(job.slot)
        return hidden

    def _forward(
        self, batch: list[SegmentJob], new: list[SegmentJob]
    ) -> list[tuple[np.ndarray, JobDone | None]]:
        run, cfg = self.model, self.model.config
        hidden = self._prefill(new) if new else {}
        going = [j for j in batch if id(j) not in hidden]
        if going:
            out = run.decode(
                [j.slot for j in going],
                [j.position for j in going],
                torch.stack([j.next_input for j in going]),
            )
            for j, h in zip(going, out, strict=True):
                hidden[id(j)] = h
                j.position += 1
        h = torch.stack([hidden[id(j)] for j in batch])
        patches, next_inputs, stop = run.sample(
            h, torch.stack([j.history for j in batch]), [j.generator for j in batch]
        )
        stop = stop.tolist()  # host sync 1 of 2: which rows end decides the VAE's flush
        ends: list[JobDone | None] = []
        for i, job in enumerate(batch):
            job.next_input = next_inputs[i]
            job.history = torch.cat((job.history[cfg.patch_size :], patches[i]))
            stopped = job.steps > job.min_steps and stop[i] > 0.5
            job.steps += 1
            ends.append(JobDone(job.steps, stopped) if stopped or job.steps >= job.max_steps else None)
        audio = run.vae([j.stream for j in batch], list(patches), [e is not None for e in ends])
        # Host sync 2 of 2: one device→host copy for the whole batch (each row's length is known on the host).
        flat = torch.cat([a.float().reshape(-1) for a in audio]).cpu().numpy()
        pieces = np.split(flat, np.cumsum([a.numel() for a in audio])[:-1])
        return list(zip(pieces, ends, strict=True))
