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


# The reference's rules alone (the first segment waits for a mark): what the mark tests check.
UNBOUNDED = TalkerConfig(first_segment_max_pieces=0, first_segment_max_wait_s=0)


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
    seg = SentenceSegmenter(UNBOUNDED)
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
    assert segments("我家里有3只小猫，它们都很可爱。", 100, UNBOUNDED) == [
        "我家里有3只小猫，",
        "它们都很可爱。",
    ]


# -- the first segment's bound: the first audio never waits for punctuation --------------------------

BOUNDED = TalkerConfig(first_segment_max_pieces=10, first_segment_max_wait_s=0)


def test_unpunctuated_text_gives_a_first_segment_of_the_bound_in_words():
    text = " ".join(f"word{chr(97 + i % 26)}" for i in range(40)) + " end"
    out = segments(text, 3, BOUNDED)
    assert out[0].split() == text.split()[:10]  # cut at the word boundary where it reached 10 words
    assert " ".join(out).split() == text.split()  # nothing lost, nothing repeated
    assert all(semantic_length(s) <= 50 for s in out)


def test_a_mark_before_the_bound_still_ends_the_first_segment_and_later_ones_keep_the_rules():
    out = segments(
        "Well, I think so, my friend, and here is why it matters so much to all of us.", 2, BOUNDED
    )
    assert out[0] == "Well, I think so,"
    # the second segment ends at the sentence mark only, however many words it holds
    assert out[1] == "my friend, and here is why it matters so much to all of us."


def test_the_bound_counts_cjk_characters_and_numbers_as_words():
    out = segments("今天天气很好我们去公园散步然后回家吃饭", 1, BOUNDED)
    assert out[0] == "今天天气很好我们去公" and "".join(out) == "今天天气很好我们去公园散步然后回家吃饭"
    out = segments("it is 3.14 and 2.71 and 1.41 and 42 or 7 and more text here", 4, BOUNDED)
    # numbers are single words, never split at their decimal point; English ones are spelled out
    assert out[0] == spell_numbers("it is 3.14 and 2.71 and 1.41 and 42 or")


def test_a_word_still_growing_is_not_cut_by_the_bound():
    seg = SentenceSegmenter(BOUNDED)
    assert seg.push("a b c d e f g h i jump") == []  # 'jump' may go on ('jumping'): 9 whole words
    assert seg.push("ing on") == ["a b c d e f g h i jumping"]


def test_the_time_limit_cuts_the_first_segment_at_its_last_whole_word():
    seg = SentenceSegmenter(TalkerConfig(first_segment_max_pieces=0, first_segment_max_wait_s=0.25))
    assert seg.deadline() is None  # no text yet: no wait running
    assert seg.push("Hello there my fri", now=100.0) == []
    assert seg.deadline() == 100.25
    assert seg.due(100.2) == []  # not yet
    assert seg.due(100.3) == ["Hello there my"]  # 'fri' may still grow: it stays for the next segment
    assert seg.deadline() is None  # only the first segment has a time limit
    assert seg.push("end, and on it goes. ") == ["friend, and on it goes."]


def test_the_time_limit_waits_for_a_word():
    seg = SentenceSegmenter(TalkerConfig(first_segment_max_wait_s=0.25))
    assert seg.push("  ", now=0.0) == []
    assert seg.due(1.0) == []  # nothing speakable to cut yet
    assert seg.push("Yes ", now=1.0) == [] and seg.due(1.0) == ["Yes"]


def test_zero_turns_the_bounds_off():
    cfg = TalkerConfig(first_segment_max_pieces=0, first_segment_max_wait_s=0)
    seg = SentenceSegmenter(cfg)
    assert seg.push("word " * 60, now=0.0) == [] and seg.due(99.0) == []


# What SegmentDone.text_end says: where each segment ends in the stream's text (a moved stream goes on
# from there). No numbers here: the text between two ends is then the segment, up to spaces.
ENDS_TEXT = (
    "Well, I think so, my friend, and here is why.\n\nThe plan has three parts; each one matters. "
    + "A long run of words without a single mark in it "
    + "and so on " * 40
    + "until the end. 今天天气很好，我们去公园散步吧。Done, that is all. :)"
)


@pytest.mark.parametrize("step", [1, 3, 7, len(ENDS_TEXT)])
def test_each_segment_ends_where_its_text_ends_in_the_stream(step):
    out = segments(ENDS_TEXT, step)
    assert (
        len(out) > 6 and out[-1] == "Done, that is all."
    )  # a sentence past the length bound was cut in fragments
    start = 0
    for segment in out:
        assert " ".join(ENDS_TEXT[start : segment.text_end].split()) == " ".join(segment.split()), segment
        start = segment.text_end
    assert ENDS_TEXT[start:] == " :)"  # nothing speakable after the last end
    assert [s.text_end for s in out] == [s.text_end for s in segments(ENDS_TEXT, len(ENDS_TEXT))]


def test_a_segment_with_spelled_numbers_ends_after_its_digits():
    seg = SentenceSegmenter(UNBOUNDED)
    assert seg.push("It costs $42 today. And") == ["It costs forty-two dollars today."]
    out = seg.flush()
    assert out == ["And"] and [s.text_end for s in out] == [len("It costs $42 today. And")]


def test_a_fragment_that_ends_inside_a_word_is_taken_to_end_before_it():
    """The length bound cuts between the units of one piece ("don't": "don", "'", "t"): the rest of the
    piece is not taken as spoken (a moved stream says the whole word again)."""
    cfg = TalkerConfig(
        max_segment_length=2, first_segment_max_pieces=0, first_segment_min_pieces=1, segment_min_pieces=1
    )
    seg = SentenceSegmenter(cfg)
    out = seg.push("well don't go there now.") + seg.flush()
    assert out == ["well don'", "t go", "there now."]
    assert [s.text_end for s in out] == [len("well "), len("well don't go"), len("well don't go there now.")]
