"""The talker's English numbers in words are inflect's, word for word (the official Ming code spells
them with inflect): every number to 100,000, random ones to 10^15 and to inflect's last scale, ordinals,
decimals, and whole texts through `spell_numbers` against the inflect-based code it replaced."""

from __future__ import annotations

import random
import re

import pytest
import typeguard
from omnistage.services.talker.spoken_numbers import cardinal, number_words, ordinal, spell_numbers


def _import_inflect_unchecked():
    """inflect without its argument checks: its `@typechecked` methods each re-parse and re-compile the
    whole inflect source at import (~4 s of CPU, at the suite's collection) and check every call (the
    loops here would take three times as long); the checks change no answer."""
    checked = typeguard.typechecked
    typeguard.typechecked = lambda target=None, **_: target if target is not None else (lambda t: t)
    try:
        import inflect
    finally:
        typeguard.typechecked = checked
    return inflect


inflect = _import_inflect_unchecked()
ENGINE = inflect.engine()


def inflect_cardinal(n: int) -> str:
    return ENGINE.number_to_words(n, andword="")


def inflect_number_words(number: str) -> str:
    """What the talker said before (services/talker/text_segment.py with inflect)."""
    whole, _, frac = number.partition(".")
    words = ENGINE.number_to_words(int(whole), andword="") if int(whole) else "zero"
    if frac:
        words += " point " + " ".join(ENGINE.number_to_words(int(d)) if d != "0" else "zero" for d in frac)
    return words


def inflect_spell_numbers(text: str) -> str:
    """The talker's spell_numbers as it was, on inflect."""
    names = {"$": "dollar", "£": "pound", "€": "euro"}

    def currency(m: re.Match) -> str:
        name = names[m.group(1)]
        return f"{inflect_number_words(m.group(2))} {name if m.group(2) == '1' else name + 's'}"

    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    text = re.sub(r"([$£€])(\d+(?:\.\d+)?)", currency, text)
    text = re.sub(r"(\d+(?:\.\d+)?)%", lambda m: f"{inflect_number_words(m.group(1))} percent", text)
    text = re.sub(
        r"\b(\d+)(st|nd|rd|th)\b",
        lambda m: ENGINE.ordinal(ENGINE.number_to_words(int(m.group(1)), andword="")),
        text,
    )
    text = re.sub(r"\d+(?:\.\d+)?", lambda m: inflect_number_words(m.group(0)), text)
    return re.sub(r"\s+", " ", text).strip()


def _mismatches(numbers) -> list[tuple[int, str, str]]:
    out = []
    for n in numbers:
        want = inflect_cardinal(n)
        if cardinal(str(n)) != want or ordinal(want) != ENGINE.ordinal(want):
            out.append((n, cardinal(str(n)), want))
    return out


def test_every_number_to_100000_and_its_ordinal_are_inflects():
    assert _mismatches(range(100_001)) == []


def test_random_large_numbers_are_inflects():
    rng = random.Random(42)
    numbers = [rng.randrange(10**15) for _ in range(5000)]
    numbers += [rng.randrange(10 ** rng.randrange(16, 37)) for _ in range(2000)]  # up to decillions
    # Round ones: the zero groups and one-word last groups ('one million twenty').
    numbers += [
        rng.choice((1, 20, 300, 21, 7)) * 10 ** rng.randrange(0, 34) + rng.randrange(30) for _ in range(2000)
    ]
    numbers += [10**k for k in range(36)] + [10**k - 1 for k in range(1, 37)]
    assert _mismatches(numbers) == []


def test_digit_strings_decimals_and_leading_zeros_are_inflects():
    rng = random.Random(7)
    numbers = ["0", "00", "007", "0.5", "10.01", "3.14159", "1000.000", "12.0"]
    numbers += [
        f"{rng.randrange(10 ** rng.randrange(1, 13))}.{rng.randrange(10**6):0{rng.randrange(1, 7)}d}"
        for _ in range(2000)
    ]
    assert [n for n in numbers if number_words(n) != inflect_number_words(n)] == []


def test_whole_texts_read_as_before():
    rng = random.Random(3)
    pieces = ["$", "£", "€", "%", "st", "nd", "rd", "th", ",", ".", " ", " apples ", "x"]

    def text() -> str:
        out = []
        for _ in range(rng.randrange(1, 12)):
            out.append(str(rng.randrange(10 ** rng.randrange(1, 10))))
            out.append(rng.choice(pieces))
        return "".join(out)

    texts = [text() for _ in range(3000)] + [
        "It costs $1,250 today.",
        "Up 12.5% on the 2nd day, the 21st, 101st and 112th of 1,000,000.",
        "£1 only, €2.50 or $0.99",
    ]
    assert [t for t in texts if spell_numbers(t) != inflect_spell_numbers(t)] == []


def test_beyond_inflects_last_scale_the_digits_are_read_one_by_one():
    with pytest.raises(inflect.NumOutOfRangeError):
        inflect_cardinal(10**36)  # inflect has no answer here: the stream would fail
    assert cardinal(str(10**36)) == "one " + " ".join(["zero"] * 36)
    assert spell_numbers("9" * 5000).split() == ["nine"] * 5000  # past int()'s digit limit too
