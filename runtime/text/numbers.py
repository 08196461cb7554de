"""Numbers as English words: the text front end's one normalisation, applied before splitting and
tokenising (`SynthesisConfig.spell_numbers`, on by default).

A voice trained on spelled-out text (the speech lab's corpus has no digits) cannot read "42"; every
voice can read "forty two". Handled: percentages, dollar amounts, ordinals ("3rd"), clock times
("7:05"), years (1100-2099 read as years), decimals, and integers with or without thousands
separators. The quality harness spells its references with the same functions (what an ASR
transcript writes), so what the voice is asked to say and what its WER is scored against agree.
"""

from __future__ import annotations

import re

import numpy as np

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
         "sixteen seventeen eighteen nineteen").split()
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_SCALES = ((10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (1000, "thousand"))
_ORDINAL_WORDS = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth",
                  "nine": "ninth", "twelve": "twelfth"}


def spell_number(n: int) -> str:
    """A non-negative integer in English words, the way an ASR transcript writes it:
    1250 -> "one thousand two hundred fifty" (no "and", no hyphens)."""
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool):
        raise TypeError(f"spell_number takes an int, got {type(n).__name__}")
    if n < 0:
        return "minus " + spell_number(-n)
    if n >= 10**15:
        raise ValueError(f"{n} is too large to spell")
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens] + ("" if ones == 0 else " " + _ONES[ones])
    if n < 1000:
        hundreds, rest = divmod(n, 100)
        return _ONES[hundreds] + " hundred" + ("" if rest == 0 else " " + spell_number(rest))
    for scale, name in _SCALES:
        if n >= scale:
            high, rest = divmod(n, scale)
            return spell_number(high) + " " + name + ("" if rest == 0 else " " + spell_number(rest))
    raise AssertionError("unreachable")


def spell_ordinal(n: int) -> str:
    """21 -> "twenty first", 3 -> "third", 100 -> "one hundredth"."""
    words = spell_number(n).split()
    last = words[-1]
    if last in _ORDINAL_WORDS:
        words[-1] = _ORDINAL_WORDS[last]
    elif last.endswith("y"):
        words[-1] = last[:-1] + "ieth"
    else:
        words[-1] = last + "th"
    return " ".join(words)


def spell_year(n: int) -> str:
    """1984 -> "nineteen eighty four", 2005 -> "two thousand five", 1900 -> "nineteen hundred"."""
    if 2000 <= n <= 2009 or not 1100 <= n <= 2099:
        return spell_number(n)
    high, low = divmod(n, 100)
    if low == 0:
        return spell_number(high) + " hundred"
    return spell_number(high) + (" oh " + spell_number(low) if low < 10 else " " + spell_number(low))


def _digit_by_digit(digits: str) -> str:
    return " ".join(_ONES[int(d)] for d in digits)


def _spell_digits(digits: str) -> str:
    """A run of digits (thousands commas allowed) as a number, or digit by digit past what
    `spell_number` reads (a card or phone number: 16 digits and more)."""
    digits = digits.replace(",", "")
    return _digit_by_digit(digits) if len(digits) > 15 else spell_number(int(digits))


def _spell_decimal(match: re.Match) -> str:
    whole, frac = match.group(1), match.group(2)
    return f" {_spell_digits(whole)} point {_digit_by_digit(frac)} "


_NUMBER_PATTERNS = (
    # order matters: the most specific forms first
    (re.compile(r"(\d+)\s*%"), lambda m: f" {_spell_digits(m.group(1))} percent "),
    (re.compile(r"\$(\d[\d,]*)(?:\.(\d\d))?"), lambda m: " " + _spell_digits(m.group(1))
     + " dollars" + ("" if not m.group(2) or int(m.group(2)) == 0 else f" {spell_number(int(m.group(2)))} cents") + " "),
    (re.compile(r"\b(\d{1,15})(?:st|nd|rd|th)\b"), lambda m: f" {spell_ordinal(int(m.group(1)))} "),
    (re.compile(r"\b(\d{1,2}):(\d\d)\b"), lambda m: f" {spell_number(int(m.group(1)))} "
     + ("" if m.group(2) == "00" else ("oh " if m.group(2)[0] == "0" else "") + spell_number(int(m.group(2)))) + " "),
    (re.compile(r"\b(1[1-9]\d\d|20\d\d)\b(?![.,]\d)"), lambda m: f" {spell_year(int(m.group(1)))} "),
    (re.compile(r"(\d[\d,]*)\.(\d+)"), _spell_decimal),
    (re.compile(r"\d{1,3}(?:,\d{3})+|\d+"), lambda m: f" {_spell_digits(m.group(0))} "),
)


def spell_numbers(text: str) -> str:
    """`text` with its numbers as words and everything else kept: "We counted 42 birds." ->
    "We counted forty two birds."."""
    out = text
    for pattern, spell in _NUMBER_PATTERNS:
        out = pattern.sub(spell, out)
    out = re.sub(r" *\n *", "\n", re.sub(r"[ \t]{2,}", " ", out))
    return re.sub(r" +([.,!?;:])", r"\1", out).strip()


__all__ = ["spell_number", "spell_ordinal", "spell_year", "spell_numbers"]
