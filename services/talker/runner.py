"""The talker's device step: `SegmentRunner` picks the segments that share each step, `TalkerRunner`
runs the step's model calls for them (the only model-calling code of the stage; the start-up stress
runs the same methods). The stage's `DeviceLoop` thread calls `SegmentRunner.step`."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from omnistage.common.log import get_logger
from omnistage.common.runtime.device_loop import DeviceRunner
from omnistage.services.talker.models.audio_vae import DecodeStream
from omnistage.services.talker.models.dit import sway_times
from omnistage.services.talker.models.loader import TalkerModels
from omnistage.services.talker.models.prompt import PromptIds
from omnistage.services.talker.models.qwen2 import KVSlots, Rows
from omnistage.services.talker.pacing import StreamPace
from omnistage.services.talker.step_graphs import StepGraphs
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
    pace: StreamPace | None = None  # the stream's real-time pace (None: as fast as the device goes)
    cancelled: bool = False
    queued: float = 0.0  # monotonic time of submit()
    # device-thread state
    slot: int = -1
    position: int = 0  # LM cache positions filled
    steps: int = 0
    history: torch.Tensor | None = None
    next_input: torch.Tensor | None = None
    stream: DecodeStream | None = field(default=None, repr=False)


class TalkerRunner:
    def __init__(
        self,
        models: TalkerModels,
        slots: int,
        max_lm_tokens: int,
        max_vae_frames: int,
        *,
        temperature: float = 0.0,
        sigma: float = 0.25,
        graphs: bool = False,
        capture: bool | None = None,
    ) -> None:
        self.models = models
        self.config = models.config
        self.device, self.dtype = models.device, models.dtype
        self.slots = slots
        self.lm_cache = KVSlots(models.config.llm, slots, max_lm_tokens, dtype=self.dtype, device=self.device)
        self.vae_cache = models.vae.decoder.new_cache(
            slots, max_vae_frames, dtype=self.dtype, device=self.device
        )
        self.times = sway_times(models.config.steps)  # host tensor: step sizes are read without a device sync
        self.sde_scale = sigma * temperature**0.5
        cfg = self.config
        # Time embeddings, step sizes and rotary tables of every CFM sample, made once.
        self.plan = models.talker.dit.plan(self.times, cfg.history_patch_size, cfg.patch_size, self.device)
        self.static: StepGraphs | None = None
        if graphs:
            self.static = StepGraphs(
                models.talker,
                self.lm_cache,
                self.plan,
                cap=slots,
                history_len=cfg.history_patch_size,
                patch=cfg.patch_size,
                latent_dim=cfg.latent_dim,
                cfg_strength=cfg.cfg_strength,
                sde_scale=self.sde_scale,
                capture=torch.device(self.device).type == "cuda" if capture is None else capture,
                vae=(models.vae.decoder.decoder, self.vae_cache, cfg.patch_size * cfg.vae.patch_size),
            )

    @property
    def cache_bytes(self) -> int:
        return self.lm_cache.nbytes + self.vae_cache.nbytes

    # -- LM ------------------------------------------------------------------------------------

    def prompt_embeddings(self, prompt: PromptIds, voice: Voice) -> torch.Tensor:
        """[L, hidden]: token embeddings with the speaker vector and the voice prompt's patches spliced in."""
        ids = torch.tensor(prompt.ids, dtype=torch.long).to(self.device, non_blocking=True)
        x = self.models.talker.embed(ids)
        x[prompt.speaker_position] = voice.speaker.to(x.dtype)
        a = prompt.audio_position
        x[a : a + prompt.prompt_patches] = voice.embeddings.to(x.dtype)
        return x

    @torch.no_grad()
    def prefill(self, slot: int, embeddings: torch.Tensor) -> torch.Tensor:
        """Whole prompt of one request into its slot → the last hidden state [hidden]."""
        rows = Rows.of([slot], [0], [embeddings.shape[0]], self.device)
        return self.models.talker.model(embeddings[None], self.lm_cache, rows)[0, -1]

    @torch.no_grad()
    def prefill_batch(self, slots: list[int], embeddings: list[torch.Tensor]) -> torch.Tensor:
        """Several whole prompts in one forward (right-padded; padding goes to the scratch slot) → each
        prompt's last hidden state [n, hidden]."""
        lengths = [e.shape[0] for e in embeddings]
        if len(embeddings) == 1:
            return self.prefill(slots[0], embeddings[0])[None]
        x = torch.nn.utils.rnn.pad_sequence(embeddings, batch_first=True)
        rows = Rows.of(slots, [0] * len(slots), lengths, self.device)
        out = self.models.talker.model(x, self.lm_cache, rows)
        return out[torch.arange(len(slots), device=out.device), torch.tensor(lengths, device=out.device) - 1]

    @torch.no_grad()
    def decode(self, slots: list[int], positions: list[int], inputs: torch.Tensor) -> torch.Tensor:
        """One new input per row [B, hidden] at `positions` → hidden states [B, hidden]."""
        if self.static is not None:
            return self.static.decode(slots, positions, inputs)
        rows = Rows.of(slots, positions, [1] * len(slots), self.device)
        return self.models.talker.model(inputs[:, None], self.lm_cache, rows)[:, 0]

    # -- CFM, aggregator, stop head --------------------------------------------------------------

    @torch.no_grad()
    def sample(
        self, hidden: torch.Tensor, history: torch.Tensor, generators: list[torch.Generator]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows' hidden [B, hidden] + history [B, H, C] → (patch [B, P, C] float32, next LM inputs [B, hidden],
        stop probability [B]). Each row's noise comes from its own generator (batched == alone)."""
        cfg = self.config
        shape = (cfg.patch_size, cfg.latent_dim)
        noise = torch.stack([torch.randn(shape, generator=g, device=self.device) for g in generators])
        sde = None
        if self.sde_scale:
            sde = torch.stack(
                [torch.randn((cfg.steps, *shape), generator=g, device=self.device) for g in generators], dim=1
            )
        if self.static is not None:
            return self.static.sample(hidden, history, noise, sde)
        talker = self.models.talker
        patch = talker.dit.sample_planned(
            self.plan, hidden, history, noise, cfg.cfg_strength, sde, self.sde_scale
        )
        return patch, talker.aggregator(patch), talker.stop_probability(hidden)

    # -- VAE -------------------------------------------------------------------------------------

    def vae(
        self, streams: list[DecodeStream], latents: list[torch.Tensor], last: list[bool]
    ) -> list[torch.Tensor]:
        backbone = self.static.vae_backbone if self.static is not None else None
        return self.models.vae.decoder.decode_step(streams, latents, last, self.vae_cache, backbone)


