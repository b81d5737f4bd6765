"""Real-time pacing of a spoken stream: its audio kept at most a lead ahead of its listener."""

from __future__ import annotations

import math


class StreamPace:
    """One stream's audio clock; the device thread alone calls `advance` (after a step's audio)."""

    def __init__(self, lead_s: float, sample_rate: int) -> None:
        self.lead_s = lead_s
        self.sample_rate = sample_rate
        self.origin: float | None = None  # when its first audio came out (monotonic seconds)
        self.samples = 0

    def advance(self, samples: int, now: float) -> None:
        if self.origin is None and samples:
            self.origin = now
        self.samples += samples

    def runs_out_at(self) -> float:
        """When a listener who started at its first audio runs out of what was made (monotonic s)."""
        if self.origin is None:
            return -math.inf
        return self.origin + self.samples / self.sample_rate

    def ahead_s(self, now: float) -> float:
        """Seconds of audio made beyond what a listener who started at its first audio has heard."""
        if self.origin is None:
            return -math.inf
        return self.samples / self.sample_rate - (now - self.origin)

    def due(self, now: float) -> bool:
        return self.ahead_s(now) < self.lead_s

    def may_join(self, now: float) -> bool:
        return self.ahead_s(now) < 2 * self.lead_s

    def due_in(self, now: float) -> float:
        """Seconds until `due` (0 when it is)."""
        return max(0.0, self.ahead_s(now) - self.lead_s)
