"""Splitting long text into sentence-sized pieces that are synthesised one after another.

LLaSA was trained on utterances of up to ~30 s; long input is split at sentence ends, and a
sentence longer than `max_chars` is split further at clause punctuation, then at spaces, so
no piece exceeds it. The pieces are streamed as one continuous audio stream.
"""

from __future__ import annotations

import re

from pcgtts.runtime.text.prompt import PRONOUNCEABLE, check_text

_SENTENCE_END = re.compile(r"(?<=[.!?。！？])\s+")
_CLAUSE_END = re.compile(r"(?<=[,;:，；：])\s+")


def _pack(parts: list[str], max_chars: int) -> list[str]:
    """Greedily join consecutive parts while the result stays within max_chars."""
    out: list[str] = []
    for part in parts:
        if out and len(out[-1]) + 1 + len(part) <= max_chars:
            out[-1] = f"{out[-1]} {part}"
        else:
            out.append(part)
    return out


def _split_long(piece: str, max_chars: int) -> list[str]:
    if len(piece) <= max_chars:
        return [piece]
    clauses = _CLAUSE_END.split(piece)
    if len(clauses) > 1:
        return [p for c in _pack(clauses, max_chars) for p in _split_long(c, max_chars)]
    words = piece.split(" ")
    if len(words) > 1:
        return [p for w in _pack(words, max_chars) for p in _split_long(w, max_chars)]
    return [piece[i:i + max_chars] for i in range(0, len(piece), max_chars)]  # one huge "word"


def split_sentences(text: str, max_chars: int = 300) -> list[str]:
    """Pieces of `text`, each at most `max_chars` long, in order, none empty."""
    if max_chars < 20:
        raise ValueError(f"max_chars must be >= 20, got {max_chars}")
    text = check_text(text)
    pieces = [p for s in _SENTENCE_END.split(text) for p in _split_long(s.strip(), max_chars)]
    # Pieces with nothing to say (a lone "--") would be refused by the prompt builder.
    return [p for p in _pack(pieces, max_chars) if PRONOUNCEABLE.search(p)]
