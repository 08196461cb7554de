"""Numbers as English words: the text front end's one normalisation, applied before splitting and
tokenising (`SynthesisConfig.spell_numbers`, on by default).

A voice trained on spelled-out text (the speech lab's corpus has no digits) cannot read "42"; every
voice can read "forty two". Handled: percentages, dollar amounts, ordinals ("3rd"), clock times
("7:05"), years (1100-2099 read as years), decimals, version numbers ("2.0.1", "v2.0.1": group by
group, "two point zero point one"), negative numbers ("-5", "\u22125": "minus five"), and integers
with or without thousands separators. A hyphen between two numbers ("5-3", "1990-1995") or inside a
word ("COVID-19") is kept as it is, not read as "minus". The quality harness spells its references
with the same functions (what an ASR transcript writes), so what the voice is asked to say and what
its WER is scored against agree.
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
    return f" {_spell_amount(match.group(0))} "


def _spell_amount(text: str) -> str:
    """"1,000.5" -> "one thousand point five"; "15" -> "fifteen"."""
    whole, _, frac = text.partition(".")
    return _spell_digits(whole) + (f" point {_digit_by_digit(frac)}" if frac else "")


def _spell_version(match: re.Match) -> str:
    """"2.0.1" -> "two point zero point one": each group a number ("10.15.7" -> "ten point fifteen
    point seven"), a group with a leading zero digit by digit ("1.05.2" -> "... zero five ...")."""
    groups = match.group(0).split(".")
    return " " + " point ".join(_digit_by_digit(g) if len(g) > 1 and g[0] == "0" else _spell_digits(g)
                                for g in groups) + " "


def _spell_dollars(match: re.Match) -> str:
    dollars, cents = match.group(1), match.group(2)
    words = _spell_digits(dollars) + (" dollar" if dollars.replace(",", "").lstrip("0") == "1" else " dollars")
    if cents and int(cents) != 0:
        words += f" {spell_number(int(cents))} " + ("cent" if int(cents) == 1 else "cents")
    return f" {words} "


_NUMBER_PATTERNS = (
    # order matters: the most specific forms first
    # a minus sign: U+2212 always; a hyphen only before a number and not after a word, a number or
    # another dash ("-5", "(-5)", "a -0.5% drop", but not "5-3", "1990-1995" or "COVID-19")
    (re.compile(r"(?:(?<![\w.,\-\u2212)\]])-|\u2212 ?)(?=\$?\d)"), lambda m: " minus "),
    # "v2.0.1": a version's "v" read as "version"
    (re.compile(r"\b[vV](?=\d+(?:\.\d+)+\b)"), lambda m: " version "),
    (re.compile(r"(?<![\d.,])\d+(?:\.\d+){2,}\b"), _spell_version),
    (re.compile(r"((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)\s*%"), lambda m: f" {_spell_amount(m.group(1))} percent "),
    # "$1.5 million" -> "one point five million dollars"
    (re.compile(r"\$(\d[\d,]*(?:\.\d+)?) ?(thousand|million|billion|trillion)\b"),
     lambda m: f" {_spell_amount(m.group(1))} {m.group(2)} dollars "),
    (re.compile(r"\$(\d[\d,]*)(?:\.(\d\d))?(?!\.?\d)"), _spell_dollars),
    (re.compile(r"\$(\d[\d,]*\.\d+)"), lambda m: f" {_spell_amount(m.group(1))} dollars "),  # "$3.999"
    (re.compile(r"\b(\d{1,15})(?:st|nd|rd|th)\b"), lambda m: f" {spell_ordinal(int(m.group(1)))} "),
    (re.compile(r"\b(\d{1,2}):(\d\d)\b"), lambda m: f" {spell_number(int(m.group(1)))} "
     + ("" if m.group(2) == "00" else ("oh " if m.group(2)[0] == "0" else "") + spell_number(int(m.group(2)))) + " "),
    # a year: not the fraction of a decimal ("3.1415") nor followed by one ("2020.5")
    (re.compile(r"(?<!\d[.,])\b(1[1-9]\d\d|20\d\d)\b(?![.,]\d)"), lambda m: f" {spell_year(int(m.group(1)))} "),
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
    out = re.sub(r"([(\[]) +", r"\1", out)
    return re.sub(r" +([.,!?;:)\]])", r"\1", out).strip()


__all__ = ["spell_number", "spell_ordinal", "spell_year", "spell_numbers"]
