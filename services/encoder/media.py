"""Decoding of request media: images (PIL), audio and video (PyAV: FFmpeg decoders + libswresample)."""

from __future__ import annotations

import io
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
from omnistage.services.encoder.preprocess import SAMPLE_RATE, MediaError
from PIL import Image, UnidentifiedImageError

AUDIO_FORMATS = ("wav", "flac", "ogg", "mp3")
# FLAC's STREAMINFO states the exact length, so a shorter decode means a truncated file (FFmpeg's WAV
# demuxer clamps the data chunk to the file size, so WAV is checked from its RIFF header instead).
_EXACT_LENGTH_FORMATS = ("flac",)
_TRUNCATION_SLACK_S = 0.05
_WAV_UNKNOWN_SIZES = (0, 0xFFFFFFFF)  # streaming writers leave the data size unset


def _format_names(container: av.container.InputContainer) -> set[str]:
    return set(container.format.name.split(","))


def _open(data: bytes, what: str) -> av.container.InputContainer:
    if not data:
        raise MediaError(f"empty {what} data")
    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="replace")
    except av.error.FFmpegError as exc:
        raise MediaError(f"not a decodable {what} file ({exc.strerror or exc})") from None
    return container


def _codec_checked(stream: av.stream.Stream, what: str) -> av.stream.Stream:
    if stream.codec_context is None:
        raise MediaError(f"the {what} stream has an unknown or unsupported codec")
    return stream


# -- images ---------------------------------------------------------------------------------------


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB; transparent pixels composited on white (as the reference's `to_rgb`)."""
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.split()[3])
        return background
    return image.convert("RGB")


def _png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR (PIL refuses to identify a zero-size PNG at all)."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 24:
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    return None


def check_frame_size(kind: str, width: int, height: int, max_input_pixels: int) -> None:
    """An image or a video's frames (`kind`): not empty, and within the pixel bound before decoding."""
    if width <= 0 or height <= 0:
        raise MediaError(f"zero-size {kind} ({width}x{height})")
    if width * height > max_input_pixels:
        frame = "image" if kind == "image" else f"{kind} frame"
        raise MediaError(
            f"{frame} of {width}x{height} = {width * height} pixels exceeds the limit of "
            f"{max_input_pixels} (encoder.max_input_image_pixels)"
        )


def decode_image(data: bytes, max_input_pixels: int) -> Image.Image:
    """Encoded image bytes → RGB PIL image (first frame of an animation). Size checked before decoding."""
    if not data:
        raise MediaError("empty image data")
    try:
        image = Image.open(io.BytesIO(data))  # lazy: reads the header only; our pixel limit is checked next
    except UnidentifiedImageError:
        if (size := _png_size(data)) is not None and 0 in size:
            raise MediaError(f"zero-size image ({size[0]}x{size[1]})") from None
        raise MediaError("not a supported image format") from None
    except Image.DecompressionBombError as exc:
        raise MediaError(f"image too large: {exc}") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise MediaError(f"corrupt image: {exc}") from None
    check_frame_size("image", *image.size, max_input_pixels)
    try:
        image.load()
        return to_rgb(image)
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise MediaError(f"corrupt or truncated image: {exc}") from None


# -- audio ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodedAudio:
    samples: np.ndarray  # float32 [N], mono, 16 kHz
    duration_s: float


class _Collector:
    """Resampled samples of channel 0 at 16 kHz, refusing to grow past the length limit."""

    def __init__(self, max_seconds: float) -> None:
        self.max_samples = int(max_seconds * SAMPLE_RATE)
        self.max_seconds = max_seconds
        self.parts: list[np.ndarray] = []
        self.count = 0
        self.resampler = av.AudioResampler(format="fltp", rate=SAMPLE_RATE)

    def add(self, frame: av.AudioFrame | None) -> None:
        for out in self.resampler.resample(frame):
            chunk = out.to_ndarray()[0].astype(np.float32, copy=False)  # first channel (reference)
            self.count += chunk.size
            if self.count > self.max_samples:
                raise MediaError(
                    f"audio is longer than the limit of {self.max_seconds:g} s (encoder.max_audio_seconds)"
                )
            self.parts.append(chunk)

    def result(self) -> DecodedAudio:
        self.add(None)  # flush the resampler
        samples = np.concatenate(self.parts) if self.parts else np.zeros(0, np.float32)
        return DecodedAudio(samples, samples.size / SAMPLE_RATE)


