"""The thinker's pace: seconds per engine step at each batch size, measured, and what a request costs."""

from __future__ import annotations

import bisect
import math

# The weight of the newest measurement in a batch size's running mean.
_EWMA_WEIGHT = 0.2
# Prompt tokens one prefill step takes (chunked prefill), and characters per token: a request's
# prefill is counted as ceil(chars / (CHARS_PER_TOKEN * PREFILL_TOKENS_PER_STEP)) steps.
PREFILL_TOKENS_PER_STEP = 256
CHARS_PER_TOKEN = 3
# Steps an answer's meter measures before it reports (and starts a new measurement): the live pace.
LIVE_STEPS = 16


class PaceMeter:
    """One answer's steps as they stream: the step time between its first and last token."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last = 0.0
        self.steps = 0
        self.batches: list[int] = []

    def tokens(self, now: float, count: int, batch: int) -> tuple[int, float] | None:
        """`count` tokens arrived at `now` while `batch` requests ran in the thinker. Every LIVE_STEPS
        steps, the measurement so far (a new one starts at `now`): the pace follows live steps, not
        only finished answers (a first burst is judged by what its first steps took)."""
        if count <= 0:
            return None
        if self.first is None:
            self.first = now
        else:
            self.steps += count
        self.last = now
        self.batches.append(batch)
        if self.steps < LIVE_STEPS:
            return None
        measured = self.measured()
        self.first, self.steps, self.batches = now, 0, [batch]
        return measured

    def measured(self) -> tuple[int, float] | None:
        """(mean batch, seconds per step), or None with fewer than two tokens."""
        if self.first is None or self.steps < 1 or self.last <= self.first:
            return None
        return round(sum(self.batches) / len(self.batches)), (self.last - self.first) / self.steps


class StepPace:
    """Measured seconds per thinker step, by the number of requests in the batch."""

    def __init__(self) -> None:
        self._batches: list[int] = []  # sorted batch sizes with a measurement
        self._step_s: dict[int, float] = {}

    @property
    def known(self) -> bool:
        return bool(self._batches)

    def observe(self, batch: int, step_s: float) -> None:
        """One measurement: `step_s` seconds per step while `batch` requests ran."""
        if batch < 1 or not math.isfinite(step_s) or step_s <= 0:
            return
        if batch in self._step_s:
            self._step_s[batch] += _EWMA_WEIGHT * (step_s - self._step_s[batch])
        else:
            bisect.insort(self._batches, batch)
            self._step_s[batch] = step_s

    def step_s(self, batch: int) -> float | None:
        """Seconds per step at `batch` (None before any measurement)."""
        if not self._batches:
            return None
        batch = max(1, batch)
        i = bisect.bisect_left(self._batches, batch)
        if i < len(self._batches) and self._batches[i] == batch:
            return self._step_s[batch]
        if i == 0:
            return self._step_s[self._batches[0]]
        lo = self._batches[i - 1]
        if i == len(self._batches):
            return self._step_s[lo] * batch / lo
        hi = self._batches[i]
        frac = (batch - lo) / (hi - lo)
        return self._step_s[lo] + frac * (self._step_s[hi] - self._step_s[lo])

    def work_s(self, tokens: int, prompt_chars: int, batch: int) -> float | None:
        """Seconds a request of `tokens` and a prompt of `prompt_chars` takes in a batch of `batch`."""
        step = self.step_s(batch)
        if step is None:
            return None
        prefill = math.ceil(prompt_chars / (CHARS_PER_TOKEN * PREFILL_TOKENS_PER_STEP))
        return (max(1, tokens) + prefill) * step
