"""Synthetic media files for the encoder tests, written with PIL and PyAV (no files from outside)."""

from __future__ import annotations

import io
import os
import tempfile

import av
import numpy as np
from omnistage.services.encoder.startup import png_bytes, wav_bytes
from PIL import Image

__all__ = ["audio_file", "image_bytes", "png_bytes", "tone", "video_file", "wav_bytes"]

# container → (codec, sample format)
AUDIO_CODECS = {
    "wav": ("pcm_s16le", "s16"),
    "flac": ("flac", "s16"),
    "ogg": ("libopus", "flt"),
    "mp3": ("libmp3lame", "fltp"),
    "adts": ("aac", "fltp"),
}


def tone(seconds: float, rate: int, channels: int = 1, freq_hz: float = 440.0) -> np.ndarray:
    """float32 [channels, n]: a sine on channel 0, silence on the others."""
    t = np.arange(int(seconds * rate)) / rate
    x = np.zeros((channels, t.size), np.float32)
    x[0] = 0.4 * np.sin(2 * np.pi * freq_hz * t)
    return x


def audio_file(fmt: str, seconds: float, rate: int = 16000, channels: int = 1) -> bytes:
    """`seconds` of a tone encoded as `fmt` (wav, flac, ogg (opus), mp3, adts (aac: unsupported here))."""
    codec, sample_fmt = AUDIO_CODECS[fmt]
    if fmt == "ogg":
        rate = 48000  # opus
    buf = io.BytesIO()
    layout = "mono" if channels == 1 else "stereo"
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        stream.format = sample_fmt
        pcm = tone(seconds, rate, channels)
        if sample_fmt == "s16":
            data = (pcm * 32767).astype(np.int16).T.reshape(1, -1)
        elif sample_fmt == "flt":
            data = pcm.T.reshape(1, -1)
        else:
            data = pcm
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(data), format=sample_fmt, layout=layout)
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def image_bytes(width: int, height: int, fmt: str = "PNG", seed: int = 0) -> bytes:
    if fmt == "PNG":
        return png_bytes(width, height, seed)
    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format=fmt)
    return buf.getvalue()


def video_file(
    frames: int, fps: int = 10, width: int = 96, height: int = 64, fmt: str = "mp4", faststart: bool = False
) -> bytes:
    """`frames` frames at `fps` (mpeg4 in mp4); frame i is a flat grey of level 8·i, so frames differ.

    `faststart` puts the index (moov) before the frames, so a truncated file still opens."""
    if faststart:  # the muxer rewrites the file by name to move the index
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, f"v.{fmt}")
            _write_video(path, frames, fps, width, height, fmt, {"movflags": "faststart"})
            with open(path, "rb") as f:
                return f.read()
    buf = io.BytesIO()
    _write_video(buf, frames, fps, width, height, fmt, {})
    return buf.getvalue()


def _write_video(target, frames: int, fps: int, width: int, height: int, fmt: str, options: dict) -> None:
    with av.open(target, mode="w", format=fmt, options=options) as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            rgb = np.full((height, width, 3), (8 * i) % 256, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
