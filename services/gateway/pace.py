"""The thinker's pace: seconds per engine step at each batch size, measured, and what a request costs."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

# (batch, seconds per step, tokens of context per sequence): one measurement of the thinker's pace.
Measurement = tuple[int, float, float]

# The weight of the newest measurement in a batch size's running mean.
_EWMA_WEIGHT = 0.2
# Prompt tokens one prefill step takes (chunked prefill), and characters per token: a request's
# prefill is counted as ceil(chars / (CHARS_PER_TOKEN * PREFILL_TOKENS_PER_STEP)) steps.
PREFILL_TOKENS_PER_STEP = 256
CHARS_PER_TOKEN = 3
# Steps an answer's meter measures before it reports (and starts a new measurement): the live pace.
LIVE_STEPS = 16


class PaceMeter:
    """One answer's steps as they stream: the step time between its first and last token, and the
    context (prompt and tokens so far) its steps ran at."""

    def __init__(self, prompt_tokens: int = 0) -> None:
        self.prompt_tokens = prompt_tokens
        self.first: float | None = None
        self.last = 0.0
        self.steps = 0
        self.produced = 0  # tokens of the answer so far
        self.batches: list[int] = []
        self.contexts: list[int] = []

    def tokens(self, now: float, count: int, batch: int) -> Measurement | None:
        """`count` tokens arrived at `now` while `batch` requests ran in the thinker. Every LIVE_STEPS
        steps, the measurement so far (a new one starts at `now`): the pace follows live steps, not
        only finished answers (a first burst is judged by what its first steps took)."""
        if count <= 0:
            return None
        if self.first is None:
            self.first = now
        else:
            self.steps += count
        self.produced += count
        self.last = now
        self.batches.append(batch)
        self.contexts.append(self.prompt_tokens + self.produced)
        if self.steps < LIVE_STEPS:
            return None
        measured = self.measured()
        self.first, self.steps, self.batches, self.contexts = now, 0, [batch], [self.contexts[-1]]
        return measured

    def measured(self) -> Measurement | None:
        """(mean batch, seconds per step, mean context), or None with fewer than two tokens."""
        if self.first is None or self.steps < 1 or self.last <= self.first:
            return None
        batch = round(sum(self.batches) / len(self.batches))
        return batch, (self.last - self.first) / self.steps, sum(self.contexts) / len(self.contexts)


class StepPace:
    """Measured seconds per thinker step, by the number of requests in the batch and the context (tokens
    per sequence) they run at: a step attends over every sequence's context, so it grows with both."""

    def __init__(self) -> None:
        self._batches: list[int] = []  # sorted batch sizes with a measurement
        self._step_s: dict[int, float] = {}
        self._context: dict[int, float] = {}  # the context each batch size's step time was measured at
        self._first_context: dict[int, float] = {}  # ... and its first measurement (the start-up stress)
        # How a step grows with context (the thinker's timed decode steps): at `batch` sequences, the part
        # of its time at a short context that a token more of every sequence adds; None: flat.
        self._growth: tuple[int, float] | None = None

    @property
    def known(self) -> bool:
        return bool(self._batches)

    def observe(self, batch: int, step_s: float, context: float = 0.0) -> None:
        """One measurement: `step_s` seconds per step while `batch` requests ran at `context` tokens each."""
        if batch < 1 or not math.isfinite(step_s) or step_s <= 0:
            return
        if batch in self._step_s:
            self._step_s[batch] += _EWMA_WEIGHT * (step_s - self._step_s[batch])
            self._context[batch] += _EWMA_WEIGHT * (max(0.0, context) - self._context[batch])
        else:
            bisect.insort(self._batches, batch)
            self._step_s[batch] = step_s
            self._context[batch] = self._first_context[batch] = max(0.0, context)

    def observe_growth(self, batch: int, short: tuple[float, float], long: tuple[float, float]) -> None:
        """Two step times of one batch, each (context, seconds): its growth per token of context of every
        sequence, relative to its time at the short context (a host slower while both were timed, as a
        CPU shared with the other stages' start-up, grows both alike); never below 0."""
        (c0, s0), (c1, s1) = short, long
        if batch >= 1 and c1 > c0 and s0 > 0 and math.isfinite(s1):
            self._growth = (batch, max(0.0, s1 / s0 - 1) / (c1 - c0))

    @property
    def per_context_token_s(self) -> float:
        """Seconds a step grows per token of context of one of its sequences: the thinker's relative
        growth times this gateway's own measured step at that batch, taken back to the short context of
        its first measurement, the start-up stress's (live steps at a longer context, which the growth
        explains, do not steepen it). That step holds what the engine adds to a forward too: a slight
        overestimate, the safe side. 0 while either is unknown."""
        if self._growth is None or not self._batches:
            return 0.0
        batch, relative = self._growth

        def at_short(measured: int, _: int) -> float:
            grown = max(0.0, self._context[measured] - self._first_context[measured])
            return self._step_s[measured] / (1 + relative * grown)

        return relative * self._interpolated(batch, at_short) / batch

    def step_s(self, batch: int, context: float = 0.0) -> float | None:
        """Seconds per step at `batch` with sequences of `context` tokens (None before any measurement):
        a measured size's step grown by what its sequences' context passes the context it was measured at."""
        if not self._batches:
            return None
        slope = self.per_context_token_s

        def at(measured: int, batch: int) -> float:
            grown = max(0.0, context - self._context[measured])
            return self._step_s[measured] + slope * min(batch, measured) * grown

        return self._interpolated(max(1, batch), at)

    def _interpolated(self, batch: int, at: Callable[[int, int], float]) -> float:
        """`at(measured size, batch)` at `batch`: linear between the measured sizes around it, in
        proportion to the batch beyond the largest (pessimistic)."""
        i = bisect.bisect_left(self._batches, batch)
        if i < len(self._batches) and self._batches[i] == batch:
            return at(batch, batch)
        if i == 0:
            return at(self._batches[0], batch)
        lo = self._batches[i - 1]
        if i == len(self._batches):
            return at(lo, batch) * batch / lo
        hi = self._batches[i]
        frac = (batch - lo) / (hi - lo)
        return at(lo, lo) + frac * (at(hi, hi) - at(lo, lo))

    def work_s(self, tokens: int, prompt_chars: int, batch: int) -> float | None:
        """Seconds a request of `tokens` and a prompt of `prompt_chars` takes in a batch of `batch`, each
        step at the mean context of its answer (its prompt and half its tokens; its batch alike)."""
        prompt = prompt_chars / CHARS_PER_TOKEN
        step = self.step_s(batch, prompt + max(1, tokens) / 2)
        if step is None:
            return None
        prefill = math.ceil(prompt_chars / (CHARS_PER_TOKEN * PREFILL_TOKENS_PER_STEP))
        return (max(1, tokens) + prefill) * step