def _check_wav_complete(data: bytes) -> None:
    """A RIFF/WAVE file whose data chunk declares more bytes than the file holds is truncated."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return
    pos = 12
    while pos + 8 <= len(data):
        chunk, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
        if chunk == b"data":
            available = len(data) - pos - 8
            if size not in _WAV_UNKNOWN_SIZES and size > available:
                raise MediaError(
                    f"truncated audio: the WAV header declares {size} data bytes, the file holds {available}"
                )
            return
        pos += 8 + size + (size & 1)


def decode_audio(data: bytes, max_seconds: float) -> DecodedAudio:
    """WAV/FLAC/OGG/MP3 bytes → first channel, 16 kHz float32."""
    with _open(data, "audio") as container:
        names = _format_names(container)
        if not names & set(AUDIO_FORMATS):
            raise MediaError(
                f"unsupported audio format {container.format.name!r} (supported: {', '.join(AUDIO_FORMATS)})"
            )
        if "wav" in names:
            _check_wav_complete(data)
        if not container.streams.audio:
            raise MediaError("no audio stream in the file")
        stream = _codec_checked(container.streams.audio[0], "audio")
        declared = _declared_seconds(stream, container)
        if declared is not None and declared > max_seconds + _TRUNCATION_SLACK_S:
            raise MediaError(
                f"audio is {declared:.2f} s long; the limit is {max_seconds:g} s (encoder.max_audio_seconds)"
            )
        collector = _Collector(max_seconds)
        try:
            for frame in container.decode(stream):
                collector.add(frame)
            out = collector.result()
        except av.error.FFmpegError as exc:
            raise MediaError(f"corrupt or truncated audio: {exc.strerror or exc}") from None
    if out.samples.size == 0:
        raise MediaError("audio has no samples")
    if (
        names & set(_EXACT_LENGTH_FORMATS)
        and declared is not None
        and out.duration_s < declared - _TRUNCATION_SLACK_S
    ):
        raise MediaError(
            f"truncated audio: the header declares {declared:.3f} s, decoded {out.duration_s:.3f} s"
        )
    return out


def resample_samples(samples: np.ndarray, sample_rate_hz: int, max_seconds: float) -> DecodedAudio:
    """Decoded float samples ([N] or [channels, N]) at any rate → first channel, 16 kHz float32."""
    if sample_rate_hz <= 0:
        raise MediaError("sample_rate_hz must be > 0 with samples")
    if samples.ndim == 2:
        samples = samples[0]
    if samples.ndim != 1 or samples.size == 0:
        raise MediaError(
            f"samples must be [num_samples] or [channels, num_samples], got shape {list(samples.shape)}"
        )
    if not np.isfinite(samples).all():
        raise MediaError("samples contain NaN or infinity")
    if samples.size / sample_rate_hz > max_seconds:
        raise MediaError(
            f"audio is {samples.size / sample_rate_hz:.2f} s long; the limit is {max_seconds:g} s "
            "(encoder.max_audio_seconds)"
        )
    if sample_rate_hz == SAMPLE_RATE:
        x = samples.astype(np.float32)
        return DecodedAudio(x, x.size / SAMPLE_RATE)
    frame = av.AudioFrame.from_ndarray(
        np.ascontiguousarray(samples, np.float32)[None, :], format="fltp", layout="mono"
    )
    frame.sample_rate = sample_rate_hz
    collector = _Collector(max_seconds)
    collector.add(frame)
    return collector.result()


def _declared_seconds(stream: av.stream.Stream, container: av.container.InputContainer) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None


# -- video ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VideoInfo:
    total_frames: int
    fps: float
    height: int
    width: int


def probe_video(data: bytes, max_seconds: float, max_input_pixels: int) -> VideoInfo:
    """Frame count (by demuxing, no decode), rate and size of a video file; limits checked."""
    with _open(data, "video") as container:
        names = _format_names(container)
        if "image2" in names or any(n.endswith("_pipe") for n in names):
            raise MediaError(f"{container.format.name!r} is an image format, not a video")
        if not container.streams.video:
            raise MediaError("no video stream in the file")
        stream = _codec_checked(container.streams.video[0], "video")
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        fps = float(rate) if isinstance(rate, Fraction | int | float) and rate else 0.0
        if fps <= 0:
            raise MediaError("video has no frame rate")
        declared = _declared_seconds(stream, container)
        if declared is not None and declared > max_seconds:
            raise MediaError(
                f"video is {declared:.1f} s long; the limit is {max_seconds:g} s (encoder.max_video_seconds)"
            )
        width, height = stream.codec_context.width, stream.codec_context.height
        check_frame_size("video", width, height, max_input_pixels)
        listed = stream.frames  # from the container's index (0 when it has none)
        try:
            total = sum(1 for packet in container.demux(stream) if packet.size)
        except av.error.FFmpegError as exc:
            raise MediaError(f"corrupt video: {exc.strerror or exc}") from None
    if listed and total < listed:
        raise MediaError(f"truncated video: the container lists {listed} frames, {total} are present")
    if total / fps > max_seconds:
        raise MediaError(
            f"video is {total / fps:.1f} s long; the limit is {max_seconds:g} s (encoder.max_video_seconds)"
        )
    return VideoInfo(total, fps, height, width)


def decode_video_frames(data: bytes, indices: list[int], size: tuple[int, int]) -> list[Image.Image]:
    """The frames at `indices` (sorted), each resized to `size` (h, w) with PIL bicubic."""
    h, w = size
    wanted = set(indices)
    last = max(indices)
    frames: list[Image.Image] = []
    with _open(data, "video") as container:
        stream = _codec_checked(container.streams.video[0], "video")
        stream.thread_type = "AUTO"
        try:
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    frames.append(frame.to_image().resize((w, h), resample=Image.Resampling.BICUBIC))
                if i >= last:
                    break
        except av.error.FFmpegError as exc:
            raise MediaError(f"corrupt video: {exc.strerror or exc}") from None
    if len(frames) < len(indices):
        raise MediaError(
            f"corrupt or truncated video: decoded {len(frames)} of the {len(indices)} sampled frames"
        )
    return frames
