"""Which writing system a text is in: a voice trained on one script (the built-in voice reads English)
turns text in another into noise, so the synthesizer warns about it.

A letter's script is the first word of its Unicode name ("LATIN SMALL LETTER A" -> "Latin",
"CJK UNIFIED IDEOGRAPH-4F60" -> "CJK", "ARABIC LETTER MEEM" -> "Arabic"); width variants of Latin
letters ("FULLWIDTH LATIN CAPITAL LETTER A") count as Latin.
"""

from __future__ import annotations

import unicodedata

FOREIGN_SHARE = 0.5  # more than this share of the letters in scripts a voice does not read: "mostly" foreign
LATIN = "Latin"
_ACRONYMS = {"CJK": "CJK"}  # script words kept upper-case when named


def script_of(char: str) -> str:
    """A letter's script, named as its Unicode name begins: "Latin", "CJK", "Arabic", "Cyrillic", ..."""
    words = unicodedata.name(char, "UNKNOWN").split(" ")
    if "LATIN" in words[:2]:  # "LATIN ...", and "FULLWIDTH LATIN ..." / "HALFWIDTH LATIN ..."
        return LATIN
    return _ACRONYMS.get(words[0], words[0].title())


def foreign_script(text: str, reads: tuple[str, ...] = (LATIN,)) -> str | None:
    """The most common script of `text`'s letters that is not in `reads`, when more than
    `FOREIGN_SHARE` of its letters are in such scripts; else None (no letters: None)."""
    known = {name.casefold() for name in reads}
    counts: dict[str, int] = {}
    for char in text:
        if char.isalpha():
            script = script_of(char)
            counts[script] = counts.get(script, 0) + 1
    letters = sum(counts.values())
    foreign = {script: n for script, n in counts.items() if script.casefold() not in known}
    if not letters or sum(foreign.values()) <= FOREIGN_SHARE * letters:
        return None
    return max(foreign, key=foreign.get)
