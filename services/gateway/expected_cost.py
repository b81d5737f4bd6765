"""What a text request is expected to cost the thinker, and what its joining costs the others."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

# Finished answers remembered per kind, how many must have finished before they set the price, and
# the quantile of their lengths a new request is priced at.
WINDOW = 64
MIN_FINISHED = 8
QUANTILE = 0.9


# Seconds a thinker step takes at (batch, tokens of context per sequence); None while unmeasured.
StepTime = Callable[[int, float], float | None]
# An admitted request a newcomer would make late: it, seconds until it is done now, its step now and joined.
Slowed = tuple["TextRequest", float, float, float]


class OutputLengths:
    """Tokens that finished answers of each kind produced (the newest WINDOW of each)."""

    def __init__(self) -> None:
        self._finished: dict[Hashable, deque[tuple[int, bool]]] = {}

    def observe(self, kind: Hashable, tokens: int, capped: bool) -> None:
        """An answer of `kind` finished with `tokens`; `capped`: its max_tokens (or the context) ended it."""
        self._finished.setdefault(kind, deque(maxlen=WINDOW)).append((max(0, tokens), capped))

    def expected(self, kind: Hashable, cap: int) -> int:
        """Tokens a new answer of `kind` with `cap` (its max_tokens) is priced at: the QUANTILE of what
        finished ones produced, within the cap; the cap itself while fewer than MIN_FINISHED finished."""
        finished = self._finished.get(kind)
        if finished is None or len(finished) < MIN_FINISHED:
            return cap
        # A capped answer would have gone on: for this cap it counts as all of it.
        lengths = sorted(cap if capped and tokens < cap else min(tokens, cap) for tokens, capped in finished)
        return max(1, lengths[min(len(lengths) - 1, math.ceil(QUANTILE * len(lengths)) - 1)])


@dataclass
class TextRequest:
    """One admitted text request: when it must be done and what it is expected to produce."""

    deadline: float | None  # monotonic seconds; None: no deadline
    expected: int  # tokens
    prompt_tokens: float = 0.0
    produced: int = 0

    def left(self) -> int:
        return max(1, self.expected - self.produced)

    def context(self) -> float:
        """Tokens of context per step over the rest of its answer, on average."""
        return self.prompt_tokens + (self.produced + max(self.produced, self.expected)) / 2


class AdmittedText:
    """The text requests admitted and not ended yet (Generate's answers), for the cost of joining them."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.requests: list[TextRequest] = []

    def add(self, remaining_s: float | None, expected: int, prompt_tokens: float = 0.0) -> TextRequest:
        """Count one admitted request (its admission ticket removes it); `produced` is the ticket's to count."""
        deadline = None if remaining_s is None else self.clock() + remaining_s
        request = TextRequest(deadline, expected, prompt_tokens)
        self.requests.append(request)
        return request

    def remove(self, request: TextRequest) -> None:
        self.requests.remove(request)

    def slowed_late(self, step_s: StepTime, batch: int) -> Slowed | None:
        """An admitted request that finishes in time at `step_s(batch, its context)` seconds a step but
        not with one more in the batch: (it, the seconds until it is done at today's batch (the retry
        hint), the step now, the step joined); None when every one that can still make it still does."""
        now = self.clock()
        for request in self.requests:
            if request.deadline is None:
                continue
            step_now, step_joined = step_s(batch, request.context()), step_s(batch + 1, request.context())
            if step_now is None or step_joined is None:
                return None
            left = request.deadline - now
            if request.left() * step_now <= left < request.left() * step_joined:
                return request, request.left() * step_now, step_now, step_joined
        return None
