"""PCM16 mono rate conversion for the Realtime endpoint, chunk by chunk.

The project's resampler is FFmpeg's libswresample (through PyAV, as the encoder and talker use it): a
band-limited resampler that keeps its filter state between chunks, so a stream converted in pieces
sounds as if converted whole.
"""

from __future__ import annotations

import av
import numpy as np


class Pcm16Resampler:
    """PCM16 mono bytes at `from_rate` in, PCM16 mono bytes at `to_rate` out (same rate: as is)."""

    def __init__(self, from_rate: int, to_rate: int) -> None:
        self.from_rate, self.to_rate = from_rate, to_rate
        self._resampler = (
            av.AudioResampler(format="s16", layout="mono", rate=to_rate) if from_rate != to_rate else None
        )

    def convert(self, pcm16: bytes) -> bytes:
        if self._resampler is None or not pcm16:
            return pcm16
        samples = np.frombuffer(pcm16[: len(pcm16) // 2 * 2], dtype="<i2")
        frame = av.AudioFrame.from_ndarray(samples[None, :], format="s16", layout="mono")
        frame.sample_rate = self.from_rate
        return b"".join(out.to_ndarray().astype("<i2").tobytes() for out in self._resampler.resample(frame))

    def flush(self) -> bytes:
        """What the filter still holds (the end of the stream)."""
        if self._resampler is None:
            return b""
        return b"".join(out.to_ndarray().astype("<i2").tobytes() for out in self._resampler.resample(None))
