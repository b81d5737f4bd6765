"""Text segmentation for TTS (ming.md §5.5): early first segment, sentence cuts, length bound, numbers."""

from __future__ import annotations

import pytest
from omnistage.common.config import TalkerConfig
from omnistage.services.talker.text_segment import (
    SentenceSegmenter,
    cut_by_length,
    semantic_length,
    spell_numbers,
)

TEXT = (
    "Well, I think so, my friend, and here is why. The plan has three parts; each one matters. "
    "今天天气很好，我们去公园散步吧。然后回家。Done!"
)


def segments(text: str, step: int, cfg: TalkerConfig | None = None) -> list[str]:
    seg = SentenceSegmenter(cfg)
    out = []
    for i in range(0, len(text), step):
        out += seg.push(text[i : i + step])
    return out + seg.flush()


def test_the_first_segment_ends_at_a_clause_later_ones_at_sentences():
    out = segments(TEXT, 1000)
    assert out[0] == "Well, I think so,"  # 8+ pieces (words, spaces, marks), then the first clause mark
    assert out[1] == "my friend, and here is why."  # ',' no longer ends a segment
    assert out[2] == "The plan has three parts; each one matters."
    # the CJK comma is in the sentence set (the reference's); the space before 今 is the 8th piece
    assert out[3:] == ["今天天气很好，", "我们去公园散步吧。", "然后回家。Done!"]


@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_cut_like_the_whole_text(step):
    assert segments(TEXT, step) == segments(TEXT, len(TEXT))


def test_nothing_is_cut_before_enough_pieces_or_inside_a_number():
    seg = SentenceSegmenter()
    assert seg.push("Pi is 3.14 and e is 2.") == []  # '.' after a digit does not end a sentence
    assert seg.push(" Yes!") == ["Pi is three point one four and e is two. Yes!"]
    assert seg.flush() == []


def test_run_on_text_is_cut_and_every_piece_is_bounded():
    text = "word " * 230
    out = segments(text, 11, TalkerConfig(max_segment_length=50))
    assert sum(semantic_length(s) for s in out) == 230
    assert all(semantic_length(s) <= 50 for s in out)


def test_long_sentences_are_cut_at_clauses_then_words():
    long = "one two three four five six, seven eight nine ten, " * 6 + "end."
    pieces = cut_by_length(long, 12)
    assert all(semantic_length(p) <= 12 for p in pieces)
    assert " ".join(pieces).split() == long.split()
    assert pieces[0] == "one two three four five six, seven eight nine ten,"


def test_text_without_letters_gives_no_segment():
    assert segments("... !!! ,,, \n\n", 2) == []


@pytest.mark.parametrize(
    ("text", "spoken"),
    [
        ("I have 3 cats.", "I have three cats."),
        ("It costs $1,250 today.", "It costs one thousand, two hundred fifty dollars today."),
        ("Up 12.5% on the 2nd day", "Up twelve point five percent on the second day"),
        ("£1 only", "one pound only"),
    ],
)
def test_english_numbers_are_spelled_out(text, spoken):
    assert spell_numbers(text) == spoken


def test_cjk_fragments_keep_their_digits():
    assert segments("我家里有3只小猫，它们都很可爱。", 100) == ["我家里有3只小猫，", "它们都很可爱。"]
