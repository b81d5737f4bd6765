"""Trailing-silence trimming of one segment's audio stream (ming.md §5.5, the reference's silence holder).

Audio is judged in 100 ms frames from the segment's start (silent: mean |x| ≤ 1e-3). A segment never
ends on a long silence: it keeps at most 0.3 s past its last loud frame. The reference holds every
silent frame (and a frame not whole yet) until sound follows; here what goes out whatever follows —
up to 0.3 s past the last loud frame heard so far — goes at once, so a segment's first chunk waits
neither for a loud frame nor for a whole one. Only silence beyond that is held, until sound follows
(then sent) or the segment ends (then dropped): the same samples as the reference's, in the same
order, sooner.
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
        # Samples past the last loud frame (from a frame boundary), judged again with what follows;
        # the first `_sent` of them went out already.
        self._held = np.zeros(0, np.float32)
        self._sent = 0

    def push(self, audio: np.ndarray, last: bool) -> np.ndarray:
        """Samples to send now for `audio` (the segment's next samples); `last` ends the segment."""
        buf = np.concatenate((self._held, audio)) if self._held.size else audio
        whole = buf.shape[0] // self.frame * self.frame
        loud = np.flatnonzero(np.abs(buf[:whole]).reshape(-1, self.frame).mean(axis=1) > self.threshold)
        cut = (int(loud[-1]) + 1) * self.frame if loud.size else 0  # past the last loud frame
        end = min(buf.shape[0], cut + self.keep_tail)  # sent whatever comes next
        out = buf[self._sent : end]
        if last:
            self._held, self._sent = np.zeros(0, np.float32), 0
        else:
            self._held, self._sent = buf[cut:], end - cut  # judged again with what follows
        return out
