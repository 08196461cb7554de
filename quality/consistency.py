"""The long-text measure: does a voice stay itself, at its own pace, from a paragraph's first sentence to its last?

A paragraph of N sentences is read twice per seed, in order and in reverse, sentence by sentence
(each sentence is one prompt, as `stream()` splits a text), so that every sentence is heard at two
positions. Two figures, each judged against the voice's own variation:

  identity   in the reading in order, the speaker-encoder cosine of the last sentence to the first,
             against the voice's sentence-to-sentence spread: the cosines of every pair of sentences
             at most `near` apart, where no drift can build up. It holds when
             cos(first, last) >= mean(near) - 2 sd(near).
  rate       syllables per second of speech (the text's syllables over the utterance's duration with
             its leading and trailing silence trimmed). A sentence's own pace cancels between its two
             positions: the least-squares slope b of log rate on position, fitted to the differences
             between the two readings, gives the drift exp(b (N - 1)) - 1 from the first position to
             the last. It holds when |drift| <= `max_rate_drift` (10 %). The reading in order alone
             would confound position with text (denser sentences read faster wherever they stand).

    result = run_consistency(speak, ["default", "nova"], paragraph, seeds=(0, 1))   # speak(text, voice, seed)
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

import numpy as np

from pcgtts.quality.metrics import cosine

SAMPLE_RATE = 16000
_VOWEL_GROUPS = re.compile(r"[aeiouy]+")


def syllables(text: str) -> int:
    """An English syllable count from spelling: vowel groups per word, a silent final "e" dropped,
    at least one per word. Good to a few per cent over a sentence, which is what a rate needs."""
    total = 0
    for word in re.findall(r"[a-z]+", text.lower()):
        count = len(_VOWEL_GROUPS.findall(word))
        if word.endswith("e") and not word.endswith(("le", "ee", "ye")) and count > 1:
            count -= 1
        total += max(count, 1)
    return total


def speech_seconds(audio: np.ndarray, sample_rate: int = SAMPLE_RATE, floor_db: float = -35.0) -> float:
    """The utterance's duration with leading and trailing silence trimmed: from the first to the
    last 20 ms frame whose RMS is within `floor_db` of the loudest frame's (0.0 for silence)."""
    audio = np.asarray(audio, dtype=np.float64).reshape(-1)
    hop = sample_rate // 50
    frames = len(audio) // hop
    if frames == 0:
        return 0.0
    rms = np.sqrt(np.mean(audio[: frames * hop].reshape(frames, hop) ** 2, axis=1))
    peak = float(rms.max())
    if peak <= 0.0:
        return 0.0
    loud = np.flatnonzero(rms >= peak * 10.0 ** (floor_db / 20.0))
    return (int(loud[-1]) - int(loud[0]) + 1) * hop / sample_rate


def position_drift(in_order: Sequence[float], reversed_: Sequence[float]) -> float:
    """The drift of rate with position, from one sentence per position read in order (`in_order[i]`:
    sentence i at position i) and in reverse (`reversed_[i]`: sentence i at position N - 1 - i):
    exp(b (N - 1)) - 1 with b the least-squares slope (through 0) of log(in_order / reversed_) on the
    difference of positions, 2 i - (N - 1). NaN with fewer than 2 sentences or a rate that is not > 0."""
    a, r = np.asarray(in_order, dtype=np.float64), np.asarray(reversed_, dtype=np.float64)
    n = len(a)
    if n < 2 or len(r) != n or not (np.all(a > 0) and np.all(r > 0)):
        return float("nan")
    shift = 2.0 * np.arange(n) - (n - 1)
    slope = float(np.dot(np.log(a / r), shift) / np.dot(shift, shift))
    return float(np.expm1(slope * (n - 1)))


def rates(audios: Sequence[np.ndarray], texts: Sequence[str]) -> list[float]:
    """Syllables per second of speech of each (audio, text); NaN for a silent audio."""
    out = []
    for audio, text in zip(audios, texts):
        seconds = speech_seconds(audio)
        out.append(syllables(text) / seconds if seconds > 0 else float("nan"))
    return out


