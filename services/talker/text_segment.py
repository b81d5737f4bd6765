"""Text to speakable segments, as text streams in (ming.md §5.5)."""

from __future__ import annotations

import bisect
import itertools
import re
import time

from omnistage.common.config import TalkerConfig
from omnistage.services.talker.spoken_numbers import spell_numbers

PIECE = re.compile(r"(?:[a-zA-Z]\.)+|[a-zA-Z]+(?:['\-][a-zA-Z]+)*|\d+(?:\.\d+)?|[\u4e00-\u9fff]|\s+|\S")
SENTENCE_MARKS = "。！？!?，"
CLAUSE_MARKS = ",;:；：、"
_CJK = re.compile(r"[\u4e00-\u9fff]")
_WORD = re.compile(r"[a-zA-Z]+")
_SPEAKABLE = re.compile(r"[0-9a-zA-Z\u4e00-\u9fff]")


def _may_grow(piece: str) -> bool:
    return piece[-1].isascii() and (piece[-1].isalnum() or piece[-1].isspace() or piece[-1] in ".'-")


def semantic_length(text: str) -> int:
    """CJK characters + English words (the unit of the reference's 50 limit)."""
    return len(_CJK.findall(text)) + len(_WORD.findall(text))


def speakable(text: str) -> bool:
    return bool(_SPEAKABLE.search(text))


class Segment(str):
    """A segment's text as the talker reads it, with `text_end`: the characters of the stream's text (all
    its deltas together) that it and the segments before it cover. A stream moved to another talker goes
    on from there (SegmentDone.text_end); never past text not spoken yet."""

    text_end: int

    def __new__(cls, text: str, text_end: int) -> Segment:
        segment = super().__new__(cls, text)
        segment.text_end = text_end
        return segment


class SentenceSegmenter:
    """`push(delta)` → the segments that became complete; `due(now)` → the first segment once its wait
    is over; `flush()` → the rest. Not thread-safe."""

    def __init__(self, cfg: TalkerConfig | None = None) -> None:
        # The talker's deploy-file keys own these limits (and their defaults).
        self.cfg = cfg or TalkerConfig()
        self._pieces: list[str] = []  # pieces of the open segment
        self._ends: list[int] = []  # where each of them ends in the stream's text
        self._start = 0  # where the open segment starts in the stream's text
        self._pushed = 0  # characters pushed in all
        self._words = 0  # speakable pieces among them
        self._tail = ""  # text not split into pieces yet (the last piece may still grow)
        self._first_text_at: float | None = None  # when the first segment's first text came
        self.segments_cut = 0

    def push(self, text: str, now: float | None = None) -> list[Segment]:
        """Add a delta; `now` (monotonic seconds) starts the first segment's wait at its first text."""
        if text and self._first_text_at is None and self.segments_cut == 0:
            self._first_text_at = time.monotonic() if now is None else now
        self._pushed += len(text)
        self._tail += text
        at = self._pushed - len(self._tail)  # where the tail starts (its pieces are all of it, in order)
        pieces = PIECE.findall(self._tail)
        if not pieces:
            return []
        keep = 0
        if _may_grow(pieces[-1]):  # may continue in the next delta ("Hel" + "lo", "3" + "." + "14")
            keep = 2 if pieces[-1] == "." and len(pieces) > 1 and pieces[-2][-1].isdigit() else 1
        self._tail = "".join(pieces[len(pieces) - keep :])
        del pieces[len(pieces) - keep :]
        return self._add_all(pieces, at)

    def deadline(self) -> float | None:
        """When `due` will cut the first segment (monotonic seconds), or None: no wait is running."""
        if self.segments_cut or self._first_text_at is None or self.cfg.first_segment_max_wait_s <= 0:
            return None
        return self._first_text_at + self.cfg.first_segment_max_wait_s

    def due(self, now: float) -> list[Segment]:
        """The first segment, cut at its last whole word, once its wait is over and it holds a word."""
        deadline = self.deadline()
        if deadline is None or now < deadline or not self._words:
            return []
        return self._cut()

    def flush(self) -> list[Segment]:
        out = self._add_all(PIECE.findall(self._tail), self._pushed - len(self._tail))
        self._tail = ""
        if self._pieces:
            out.extend(self._cut())
        return out

    def _add_all(self, pieces: list[str], at: int) -> list[Segment]:
        """Add `pieces`, the first starting at `at` in the stream's text."""
        out = []
        for piece in pieces:
            at += len(piece)
            out.extend(self._add(piece, at))
        return out

    def _add(self, piece: str, end: int) -> list[Segment]:
        if "\n" in piece:
            piece = " "
            if len(self._pieces) >= self._min_pieces():
                segments = self._cut()
                self._start = end  # the line break ends the segment: the next one starts after it
                return segments
        self._pieces.append(piece)
        self._ends.append(end)
        self._words += speakable(piece)
        first = self.segments_cut == 0
        marks = CLAUSE_MARKS + SENTENCE_MARKS if first else SENTENCE_MARKS
        ends = piece[-1] in marks or (piece == "." and not self._after_digit())
        if ends and len(self._pieces) >= self._min_pieces():
            return self._cut()
        if first and 0 < self.cfg.first_segment_max_pieces <= self._words and speakable(piece):
            return self._cut()  # a word just ended the bound: the first audio waits for no mark
        if semantic_length("".join(self._pieces)) >= 2 * self.cfg.max_segment_length and piece.isspace():
            return self._cut()
        return []

    def _after_digit(self) -> bool:
        return len(self._pieces) >= 2 and self._pieces[-2][-1:].isdigit()

    def _min_pieces(self) -> int:
        return self.cfg.first_segment_min_pieces if self.segments_cut == 0 else self.cfg.segment_min_pieces

    def _cut(self) -> list[Segment]:
        pieces, ends, start = self._pieces, self._ends, self._start
        joined = "".join(pieces)
        text = joined.strip()
        self._pieces, self._ends, self._start = [], [], ends[-1] if ends else start
        self._words = 0
        if not speakable(text):
            return []
        self.segments_cut += 1
        fragments = cut_by_length(text, self.cfg.max_segment_length)
        lead = len(joined) - len(joined.lstrip())
        return [
            Segment(normalize(f), end)
            for f, end in zip(fragments, _fragment_ends(pieces, ends, start, fragments, lead), strict=True)
        ]


