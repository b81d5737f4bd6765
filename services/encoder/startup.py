"""Encoder start-up work: load the towers, stress-and-cap each modality, warm up with real media."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch
from omnistage.common import wav
from omnistage.common.config import EncoderConfig
from omnistage.common.memory.device import DeviceMemory
from omnistage.common.memory.stress import StressAndCap, StressResult
from omnistage.common.runtime.progress import Report
from omnistage.common.transport import decode
from omnistage.services.encoder.items import ItemLimits, MediaItem
from omnistage.services.encoder.models.loader import EncoderModels
from omnistage.services.encoder.preprocess import SAMPLE_RATE, video_pixel_range
from omnistage.services.encoder.runner import vision_forward
from omnistage.v1 import control_pb2
from PIL import Image


@dataclass
class Profile:
    """What the stress proved: per-modality caps and the memory they need."""

    vision: StressResult
    audio: StressResult
    budget_bytes: int

    @property
    def caps(self) -> dict[str, int]:
        return {"vision": self.vision.max_batch, "audio": self.audio.max_batch}

    def memory_report(
        self, mem: DeviceMemory, weights_bytes: int, transport_pool_bytes: int
    ) -> control_pb2.MemoryReport:
        baseline = self.vision.baseline_reserved
        peak = max(self.vision.peak_reserved, self.audio.peak_reserved)
        return control_pb2.MemoryReport(
            device=mem.device_name,
            budget_bytes=self.budget_bytes,
            weights_bytes=weights_bytes,
            activation_peak_bytes=max(peak - baseline, 0),
            transport_pool_bytes=transport_pool_bytes,
            total_bytes=mem.reserved() + transport_pool_bytes,
        )


def largest_vision_grid(cfg: EncoderConfig, limits: ItemLimits) -> tuple[int, int, int]:
    """Patch grid of the largest vision item the limits allow (square frames at the pixel budget)."""
    v = limits.model.vision
    side = max(
        v.pixels_per_token, math.isqrt(cfg.image_max_pixels) // v.pixels_per_token * v.pixels_per_token
    )
    image = (1, side // v.patch_size, side // v.patch_size)
    _, frame_max = video_pixel_range(cfg.max_video_frames, cfg.video_min_pixels, cfg.video_total_pixels)
    fside = max(v.pixels_per_token, math.isqrt(frame_max) // v.pixels_per_token * v.pixels_per_token)
    video = (cfg.max_video_frames // v.temporal_patch_size, fside // v.patch_size, fside // v.patch_size)
    return max(image, video, key=lambda g: g[0] * g[1] * g[2])


def profile(
    models: EncoderModels,
    mem: DeviceMemory,
    limits: ItemLimits,
    budget: int,
    report: Report,
    full: bool = True,
) -> Profile:
    """Stress-and-cap both towers on `mem` within `budget` bytes (0: none); call inside `mem.meter()`,
    after the weights are loaded.

    Not `full` (a plain CPU: no kernels to build, no device memory to prove; `Boot.full_warmup`): each
    tower runs its largest item once, at the smallest batch (`StressAndCap.prove`), and keeps the
    largest batch as its cap, which is all the full stress can conclude there (a batch of several
    items is the same `encode_items` forward over a longer list)."""
    cfg = limits.encoder
    grid = largest_vision_grid(cfg, limits)
    t, h, w = grid
    v = models.config.vision
    frames_shape = (t * v.temporal_patch_size if t > 1 else 1, h * v.patch_size, w * v.patch_size, 3)
    mel_frames = limits.max_audio_frames
    a = models.config.audio

    def vision_batch(b: int) -> object:
        report("profiling_memory", f"vision batch {b} x grid {grid}")
        frames = torch.randint(0, 256, frames_shape, dtype=torch.uint8)
        return vision_forward(models, [frames] * b)

    def audio_batch(b: int) -> object:
        report("profiling_memory", f"audio batch {b} x {limits.max_audio_seconds:g} s")
        return models.audio.encode_items([torch.randn(a.n_mels, mel_frames)] * b)

    sizes = cfg.stress_batch_sizes
    vision = StressAndCap("encoder vision", mem, vision_batch, sizes, budget_bytes=budget)
    audio = StressAndCap("encoder audio", mem, audio_batch, sizes, budget_bytes=budget)
    if not full:
        return Profile(vision.prove(), audio.prove(), budget)
    return Profile(vision.run(), audio.run(), budget)


# -- warm-up media ---------------------------------------------------------------------------------


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def wav_bytes(seconds: float, rate: int = SAMPLE_RATE, freq_hz: float = 440.0) -> bytes:
    """`seconds` of a sine tone as a mono PCM16 WAV file."""
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * freq_hz * t) * 32767).astype("<i2")
    return wav.wav_bytes(pcm.tobytes(), rate)


def warmup_items() -> list[MediaItem]:
    """One image, one 4-frame video (as frames) and one 1 s audio clip: every tower and path."""
    frames = tuple(png_bytes(64, 48, seed=i) for i in range(4))
    return [
        MediaItem("image", data=png_bytes(64, 48)),
        MediaItem("video", frames=frames, fps=2.0),
        MediaItem("audio", data=wav_bytes(1.0)),
    ]


async def warm_up(engine) -> None:
    """One real request through the engine; every ref is decoded (and so released) as a consumer would."""
    outputs = await engine.encode(warmup_items(), timeout_s=600.0)
    for out in outputs:
        rows = decode(out.ref, transport=engine.transport)
        if rows.shape[0] != out.num_tokens or not torch.isfinite(rows.float()).all():
            raise RuntimeError(
                f"warm-up {out.kind} produced {tuple(rows.shape)} rows, expected {out.num_tokens} finite"
            )
