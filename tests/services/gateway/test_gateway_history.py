"""Converse history: at most max_turns user turns kept; each prompt's window is the newest turns that fit
the prompt characters and one encoder request (bytes, items), the turn being answered always."""

from __future__ import annotations

from omnistage.services.gateway.history import Entry, History
from omnistage.services.gateway.prompt import AnswerTokens, MediaSlot, Turn

BIG = 1 << 30


def users(window) -> list:
    return [t.content for t in window.turns if t.role == "user"]


def test_at_most_max_turns_user_turns_are_kept_and_empty_answers_are_not():
    history = History(
        [Entry("assistant", "Hi, I am here."), Entry("user", "a"), Entry("assistant", "A")], max_turns=2
    )
    history.add(Entry("user", "b"))
    history.add(Entry("assistant", ""))
    history.add(Entry("user", "c"))
    assert [(e.role, e.text) for e in history.entries] == [("user", "b"), ("user", "c")]


def test_the_window_drops_the_oldest_turns_until_the_prompt_fits():
    history = History(
        [Entry("user", "x" * 100), Entry("assistant", "y" * 100), Entry("user", "short")], max_turns=8
    )
    assert users(history.window("S", BIG, BIG, 16)) == ["x" * 100, "short"]
    assert users(history.window("S", 150, BIG, 16)) == ["short"]
    assert users(history.window("S", 1, BIG, 16)) == ["short"]  # the turn being answered, whatever its size


def test_spoken_turns_are_audio_slots_within_the_encoders_bytes_and_items():
    history = History([], max_turns=8)
    for i in range(3):
        history.add(Entry("user", pcm16=b"w" * 100, sample_rate_hz=16000, index=i))
        history.add(Entry("assistant", f"answer {i}"))
    history.add(Entry("user", "and now?"))
    window = history.window("S", BIG, BIG, 16)
    assert window.turns[0] == Turn("user", (MediaSlot("audio", 0),))
    assert [where for where, _ in window.spoken()] == ["audio (turn 0)", "audio (turn 1)", "audio (turn 2)"]
    assert len(history.window("S", BIG, 250, 16).audio) == 2
    assert len(history.window("S", BIG, BIG, 1).audio) == 1
    assert history.window("S", BIG, BIG, 1).turns[0].content == (MediaSlot("audio", 0),)  # renumbered from 0


def test_forget_oldest_drops_one_exchange_and_keeps_the_last_turn():
    history = History([Entry("user", "a"), Entry("assistant", "A"), Entry("user", "b")], max_turns=8)
    assert history.forget_oldest() and [e.text for e in history.entries] == ["b"]
    assert not history.forget_oldest() and [e.text for e in history.entries] == ["b"]


def test_an_answer_with_token_ids_goes_back_as_tokens_and_one_without_as_text():
    history = History(
        [
            Entry("user", "a"),
            Entry("assistant", "Ok.", token_ids=(7, 8)),
            Entry("user", "b"),
            Entry("assistant", "Cut"),
            Entry("user", "c"),
        ],
        max_turns=8,
    )
    window = history.window("S", BIG, BIG, 16)
    answers = [t.content for t in window.turns if t.role == "assistant"]
    assert answers == [(AnswerTokens((7, 8), "Ok."),), "Cut"]
