"""The talker's request flow: `TalkerEngine` holds the device loop and the stream slots (one per stream
speaking, as many as the caches hold); `SpeakSession` turns one Speak stream's text into PCM16 —
voice, segmenting, one engine job per segment."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from omnistage.common.config import TalkerConfig
from omnistage.common.runtime.concurrency import ConcurrencyLimiter
from omnistage.common.runtime.device_loop import DeviceFailed, DeviceLoop
from omnistage.common.runtime.errors import NOTHING_TO_SPEAK, InvalidRequest
from omnistage.services.talker.metrics import SessionMetrics
from omnistage.services.talker.model_runner import TalkerRunner
from omnistage.services.talker.pacing import StreamPace
from omnistage.services.talker.reference_audio import ClipError
from omnistage.services.talker.runner import SegmentRunner
from omnistage.services.talker.scheduler import JobAudio, JobDone, JobEvent, JobFailed, SegmentJob
from omnistage.services.talker.silence import SilenceTrimmer
from omnistage.services.talker.text_segment import Segment, SentenceSegmenter
from omnistage.services.talker.voice_prompt import CUSTOM, Voice
from omnistage.services.talker.voices import VoiceBank, build_voice, prepare_clip

__all__ = ["JobAudio", "JobDone", "JobEvent", "JobFailed", "SegmentJob", "SpeakSession", "TalkerEngine"]
T = TypeVar("T")

# The reference bounds each segment's audio by max(2 s, 5818/16000 s per character of its text).
_SECONDS_PER_CHAR = 5818 / 16000
_MIN_SEGMENT_SECONDS = 2.0
_SEED_STRIDE = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class StreamSettings:
    request_id: str
    voice: str = ""  # preset name ("" = default) unless custom_audio is set
    custom_audio: bytes | None = None
    custom_transcript: str = ""
    seed: int | None = None
    deadline: float = math.inf  # time.monotonic() the caller's deadline comes (inf: none)


@dataclass(frozen=True)
class TextInput:
    text: str = ""
    flush: bool = False
    end_of_text: bool = False


@dataclass(frozen=True)
class Started:
    request_id: str
    sample_rate_hz: int
    voice: str


@dataclass(frozen=True)
class Chunk:
    pcm16: bytes
    segment_index: int
    start_sample: int


@dataclass(frozen=True)
class SegmentSpoken:
    segment_index: int
    text: str
    num_samples: int
    steps: int
    stopped_by_model: bool
    text_end: int = 0  # the stream's characters it and the segments before it cover (0: not known)


@dataclass(frozen=True)
class Finished:
    segments: int
    total_samples: int
    first_audio_s: float


Event = Started | Chunk | SegmentSpoken | Finished
_END = object()


def pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


class SpeakSession:
    """One Speak stream, from its text to PCM16: voice, segmenting, one engine job per segment."""

    def __init__(
        self,
        engine: TalkerEngine,
        voices: VoiceBank,
        cfg: TalkerConfig,
        pool: concurrent.futures.Executor,
        service: str = "talker",
    ) -> None:
        self.engine = engine
        self.voices = voices
        self.models = voices.models
        self.cfg = cfg
        self.pool = pool
        self.service = service
        self.sample_rate = self.models.config.vae.sample_rate
        self._segments: asyncio.Queue = asyncio.Queue()
        self._events: asyncio.Queue = asyncio.Queue()
        self._reader: asyncio.Task | None = None

    # -- voice -----------------------------------------------------------------------------------

    async def resolve_voice(self, settings: StreamSettings, seed: int) -> Voice:
        if settings.custom_audio is None:
            voice = self.voices.preset(settings.voice)
            if voice is None:
                raise InvalidRequest(
                    f"config.voice: unknown voice {settings.voice!r} (have: {', '.join(self.voices.presets)})"
                )
            return voice
        loop = asyncio.get_running_loop()
        try:
            clip = await loop.run_in_executor(
                self.pool,
                prepare_clip,
                settings.custom_audio,
                self.voices.speaker,
                self.sample_rate,
                self.cfg.max_reference_seconds,
            )
        except ClipError as exc:
            raise InvalidRequest(f"config.custom_voice.audio: {exc}") from None
        generator = torch.Generator(self.models.device).manual_seed(seed)
        fut = self.engine.call(
            lambda: build_voice(self.models, CUSTOM, settings.custom_transcript, clip, generator)
        )
        return await asyncio.wrap_future(fut)

    # -- the stream ------------------------------------------------------------------------------

    async def run(self, settings: StreamSettings, inputs: AsyncIterator[TextInput]) -> AsyncIterator[Event]:
        seed = settings.seed if settings.seed is not None else secrets.randbits(63)
        voice = await self.resolve_voice(settings, seed)
        stats = SessionMetrics(self.service, voice.name, self.sample_rate)
        lead = self.cfg.realtime_lead_s
        pace = StreamPace(lead, self.sample_rate) if lead > 0 else None  # one clock for all its segments
        yield Started(settings.request_id, self.sample_rate, voice.name)
        self._reader = asyncio.create_task(self._read(inputs))
        total = index = 0
        first_audio_s = 0.0
        try:
            while (item := await self._segments.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                text, ready_at = item
                async for event in self._speak(index, text, voice, seed, total, ready_at, stats, pace):
                    if isinstance(event, Chunk):
                        if not first_audio_s and index == 0:
                            first_audio_s = time.monotonic() - ready_at
                            stats.ttfa.observe(first_audio_s)
                        total += len(event.pcm16) // 2
                    yield event
                index += 1
            if index == 0:
                raise InvalidRequest(
                    "text: nothing to speak (the stream's text has no letters, digits or CJK characters)",
                    reason=NOTHING_TO_SPEAK,
                )
            yield Finished(index, total, first_audio_s)
        finally:
            self._reader.cancel()

    async def _read(self, inputs: AsyncIterator[TextInput]) -> None:
        """Text in → segments out (with the time each became ready); errors and the end go in order.

        While the first segment waits for more text, its time limit (`first_segment_max_wait_s`) may
        cut it between two messages: the wait for the next message ends at the segmenter's deadline."""
        seg = SentenceSegmenter(self.cfg)
        chars = 0
        messages = aiter(inputs)
        pending: asyncio.Future | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(messages))
                deadline = seg.deadline()
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                done, _ = await asyncio.wait({pending}, timeout=timeout)
                if not done:
                    self._ready(seg.due(time.monotonic()))
                    continue
                try:
                    message = pending.result()
                except StopAsyncIteration:
                    break
                finally:
                    pending = None
                chars += len(message.text)
                if chars > self.cfg.max_text_chars:
                    raise InvalidRequest(
                        f"text: the stream's text exceeds talker.max_text_chars "
                        f"({self.cfg.max_text_chars} characters)"
                    )
                now = time.monotonic()
                ready = seg.push(message.text, now) + seg.due(now)
                if message.flush or message.end_of_text:
                    ready += seg.flush()
                self._ready(ready)
                if message.end_of_text:
                    break
            self._ready(seg.flush())
            self._segments.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the stream, which ends with it
            self._segments.put_nowait(exc)
            self._events.put_nowait(exc)
        finally:
            if pending is not None:
                pending.cancel()

    def _ready(self, texts: list[Segment]) -> None:
        now = time.monotonic()
        for text in texts:
            self._segments.put_nowait((text, now))

    def _max_steps(self, text: str, prompt_len: int) -> int:
        step_s = self.models.config.samples_per_step / self.sample_rate
        seconds = min(max(_MIN_SEGMENT_SECONDS, len(text) * _SECONDS_PER_CHAR), self.cfg.max_segment_seconds)
        return min(max(1, int(seconds / step_s)), self.cfg.max_lm_tokens - prompt_len)

    def _segment_job(
        self, index: int, text: str, voice: Voice, seed: int, pace: StreamPace | None
    ) -> SegmentJob:
        """Segment `index`'s job: its prompt within talker.max_lm_tokens, its own seeded generator, its
        events to this stream's queue (from the device thread)."""
        prompt = self.models.prompt.build(text, voice.prompt_text, voice.patches)
        max_steps = self._max_steps(text, len(prompt.ids))
        if max_steps < 1:
            raise InvalidRequest(
                f"text: segment {index} needs {len(prompt.ids)} prompt tokens, over "
                f"talker.max_lm_tokens ({self.cfg.max_lm_tokens}) with the voice prompt"
            )
        loop, events = asyncio.get_running_loop(), self._events

        def emit(event: object) -> None:  # device thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is closed: nobody listens any more
                pass

        generator = torch.Generator(self.models.device).manual_seed((seed + index * _SEED_STRIDE) % (1 << 63))
        return SegmentJob(prompt, voice, max_steps, generator, emit, min_steps=self.cfg.min_steps, pace=pace)

    async def _speak(
        self,
        index: int,
        text: Segment,
        voice: Voice,
        seed: int,
        start_sample: int,
        ready_at: float,
        stats: SessionMetrics,
        pace: StreamPace | None = None,
    ) -> AsyncIterator[Event]:
        job = self._segment_job(index, text, voice, seed, pace)
        events = self._events
        trimmer = SilenceTrimmer(self.sample_rate) if self.cfg.trim_silence else None
        submitted = time.monotonic()
        self.engine.submit(job)
        produced = sent = 0
        last_chunk_at: float | None = None
        try:
            while True:
                event = await events.get()
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, JobFailed):
                    raise event.error
                if isinstance(event, JobDone):
                    tail = trimmer.push(np.zeros(0, np.float32), last=True) if trimmer else np.zeros(0)
                    if tail.size:
                        yield self._chunk(tail, index, start_sample + sent, ready_at, stats)
                        sent += tail.size
                    audio_s = produced / self.sample_rate
                    if audio_s:
                        stats.rtf.observe((time.monotonic() - submitted) / audio_s)
                    yield SegmentSpoken(index, text, sent, event.steps, event.stopped_by_model, text.text_end)
                    return
                assert isinstance(event, JobAudio)
                produced += event.samples.size
                out = trimmer.push(event.samples, last=False) if trimmer else event.samples
                if out.size:
                    now = time.monotonic()
                    if last_chunk_at is not None:
                        stats.gap.observe(now - last_chunk_at)
                    last_chunk_at = now
                    yield self._chunk(out, index, start_sample + sent, ready_at, stats)
                    sent += out.size
        finally:
            self.engine.cancel(job)  # no-op for a finished job; frees a running one at the next step

    def _chunk(
        self, samples: np.ndarray, index: int, start: int, ready_at: float, stats: SessionMetrics
    ) -> Chunk:
        stats.chunk(samples.size, time.monotonic(), ready_at)
        return Chunk(pcm16(samples), index, start)


