"""English numbers in words, as the talker reads them: the official Ming code spells them with inflect
(`number_to_words(n, andword="")`, `ordinal(...)`), and the spoken words must be the same.

Our own rather than inflect's: importing inflect cost ~4 s of CPU at every talker start (typeguard
instruments its functions at import), for these few rules. tests/services/talker/test_spoken_numbers.py
holds every function here to inflect's output (inflect is a test-only dependency).

One departure, where inflect has no answer: past its largest scale (10^36 and up, where it raises) and
for digit strings too long for `int`, the digits are read one by one instead of failing the stream.
"""

from __future__ import annotations

import re

_UNITS = ("", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_TEENS = tuple("ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen".split())
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
# The name of each group of three digits, from the right (inflect's scales: none past decillion).
_SCALES = ("",) + tuple(
    f" {name}"
    for name in (
        "thousand million billion trillion quadrillion quintillion sextillion septillion octillion nonillion "
        "decillion"
    ).split()
)
_MAX_DIGITS = 3 * len(_SCALES)
# inflect's ordinal of a number in words: these endings change, any other word takes "th".
_ORDINAL_ENDINGS = {
    "ty": "tieth",
    "one": "first",
    "two": "second",
    "three": "third",
    "five": "fifth",
    "eight": "eighth",
    "nine": "ninth",
    "twelve": "twelfth",
}
_ORDINAL_END = re.compile(rf"({'|'.join(_ORDINAL_ENDINGS)})\Z")


def _below_hundred(n: int) -> str:
    tens, units = divmod(n, 10)
    if tens == 1:
        return _TEENS[units]
    return _TENS[tens] + ("-" if tens and units else "") + _UNITS[units]


def _group(n: int, scale: int) -> str:
    """1..999 with its scale's name: 'two hundred forty-one thousand'."""
    hundreds, rest = divmod(n, 100)
    words = [f"{_UNITS[hundreds]} hundred"] if hundreds else []
    if rest:
        words.append(_below_hundred(rest))
    return " ".join(words) + _SCALES[scale]


def _digit_by_digit(digits: str) -> str:
    return " ".join(_UNITS[int(d)] if d != "0" else "zero" for d in digits)


def cardinal(digits: str) -> str:
    """A whole number (a string of digits) in words, as inflect's `number_to_words(n, andword="")`:
    groups joined by commas, except a last group of one word ('one thousand, two hundred five',
    'one thousand five')."""
    digits = digits.lstrip("0")
    if not digits:
        return "zero"
    if len(digits) > _MAX_DIGITS:
        return _digit_by_digit(digits)
    n = int(digits)
    groups: list[tuple[int, int]] = []  # (value, scale), lowest first
    scale = 0
    while n:
        n, value = divmod(n, 1000)
        if value:
            groups.append((value, scale))
        scale += 1
    parts = [_group(value, s) for value, s in reversed(groups)]
    if len(parts) > 1 and groups[0][1] == 0 and " " not in parts[-1]:
        return ", ".join(parts[:-1]) + " " + parts[-1]
    return ", ".join(parts)


def ordinal(words: str) -> str:
    """The ordinal of a number in words, as inflect's `ordinal`: 'twenty-one' → 'twenty-first'."""
    changed = _ORDINAL_END.sub(lambda m: _ORDINAL_ENDINGS[m.group(1)], words)
    return changed if changed != words else words + "th"


def number_words(number: str) -> str:
    """'42' → 'forty-two', '3.14' → 'three point one four' (digits after the point one by one)."""
    whole, _, frac = number.partition(".")
    words = cardinal(whole)
    if frac:
        words += " point " + _digit_by_digit(frac)
    return words


_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_CURRENCY = re.compile(r"([$£€])(\d+(?:\.\d+)?)")
_PERCENT = re.compile(r"(\d+(?:\.\d+)?)%")
_ORDINAL = re.compile(r"\b(\d+)(st|nd|rd|th)\b")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_CURRENCY_NAMES = {"$": "dollar", "£": "pound", "€": "euro"}


def _currency(m: re.Match) -> str:
    name = _CURRENCY_NAMES[m.group(1)]
    return f"{number_words(m.group(2))} {name if m.group(2) == '1' else name + 's'}"


def spell_numbers(text: str) -> str:
    """English numbers in words: thousands separators, currencies, percents, ordinals, decimals."""
    text = _THOUSANDS.sub("", text)
    text = _CURRENCY.sub(_currency, text)
    text = _PERCENT.sub(lambda m: f"{number_words(m.group(1))} percent", text)
    text = _ORDINAL.sub(lambda m: ordinal(cardinal(m.group(1))), text)
    text = _NUMBER.sub(lambda m: number_words(m.group(0)), text)
    return re.sub(r"\s+", " ", text).strip()
