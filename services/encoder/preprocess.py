"""Model inputs from decoded media: resized, normalised, patchified pixels; Whisper log-mel (ming.md §3.4-§4.2)."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch
from omnistage.services.encoder.models.config import VisionConfig
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200
VIDEO_FPS = 2.0
VIDEO_MIN_FRAMES = 4
FRAME_FACTOR = 2  # frames per temporal patch
SAMPLE_RATE = 16000
N_FFT = 400
HOP = 160


class MediaError(ValueError):
    """An item that cannot be turned into model input; the message says why (the caller adds which item)."""


# -- vision ---------------------------------------------------------------------------------------


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(h, w) multiples of `factor` near the input with min_pixels ≤ h·w ≤ max_pixels (Qwen-VL rule)."""
    if height <= 0 or width <= 0:
        raise MediaError(f"zero-size image ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(
            f"aspect ratio {max(height, width) / min(height, width):.1f} of {width}x{height} exceeds {MAX_ASPECT_RATIO}"
        )
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def resize_rgb(image: Image.Image, size: tuple[int, int]) -> np.ndarray:
    """PIL bicubic resize to (h, w); uint8 [h, w, 3]."""
    h, w = size
    if image.size != (w, h):
        image = image.resize((w, h), resample=Image.Resampling.BICUBIC)
    return np.asarray(image.convert("RGB"), dtype=np.uint8)


def stack_frames(frames: list[np.ndarray]) -> torch.Tensor:
    """Resized RGB frames (uint8 [H, W, 3], one size) → uint8 [T, H, W, 3]: what a vision item holds
    until its forward (8x smaller than the normalised float patches, which are made on the device)."""
    return torch.from_numpy(np.ascontiguousarray(np.stack(frames)))


def normalise(frames: torch.Tensor) -> torch.Tensor:
    """uint8 [T, H, W, 3] (any device) → float32 [T, 3, H, W]: rescale 1/255, CLIP mean/std."""
    x = frames.permute(0, 3, 1, 2).float().div_(255.0)
    mean = torch.tensor(CLIP_MEAN, device=frames.device).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD, device=frames.device).view(1, 3, 1, 1)
    return x.sub_(mean).div_(std)


def patchify(pixels: torch.Tensor, cfg: VisionConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[T, C, H, W] (T a multiple of the temporal patch) → ([t·h·w, C·Tp·P·P], (t, h, w) patch grid)."""
    frames, c, height, width = pixels.shape
    tp, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.spatial_merge_size
    if frames % tp or height % (p * m) or width % (p * m):
        raise ValueError(f"pixels {tuple(pixels.shape)} do not tile into {tp}x{p * m}x{p * m}")
    t, h, w = frames // tp, height // p, width // p
    x = pixels.reshape(t, tp, c, h // m, m, p, w // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, block_row, block_col, in_row, in_col, C, Tp, y, x
    return x.reshape(t * h * w, c * tp * p * p).contiguous(), (t, h, w)


def frames_grid(frames: torch.Tensor, cfg: VisionConfig) -> tuple[int, int, int]:
    """Patch grid of uint8 frames [T, H, W, 3]; one frame (a still image) counts as a temporal patch."""
    count, height, width, _ = frames.shape
    return max(count // cfg.temporal_patch_size, 1), height // cfg.patch_size, width // cfg.patch_size


def pixel_patches(frames: torch.Tensor, cfg: VisionConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """uint8 frames [T, H, W, 3] on any device → float32 patches on that device, and the grid.

    A single frame is a still image: duplicated into the temporal patch (the reference's 2 frames).
    """
    if frames.shape[0] == 1:
        frames = frames.expand(cfg.temporal_patch_size, *frames.shape[1:])
    return patchify(normalise(frames), cfg)


def image_frames(image: Image.Image, size: tuple[int, int]) -> torch.Tensor:
    """One still image at `size` (h, w) → uint8 [1, h, w, 3]."""
    return stack_frames([resize_rgb(image, size)])


def video_frame_count(total_frames: int, video_fps: float, max_frames: int) -> int:
    """Frames sampled from a video of `total_frames` at `video_fps` (Qwen-VL `smart_nframes`, 2 fps)."""
    upper = min(max_frames, total_frames) // FRAME_FACTOR * FRAME_FACTOR
    wanted = total_frames / video_fps * VIDEO_FPS
    n = int(min(max(wanted, VIDEO_MIN_FRAMES), upper, total_frames)) // FRAME_FACTOR * FRAME_FACTOR
    if n < FRAME_FACTOR:
        raise MediaError(f"video has {total_frames} frame(s); at least {FRAME_FACTOR} are needed")
    return n


def video_frame_indices(total_frames: int, count: int) -> list[int]:
    """Evenly spaced frame indices, first and last included (linspace, rounded)."""
    return torch.linspace(0, total_frames - 1, count).round().long().tolist()


def video_pixel_range(num_frames: int, min_pixels: int, total_pixels: int) -> tuple[int, int]:
    """(min, max) pixels of one frame: max = max(total / frames · 2, 1.05 · min) (ming.md §3.5)."""
    return min_pixels, max(int(total_pixels / num_frames * FRAME_FACTOR), int(min_pixels * 1.05))


def temporal_patch_times(frame_times: list[float]) -> list[float]:
    """One timestamp per temporal patch: the mean of its two frames' times (seconds)."""
    return [(frame_times[i] + frame_times[i + 1]) / 2 for i in range(0, len(frame_times) - 1, FRAME_FACTOR)]


# -- audio ----------------------------------------------------------------------------------------


def _hz_to_mel(f: torch.Tensor) -> torch.Tensor:
    """Slaney mel scale: linear below 1 kHz, logarithmic above."""
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return torch.where(f >= min_log_hz, min_log_mel + torch.log(f / min_log_hz) / logstep, f / f_sp)


def _mel_to_hz(m: torch.Tensor) -> torch.Tensor:
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return torch.where(m >= min_log_mel, min_log_hz * torch.exp(logstep * (m - min_log_mel)), f_sp * m)


@lru_cache(maxsize=4)
def mel_filters(n_mels: int, sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT) -> torch.Tensor:
    """[n_mels, n_fft/2 + 1] Slaney-normalised triangular filters (librosa's `filters.mel` defaults)."""
    fft_freqs = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    mels = torch.linspace(
        float(_hz_to_mel(torch.tensor(0.0, dtype=torch.float64))),
        float(_hz_to_mel(torch.tensor(sample_rate / 2, dtype=torch.float64))),
        n_mels + 2,
        dtype=torch.float64,
    )
    edges = _mel_to_hz(mels)
    widths = edges[1:] - edges[:-1]
    ramps = edges[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = torch.clamp(torch.minimum(lower, upper), min=0)
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return weights.float()


def log_mel(samples: torch.Tensor, n_mels: int) -> torch.Tensor:
    """16 kHz mono float samples [N] → Whisper log-mel [n_mels, ⌊N / 160⌋] (no 30 s padding)."""
    if samples.numel() <= N_FFT // 2:
        raise MediaError(f"audio of {samples.numel()} samples is too short (more than {N_FFT // 2} needed)")
    window = torch.hann_window(N_FFT)
    stft = torch.stft(samples.float(), N_FFT, HOP, window=window, return_complex=True)
    power = stft[..., :-1].abs() ** 2
    mel = mel_filters(n_mels) @ power
    logs = torch.clamp(mel, min=1e-10).log10()
    logs = torch.maximum(logs, logs.max() - 8.0)
    return (logs + 4.0) / 4.0