class TalkerEngine:
    """The talker's flow: `speak(settings, inputs)` holds one stream slot (as many as the caches hold)
    for a Speak stream; `submit(job)` / `cancel(job)` / `call(fn)` from any thread; `start()` /
    `stop()` the device loop."""

    def __init__(
        self,
        model: TalkerRunner,
        voices: VoiceBank | None = None,
        cfg: TalkerConfig | None = None,
        pool: concurrent.futures.Executor | None = None,
        *,
        service: str = "talker",
        idle_wait_s: float = 0.5,
        on_step: Callable[[int, float], None] | None = None,
        on_admit: Callable[[float], None] | None = None,
        on_failure: Callable[[DeviceFailed], None] | None = None,
    ) -> None:
        self.service = service
        self.voices, self.cfg, self.pool = voices, cfg or TalkerConfig(), pool
        self.runner = SegmentRunner(model)
        self.runner.on_admit = on_admit
        self.streams = ConcurrencyLimiter(f"{service} streams", model.slots)
        self.loop = DeviceLoop(service, self.runner, idle_wait_s=idle_wait_s)
        if on_step is not None:  # (segments in the step, seconds) after every step: metrics
            self.loop.on_step.append(on_step)
        if on_failure is not None:
            self.loop.on_failure.append(on_failure)

    @property
    def max_streams(self) -> int:
        return self.runner.model.slots

    @property
    def step_batch(self) -> int:
        return self.runner.model.step_batch

    async def speak(self, settings: StreamSettings, inputs: AsyncIterator[TextInput]) -> AsyncIterator[Event]:
        """One Speak stream in one of the stream slots (`ConcurrencyLimiter.admit`, as every stage)."""
        assert self.voices is not None and self.pool is not None, "a serving engine has voices and a pool"
        async with contextlib.AsyncExitStack() as stack:
            # The one admission shape of every stage: RESOURCE_EXHAUSTED with a retry hint past
            # talker.queue_timeout_s, DEADLINE_EXCEEDED when the caller's deadline comes first.
            await stack.enter_async_context(
                self.streams.admit(
                    settings.deadline, max(self.cfg.queue_timeout_s, 0.001), what="a stream slot"
                )
            )
            session = SpeakSession(self, self.voices, self.cfg, self.pool, self.service)
            async for event in session.run(settings, inputs):
                yield event

    @property
    def on_admit(self) -> Callable[[float], None] | None:
        """(seconds a job waited for its first step) once per job: metrics."""
        return self.runner.on_admit

    @on_admit.setter
    def on_admit(self, hook: Callable[[float], None] | None) -> None:
        self.runner.on_admit = hook

    def start(self) -> None:
        self.loop.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the step in progress, fail what is left, join the device thread."""
        self.loop.stop(timeout_s)

    @property
    def jobs_in_flight(self) -> int:
        return self.runner.jobs_in_flight

    @property
    def jobs_queued(self) -> int:
        return self.runner.jobs_queued

    def submit(self, job: SegmentJob) -> None:
        """Queue `job` for its first due step; raises DeviceStopped / DeviceFailed once the loop has ended."""
        self.loop.admit(lambda: self.runner.put(job))

    def cancel(self, job: SegmentJob) -> None:
        """Drop `job` at the next step boundary (its state and slot are freed there; no more events)."""
        job.cancelled = True
        self.loop.wake()

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the device thread between two steps; its result (or exception) in the future."""
        return self.loop.call(fn)

    def step(self) -> None:
        """One step on the calling thread (tests and benches drive the engine by hand, unstarted)."""
        self.loop.step()