class SegmentRunner(DeviceRunner):
    """The segments in flight: admission to cache slots, one batched step for all of them."""

    def __init__(self, model: TalkerRunner, clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.clock = clock  # paced jobs' clock
        self.on_admit: Callable[[float], None] | None = None  # (seconds a job waited for its first step)
        self._lock = threading.Lock()
        self._pending: deque[SegmentJob] = deque()
        self._active: list[SegmentJob] = []
        self._free = list(range(model.slots - 1, -1, -1))

    def put(self, job: SegmentJob) -> None:
        """Queue a job (through `DeviceLoop.admit`, which refuses once the loop has stopped)."""
        with self._lock:
            job.queued = time.monotonic()
            self._pending.append(job)

    @property
    def jobs_in_flight(self) -> int:
        with self._lock:
            return len(self._active) + len(self._pending)

    @property
    def jobs_queued(self) -> int:
        with self._lock:
            return len(self._pending)

    # -- device thread ---------------------------------------------------------------------------

    def has_work(self) -> bool:
        now = self.clock()
        with self._lock:
            return bool(self._pending) or any(j.pace is None or j.pace.due(now) for j in self._active)

    def wake_in(self) -> float | None:
        now = self.clock()
        with self._lock:
            waits = [j.pace.due_in(now) for j in self._active if j.pace is not None and not j.cancelled]
        return min(waits) if waits else None

    def step(self) -> int:
        """One talker step for the active jobs that are due (a paced stream ahead of its listener
        waits), new ones always; returns how many it stepped (0: none, or it failed)."""
        new = self._admit()
        now = self.clock()
        with self._lock:
            due = [j for j in self._active if j in new or j.pace is None or j.pace.due(now)]
            # paced jobs nearly due share the step rather than each taking one of their own
            batch = [j for j in self._active if j in due or (due and j.pace.may_join(now))]
        if not batch:
            return 0
        try:
            outputs = self._forward(batch, new)
        except BaseException as exc:  # noqa: BLE001 - one failed step fails its jobs, not the loop
            log.exception("talker step of %d segments failed", len(batch))
            with self._lock:
                for job in batch:
                    self._release(job)
            for job in batch:
                job.emit(JobFailed(exc))
            return 0
        now = self.clock()
        for job, (audio, done) in zip(batch, outputs, strict=True):
            if job.cancelled:
                continue
            if job.pace is not None:
                job.pace.advance(audio.size, now)
            job.emit(JobAudio(audio))
            if done is not None:
                with self._lock:
                    self._release(job)
                job.emit(done)
        return len(batch)

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            jobs = [*self._active, *self._pending]
            for job in list(self._active):
                self._release(job)
            self._pending.clear()
        for job in jobs:
            if not job.cancelled:
                job.emit(JobFailed(error))

    def _admit(self) -> list[SegmentJob]:
        with self._lock:
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

    def _forward(
        self, batch: list[SegmentJob], new: list[SegmentJob]
    ) -> list[tuple[np.ndarray, JobDone | None]]:
        run, cfg = self.model, self.model.config
        hidden: dict[int, torch.Tensor] = {}
        if new:  # every newly admitted prompt in one padded forward
            prompts = [run.prompt_embeddings(job.prompt, job.voice) for job in new]
            for job, x, h in zip(
                new, prompts, run.prefill_batch([j.slot for j in new], prompts), strict=True
            ):
                hidden[id(job)] = h
                job.position = x.shape[0]
        for job in new:
            job.history = torch.zeros(cfg.history_patch_size, cfg.latent_dim, device=run.device)
            prompt = job.voice.latents[-cfg.history_patch_size :]
            job.history[cfg.history_patch_size - prompt.shape[0] :] = prompt
            job.stream = DecodeStream(job.slot)
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
