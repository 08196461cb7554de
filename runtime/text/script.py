"""Which writing system a text is in: the built-in voice reads Latin script only, and text in another
script comes out as noise, so the synthesizer warns about it."""

from __future__ import annotations

import unicodedata

FOREIGN_SHARE = 0.5  # more than this share of the letters outside Latin script: "mostly" another script


def script_of(char: str) -> str:
    """A letter's script as Unicode names it: the first word of its name ("LATIN", "CJK", "ARABIC", ...)."""
    name = unicodedata.name(char, "")
    return name.split(" ", 1)[0] if name else "UNKNOWN"


def foreign_script(text: str) -> str | None:
    """The most common non-Latin script when most of `text`'s letters are in one, else None."""
    counts: dict[str, int] = {}
    for char in text:
        if char.isalpha():
            script = script_of(char)
            counts[script] = counts.get(script, 0) + 1
    letters = sum(counts.values())
    foreign = {script: n for script, n in counts.items() if script != "LATIN"}
    if not letters or sum(foreign.values()) <= FOREIGN_SHARE * letters:
        return None
    return max(foreign, key=foreign.get).title()
