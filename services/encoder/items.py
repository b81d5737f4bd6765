"""One request item → the model input of its tower, under the deploy limits (CPU work, any thread).

A `MediaItem` is what the servicer read from the proto; `prepare_item` decodes it (media.py) and
turns it into resized uint8 frames + grid (vision) or a log-mel (audio) (preprocess.py), with everything the
response reports about the item (placeholder id, merged grids, timestamps, sizes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from omnistage.common.config import EncoderConfig
from omnistage.services.encoder import media, preprocess
from omnistage.services.encoder.models.audio import audio_token_count
from omnistage.services.encoder.models.config import EncoderModelConfig
from omnistage.services.encoder.preprocess import FRAME_FACTOR, MediaError

Kind = Literal["image", "audio", "video"]
Grid = tuple[int, int, int]


@dataclass(frozen=True)
class MediaItem:
    """One item as the client sent it (exactly one source is set)."""

    kind: Kind
    data: bytes = b""
    samples: np.ndarray | None = None
    sample_rate_hz: int = 0
    frames: tuple[bytes, ...] = ()
    fps: float = 0.0


@dataclass(frozen=True)
class VisionInput:
    frames: torch.Tensor  # uint8 [T, H, W, 3] resized (T = 1 for an image); patches are made on the device
    grid: Grid  # patch units
    kind: Kind
    resized: tuple[int, int]  # (h, w) pixels per frame
    merge: int  # spatial merge size: tokens are merge x merge patches
    timestamps_s: tuple[float, ...] = ()
    duration_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w // self.merge**2

    @property
    def merged_grids(self) -> list[Grid]:
        """Response grid rows: one (1, h/m, w/m) per temporal slice (an image has one slice)."""
        t, h, w = self.grid
        return [(1, h // self.merge, w // self.merge)] * t

    @property
    def batch_units(self) -> int:
        """Its share of a vision forward's budget: one item (the cap counts items at the largest)."""
        return 1


@dataclass(frozen=True)
class AudioInput:
    mel: torch.Tensor  # [n_mels, frames] float32
    duration_s: float
    num_tokens: int
    kind: Kind = "audio"

    @property
    def batch_units(self) -> int:
        """Its share of an audio forward's budget: its mel frames (clips are padded to the longest)."""
        return int(self.mel.shape[-1])


ModelInput = VisionInput | AudioInput


@dataclass(frozen=True)
class ItemLimits:
    """The deploy limits and model facts `prepare_item` needs (immutable, shared by threads)."""

    encoder: EncoderConfig
    model: EncoderModelConfig
    max_audio_seconds: float  # the deploy limit, capped by the encoder's n_ctx

    @classmethod
    def of(cls, encoder: EncoderConfig, model: EncoderModelConfig) -> ItemLimits:
        model_max_s = 2 * model.audio.n_ctx * preprocess.HOP / preprocess.SAMPLE_RATE
        return cls(encoder, model, min(encoder.max_audio_seconds, model_max_s))

    @property
    def max_audio_frames(self) -> int:
        """Mel frames of the longest clip accepted (the start-up stress's audio item)."""
        return int(self.max_audio_seconds * preprocess.SAMPLE_RATE) // preprocess.HOP


def prepare_item(item: MediaItem, limits: ItemLimits) -> ModelInput:
    """Decode and preprocess one item; MediaError says what is wrong with it."""
    if item.kind == "image":
        return _image(item, limits)
    if item.kind == "video":
        return _video_frames(item, limits) if item.frames else _video_file(item, limits)
    return _audio(item, limits)


def _image(item: MediaItem, limits: ItemLimits) -> VisionInput:
    e, v = limits.encoder, limits.model.vision
    image = media.decode_image(item.data, e.max_input_image_pixels)
    size = preprocess.smart_resize(
        image.height, image.width, v.pixels_per_token, e.image_min_pixels, e.image_max_pixels
    )
    frames = preprocess.image_frames(image, size)
    return VisionInput(frames, preprocess.frames_grid(frames, v), "image", size, v.spatial_merge_size)


def _video_size(height: int, width: int, frames: int, limits: ItemLimits) -> tuple[int, int]:
    e, v = limits.encoder, limits.model.vision
    lo, hi = preprocess.video_pixel_range(frames, e.video_min_pixels, e.video_total_pixels)
    return preprocess.smart_resize(height, width, v.pixels_per_token, lo, hi)


def _video_file(item: MediaItem, limits: ItemLimits) -> VisionInput:
    e = limits.encoder
    info = media.probe_video(item.data, e.max_video_seconds, e.max_input_image_pixels)
    count = preprocess.video_frame_count(info.total_frames, info.fps, e.max_video_frames)
    indices = preprocess.video_frame_indices(info.total_frames, count)
    size = _video_size(info.height, info.width, count, limits)
    frames = media.decode_video_frames(item.data, indices, size)
    times = [i / info.fps for i in indices]
    return _video_input([preprocess.resize_rgb(f, size) for f in frames], times, size, limits)


def _video_frames(item: MediaItem, limits: ItemLimits) -> VisionInput:
    e = limits.encoder
    if len(item.frames) > e.max_video_frames:
        raise MediaError(
            f"{len(item.frames)} frames exceed the limit of {e.max_video_frames} (encoder.max_video_frames)"
        )
    if item.fps < 0:
        raise MediaError(f"frames.fps must be >= 0, got {item.fps}")
    fps = item.fps or preprocess.VIDEO_FPS
    images = []
    for i, data in enumerate(item.frames):
        try:
            images.append(media.decode_image(data, e.max_input_image_pixels))
        except MediaError as exc:
            raise MediaError(f"frames.images[{i}]: {exc}") from None
    count = -(-len(images) // FRAME_FACTOR) * FRAME_FACTOR
    images += [images[-1]] * (count - len(images))  # even count: repeat the last frame
    size = _video_size(images[0].height, images[0].width, count, limits)
    times = [i / fps for i in range(count)]
    return _video_input([preprocess.resize_rgb(img, size) for img in images], times, size, limits)


def _video_input(
    frames: list[np.ndarray], times: list[float], size: tuple[int, int], limits: ItemLimits
) -> VisionInput:
    stacked = preprocess.stack_frames(frames)
    v = limits.model.vision
    return VisionInput(
        stacked,
        preprocess.frames_grid(stacked, v),
        "video",
        size,
        v.spatial_merge_size,
        timestamps_s=tuple(preprocess.temporal_patch_times(times)),
        duration_s=times[-1] - times[0],
    )


def _audio(item: MediaItem, limits: ItemLimits) -> AudioInput:
    if item.samples is not None:
        decoded = media.resample_samples(item.samples, item.sample_rate_hz, limits.max_audio_seconds)
    else:
        decoded = media.decode_audio(item.data, limits.max_audio_seconds)
    mel = preprocess.log_mel(torch.from_numpy(decoded.samples), limits.model.audio.n_mels)
    return AudioInput(mel, decoded.duration_s, audio_token_count(mel.shape[1], limits.model.audio))