def _fragment_ends(
    pieces: list[str], ends: list[int], start: int, fragments: list[str], at: int
) -> list[int]:
    """Where each fragment of a cut ends in the stream's text. The cut is `pieces` ("".join: the joined
    text; `ends`: where each ends in the stream's text, the first starting at `start`); its fragments
    are slices of it in order, from `at` on. A fragment that ends inside a piece ends, for this count,
    where that piece starts: the rest of the piece is never taken as spoken."""
    joined = "".join(pieces)
    bounds = list(itertools.accumulate(len(p) for p in pieces))  # where each piece ends in the joined text
    out = []
    for fragment in fragments:
        found = joined.find(fragment, at)
        if found < 0:  # not a slice (never expected): nothing more is taken as spoken
            out.append(out[-1] if out else start)
            continue
        at = found + len(fragment)
        k = bisect.bisect_left(bounds, at)  # the piece the fragment ends in
        out.append(ends[k] if bounds[k] == at else (ends[k - 1] if k else start))
    return out


def _split_after(text: str, marks: str) -> list[str]:
    parts, start = [], 0
    for i, ch in enumerate(text):
        if ch in marks and not (
            ch == "." and 0 < i < len(text) - 1 and text[i - 1].isdigit() and text[i + 1].isdigit()
        ):
            parts.append(text[start : i + 1])
            start = i + 1
    if start < len(text):
        parts.append(text[start:])
    return [p for p in parts if p.strip()]


def _words(text: str, max_length: int) -> list[str]:
    """A run with no mark, cut between CJK characters / English words."""
    out, current = [], ""
    for unit in re.findall(r"[\u4e00-\u9fff]|[a-zA-Z]+|[^a-zA-Z\u4e00-\u9fff]+", text):
        if current and semantic_length(current + unit) > max_length:
            out.append(current)
            current = ""
        current += unit
    return [*out, current] if current else out


def cut_by_length(text: str, max_length: int) -> list[str]:
    """Fragments of semantic length ≤ max_length: whole sentences or clauses where they fit, merged greedily."""
    if semantic_length(text) <= max_length:
        return [text.strip()]
    units: list[str] = []
    for sentence in _split_after(text, ".!?。！？"):
        if semantic_length(sentence) <= max_length:
            units.append(sentence)
            continue
        for clause in _split_after(sentence, ",;，；、"):
            units.extend([clause] if semantic_length(clause) <= max_length else _words(clause, max_length))
    fragments: list[str] = []
    for unit in units:
        if fragments and semantic_length(fragments[-1] + unit) <= max_length:
            fragments[-1] += unit
        else:
            fragments.append(unit)
    return [f.strip() for f in fragments if speakable(f)]


def normalize(fragment: str) -> str:
    """What the talker reads: English numbers spelled out (CJK text keeps its digits, as the reference)."""
    text = fragment.strip().lstrip("，,")
    return text if _CJK.search(text) else spell_numbers(text)
