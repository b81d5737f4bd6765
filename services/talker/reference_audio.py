"""Decoding a voice's reference clip (any FFmpeg-readable audio: WAV, FLAC, MP3, OGG) to mono float
samples at the rates the talker needs: the VAE's (44.1 kHz) and CAM++'s (16 kHz). PyAV decodes and
resamples (libswresample, band-limited); the length is bounded while decoding."""

from __future__ import annotations

import io

import av
import numpy as np


class ClipError(ValueError):
    """A reference clip that cannot be used; the message says why."""


def decode_clip(data: bytes, rate: int, max_seconds: float) -> np.ndarray:
    """Encoded clip → mono float32 samples at `rate`; ClipError when empty, undecodable or too long."""
    if not data:
        raise ClipError("empty")
    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="replace")
    except av.error.FFmpegError as exc:
        raise ClipError(f"not a decodable audio file ({exc.strerror or exc})") from None
    limit = int(max_seconds * rate)
    chunks, total = [], 0
    try:
        with container:
            if not container.streams.audio:
                raise ClipError("no audio stream")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
            for frame in container.decode(audio=0):
                for out in resampler.resample(frame):
                    chunk = out.to_ndarray().reshape(-1)
                    chunks.append(chunk)
                    total += chunk.shape[0]
                if total > limit:
                    raise ClipError(f"longer than {max_seconds:g} s")
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except av.error.FFmpegError as exc:
        raise ClipError(f"not a decodable audio file ({exc.strerror or exc})") from None
    samples = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    if samples.shape[0] > limit:
        raise ClipError(f"longer than {max_seconds:g} s")
    if samples.shape[0] < rate // 10:
        raise ClipError(f"shorter than 0.1 s ({samples.shape[0] / rate:.3f} s of audio)")
    if not np.isfinite(samples).all():
        raise ClipError("samples are not finite")
    return samples