def identity_spread(embeddings: Sequence[np.ndarray | None], near: int = 2) -> list[float]:
    """Cosines of every pair of sentences at most `near` apart (sentences without an embedding left out)."""
    out = []
    for i in range(len(embeddings)):
        for j in range(i + 1, min(i + near, len(embeddings) - 1) + 1):
            value = cosine(embeddings[i], embeddings[j])
            if value is not None:
                out.append(value)
    return out


def judge_paragraph(in_order: Sequence[np.ndarray], in_reverse: Sequence[np.ndarray], texts: Sequence[str],
                    embed: Callable, near: int = 2, max_rate_drift: float = 0.10) -> dict:
    """One paragraph read in order and in reverse (one audio per sentence each; `in_reverse[0]` is
    the last sentence) -> its identity and rate figures."""
    if not len(in_order) == len(in_reverse) == len(texts) or len(texts) < near + 2:
        raise ValueError(f"a paragraph needs one audio per sentence per reading and at least {near + 2} sentences")
    embeddings = [embed(a) for a in in_order]
    spread = identity_spread(embeddings, near)
    first_last = cosine(embeddings[0], embeddings[-1])
    floor = float(np.mean(spread) - 2.0 * np.std(spread, ddof=1)) if len(spread) >= 2 else float("nan")
    forward = rates(in_order, texts)
    backward = rates(list(in_reverse)[::-1], texts)  # per sentence, heard at position N - 1 - i
    drift = position_drift(forward, backward)
    return {
        "first_last_cosine": first_last,
        "near_cosine_mean": float(np.mean(spread)) if spread else float("nan"),
        "near_cosine_floor": floor,
        "identity_holds": first_last is not None and np.isfinite(floor) and first_last >= floor,
        "syllables_per_second": forward,
        "syllables_per_second_in_reverse": backward,
        "rate_drift": drift,
        "rate_holds": bool(np.isfinite(drift) and abs(drift) <= max_rate_drift),
    }


def run_consistency(speak: Callable[[str, str, int], np.ndarray], voices: Sequence[str], sentences: Sequence[str],
                    seeds: Sequence[int] = (0,), embed: Callable | None = None, near: int = 2,
                    max_rate_drift: float = 0.10, progress: Callable[[str], None] = lambda m: None) -> dict:
    """Read the paragraph `sentences` in every voice, in order and in reverse (per seed; the reverse
    reading on seed + 1000, other random streams), and judge each pair of readings."""
    from pcgtts.quality.metrics import speaker_encoder

    embed = embed or speaker_encoder().embed
    readings = []
    for voice in voices:
        for seed in seeds:
            heard = {}
            for order, texts, stream in (("in order", sentences, seed), ("in reverse", sentences[::-1], seed + 1000)):
                heard[order] = []
                for i, text in enumerate(texts):
                    progress(f"{voice} seed {seed} {order} sentence {i + 1}/{len(texts)}")
                    heard[order].append(speak(text, voice, stream))
            judged = judge_paragraph(heard["in order"], heard["in reverse"], sentences, embed, near, max_rate_drift)
            readings.append({"voice": voice, "seed": seed, **judged})
    per_voice = {}
    for voice in voices:
        mine = [r for r in readings if r["voice"] == voice]
        drifts = [r["rate_drift"] for r in mine if np.isfinite(r["rate_drift"])]
        per_voice[voice] = {
            "readings": len(mine),
            "identity_holds": sum(bool(r["identity_holds"]) for r in mine),
            "rate_holds": sum(r["rate_holds"] for r in mine),
            "worst_rate_drift": max(drifts, key=abs) if drifts else None,
            "first_last_cosine": [r["first_last_cosine"] for r in mine],
            "near_cosine_floor": [r["near_cosine_floor"] for r in mine],
        }
    return {"mode": "consistency", "paragraph": list(sentences), "seeds": list(seeds), "near": near,
            "max_rate_drift": max_rate_drift,
            "per_voice": per_voice, "readings": readings}
