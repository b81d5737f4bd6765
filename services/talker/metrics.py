"""The talker's Prometheus metrics: per step (batch, time), per segment (queue time), per stream and voice
(time to first audio, real-time factor, chunk gaps, underruns, seconds spoken), and the gauge of
segments holding state."""

from __future__ import annotations

from collections.abc import Callable

from omnistage.common import metrics


class StepMetrics:
    """The engine's `on_step` hook."""

    def __init__(self, service: str) -> None:
        self.steps = metrics.counter(
            "talker_steps", "Talker steps run (one patch of 4 latents for every segment in the batch)"
        ).labels(service)
        self.batch = metrics.histogram(
            "talker_step_batch", "Segments sharing one talker step", (), buckets=(1, 2, 4, 8, 16, 32, 64)
        ).labels(service)
        self.seconds = metrics.histogram(
            "talker_step_seconds",
            "Wall time of one batched talker step",
            (),
            buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
        ).labels(service)

    def __call__(self, batch: int, seconds: float) -> None:
        self.steps.inc()
        self.batch.observe(batch)
        self.seconds.observe(seconds)


def export_engine_gauges(
    service: str, jobs_in_flight: Callable[[], int], streams_in_use: Callable[[], int], max_streams: int
) -> None:
    metrics.gauge(
        "talker_active_jobs", "Segments holding talker state (LM/CFM/VAE) now, or queued for it"
    ).labels(service).set_function(jobs_in_flight)
    metrics.gauge("talker_streams", "Speak streams holding a stream slot now").labels(service).set_function(
        streams_in_use
    )
    metrics.gauge(
        "talker_max_streams", "Stream slots: the streams whose caches fit the talker's memory budget"
    ).labels(service).set(max_streams)


def queue_time_hook(service: str) -> Callable[[float], None]:
    """The engine's `on_admit` hook (set after the warm-up: clients' segments only)."""
    return (
        metrics.histogram(
            "talker_queue_time_seconds",
            "Time a segment waited in the talker: queued for the engine to its first talker step",
        )
        .labels(service)
        .observe
    )


class SessionMetrics:
    """Per-voice latency and continuity: TTFA, real-time factor, chunk gaps, underruns."""

    def __init__(self, service: str, voice: str, sample_rate: int) -> None:
        labels = (service, voice)
        self.ttfa = metrics.histogram(
            "talker_ttfa_seconds",
            "Time to first audio of a Speak stream (first segment ready to its first chunk), by voice",
            ("voice",),
        ).labels(*labels)
        self.rtf = metrics.histogram(
            "talker_rtf",
            "Real-time factor of a segment: wall time to make it / its audio duration, by voice",
            ("voice",),
            buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0),
        ).labels(*labels)
        self.gap = metrics.histogram(
            "talker_chunk_gap_seconds",
            "Time between consecutive audio chunks of a segment, by voice",
            ("voice",),
        ).labels(*labels)
        self.underruns = metrics.counter(
            "talker_underruns",
            "Chunks that came after the audio sent before "
            "them had finished playing (a listener would hear a gap), by voice",
            ("voice",),
        ).labels(*labels)
        self.audio_s = metrics.counter(
            "talker_audio_seconds", "Seconds of speech sent, by voice", ("voice",)
        ).labels(*labels)
        self.sample_rate = sample_rate
        self.play_start: float | None = None  # wall time the listener started playing
        self.played = 0  # samples sent

    def chunk(self, samples: int, now: float, ready_at: float) -> None:
        """A chunk of `samples` goes out at `now`; its segment was ready to speak at `ready_at`."""
        if self.play_start is None:
            self.play_start = now
        else:
            runs_out = self.play_start + self.played / self.sample_rate
            if now > runs_out and ready_at < runs_out:  # late, and not for want of text
                self.underruns.inc()
                self.play_start += now - runs_out  # the listener waited: the clock restarts from here
            elif now > runs_out:
                self.play_start += now - runs_out
        self.played += samples
        self.audio_s.inc(samples / self.sample_rate)
