"""The long-text measure: does a voice stay itself, at its own pace, from a paragraph's first sentence to its last?

A paragraph of N sentences is spoken sentence by sentence (each sentence is one prompt, as `stream()`
splits a text), per seed. Two figures, each judged against the voice's own variation:

  identity   the speaker-encoder cosine of the last sentence to the first, against the voice's
             sentence-to-sentence spread: the cosines of every pair of sentences at most `near` apart,
             where no drift can build up. It holds when cos(first, last) >= mean(near) - 2 sd(near).
  rate       syllables per second of speech (the text's syllables over the utterance's duration with
             its leading and trailing silence trimmed), fitted by a line over the sentence index; the
             drift is the fitted change from the first sentence to the last, relative to the fitted
             first value. It holds when |drift| <= `max_rate_drift` (10 %).

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


def rate_drift(rates: Sequence[float]) -> float:
    """The least-squares line's change over the sentences, relative to its value at the first:
    (fit[last] - fit[0]) / fit[0]. NaN with fewer than 2 rates or a non-positive fitted start."""
    y = np.asarray(rates, dtype=np.float64)
    if len(y) < 2:
        return float("nan")
    x = np.arange(len(y), dtype=np.float64)
    slope, start = np.polyfit(x, y, 1)
    return float(slope * (len(y) - 1) / start) if start > 0 else float("nan")


def identity_spread(embeddings: Sequence[np.ndarray | None], near: int = 2) -> list[float]:
    """Cosines of every pair of sentences at most `near` apart (sentences without an embedding left out)."""
    out = []
    for i in range(len(embeddings)):
        for j in range(i + 1, min(i + near, len(embeddings) - 1) + 1):
            value = cosine(embeddings[i], embeddings[j])
            if value is not None:
                out.append(value)
    return out


def judge_paragraph(audios: Sequence[np.ndarray], texts: Sequence[str], embed: Callable, near: int = 2,
                    max_rate_drift: float = 0.10) -> dict:
    """One spoken paragraph (one audio per sentence) -> its identity and rate figures."""
    if len(audios) != len(texts) or len(texts) < near + 2:
        raise ValueError(f"a paragraph needs one audio per sentence and at least {near + 2} sentences")
    embeddings = [embed(a) for a in audios]
    spread = identity_spread(embeddings, near)
    first_last = cosine(embeddings[0], embeddings[-1])
    floor = float(np.mean(spread) - 2.0 * np.std(spread, ddof=1)) if len(spread) >= 2 else float("nan")
    rates = []
    for audio, text in zip(audios, texts):
        seconds = speech_seconds(audio)
        rates.append(syllables(text) / seconds if seconds > 0 else float("nan"))
    finite = [r for r in rates if np.isfinite(r)]
    drift = rate_drift(finite) if len(finite) == len(rates) else float("nan")
    return {
        "first_last_cosine": first_last,
        "near_cosine_mean": float(np.mean(spread)) if spread else float("nan"),
        "near_cosine_floor": floor,
        "identity_holds": first_last is not None and np.isfinite(floor) and first_last >= floor,
        "syllables_per_second": rates,
        "rate_drift": drift,
        "rate_holds": bool(np.isfinite(drift) and abs(drift) <= max_rate_drift),
    }


def run_consistency(speak: Callable[[str, str, int], np.ndarray], voices: Sequence[str], sentences: Sequence[str],
                    seeds: Sequence[int] = (0,), embed: Callable | None = None, near: int = 2,
                    max_rate_drift: float = 0.10, progress: Callable[[str], None] = lambda m: None) -> dict:
    """Speak the paragraph `sentences` in every voice (per seed) and judge each reading."""
    from pcgtts.quality.metrics import speaker_encoder

    embed = embed or speaker_encoder().embed
    readings = []
    for voice in voices:
        for seed in seeds:
            audios = []
            for i, text in enumerate(sentences):
                progress(f"{voice} seed {seed} sentence {i + 1}/{len(sentences)}")
                audios.append(speak(text, voice, seed))
            judged = judge_paragraph(audios, sentences, embed, near, max_rate_drift)
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
