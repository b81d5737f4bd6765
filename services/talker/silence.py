"""Trailing-silence trimming of one segment's audio stream (ming.md §5.5, the reference's silence holder).

Audio is judged in 100 ms frames (silent: mean |x| ≤ 1e-3). Silent frames are held back until
sound follows (then sent), so a segment never ends on a long silence: at its end at most 0.3 s of
the held silence is kept.
"""

from __future__ import annotations

import numpy as np


class SilenceTrimmer:
    def __init__(
        self, sample_rate: int, threshold: float = 1e-3, frame_s: float = 0.1, keep_tail_s: float = 0.3
    ):
        self.frame = max(1, int(sample_rate * frame_s))
        self.threshold = threshold
        self.keep_tail = int(sample_rate * keep_tail_s)
        self._held = np.zeros(0, np.float32)  # silent frames (and an incomplete frame) not sent yet

    def push(self, audio: np.ndarray, last: bool) -> np.ndarray:
        """Samples to send now for `audio` (the segment's next samples); `last` ends the segment."""
        buf = np.concatenate((self._held, audio)) if self._held.size else audio
        whole = buf.shape[0] // self.frame * self.frame
        loud = np.flatnonzero(np.abs(buf[:whole]).reshape(-1, self.frame).mean(axis=1) > self.threshold)
        cut = (int(loud[-1]) + 1) * self.frame if loud.size else 0
        if last:
            self._held = np.zeros(0, np.float32)
            return buf[: cut + self.keep_tail]
        self._held = buf[cut:]
        return buf[:cut]
