"""Stop strings over streamed text: emit what cannot be part of a stop string, hold back the rest.

A stop string may straddle deltas ("</" then "end>"), so a tail of the text that is a prefix of any
stop string waits for the next delta. The stop string itself is never emitted.
"""

from __future__ import annotations


class StopStringMatcher:
    """Feed text deltas; get back the text safe to emit, and whether a stop string matched."""

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        text = self.pending + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.pending = ""
            return text[: min(hits)]
        hold = self._partial_suffix_len(text)
        self.pending = text[len(text) - hold :]
        return text[: len(text) - hold]

    def flush(self) -> str:
        """Release held-back text when the request ends for another reason."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

    def _partial_suffix_len(self, text: str) -> int:
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best
