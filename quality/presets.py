"""The preset-voice measure: does each preset say its text, and does it sound like itself?

Every preset speaks every test sentence (per seed). Intelligibility is PocketSphinx WER/CER of each
utterance against its sentence, per preset with a 95 % interval. Identity is a nearest-neighbour
test among the presets' own syntheses: the sentences are paired, (s0, s1), (s2, s3), ...; for each
pair, seed and preset p, p's utterance of one sentence is compared (resemblyzer cosine) with every
preset's utterance of the other, and the case passes when the nearest is p's own. Both directions
count, so a preset has 2 cases per sentence pair and seed; the rate has a Wilson 95 % interval.

    result = run_presets(speak, ["heart", "slate"], sentences, seeds=(0,))   # speak(text, name, seed) -> audio
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Callable, Sequence

import numpy as np

from pcgtts.quality.metrics import cosine
from pcgtts.quality.stats import mean_ci, pass_rate


def run_presets(speak: Callable[[str, str, int], np.ndarray], names: Sequence[str], sentences: Sequence[str],
                seeds: Sequence[int] = (0,), embed: Callable | None = None, transcribe: Callable | None = None,
                progress: Callable[[str], None] = lambda m: None) -> dict:
    """Speak every sentence in every preset of `names` (per seed); score WER/CER and identity."""
    from pcgtts.quality.metrics import error_rates, recognizer, speaker_encoder

    if len(names) < 2 or len(sentences) < 2:
        raise ValueError("the preset measure needs at least 2 presets and 2 sentences")
    embed = embed or speaker_encoder().embed
    transcribe = transcribe or recognizer().transcribe
    records = []
    for name in names:
        for seed in seeds:
            for i, text in enumerate(sentences):
                progress(f"{name} seed {seed} sentence {i + 1}/{len(sentences)}")
                audio = speak(text, name, seed)
                heard = transcribe(audio)
                wer, cer = error_rates(text, heard)
                records.append({"voice": name, "seed": seed, "sentence": i, "text": text, "transcript": heard,
                                "wer": wer, "cer": cer, "seconds": len(audio) / 16000, "embedding": embed(audio)})
    emb = {(r["voice"], r["seed"], r["sentence"]): r["embedding"] for r in records}
    cases = []
    for seed in seeds:
        for a in range(0, len(sentences) - 1, 2):
            for own, other in ((a, a + 1), (a + 1, a)):
                for name in names:
                    probe = emb[(name, seed, own)]
                    scores = {q: _cosine(probe, emb[(q, seed, other)]) for q in names}
                    best = max(scores, key=scores.get)
                    cases.append({"voice": name, "seed": seed, "sentence": own, "against": other,
                                  "passed": best == name, "nearest": best})
    per_voice = {}
    for name in names:
        mine = [r for r in records if r["voice"] == name]
        tried = [c for c in cases if c["voice"] == name]
        k = sum(c["passed"] for c in tried)
        confused = Counter(c["nearest"] for c in tried if not c["passed"])
        per_voice[name] = {"utterances": len(mine), "wer": mean_ci([r["wer"] for r in mine]).as_dict(),
                           "cer": mean_ci([r["cer"] for r in mine]).as_dict(),
                           "identified": pass_rate(k, len(tried)), "taken_for": dict(confused.most_common(3))}
    for r in records:  # kept for re-scoring a subset of the presets (choosing which to ship)
        e = r.pop("embedding")
        r["embedding"] = None if e is None else [round(float(x), 5) for x in e]
    means = [v["wer"]["mean"] for v in per_voice.values()]
    summaries = [{"case": name, "utterances": v["utterances"], "wer": v["wer"], "cer": v["cer"],
                  "identified": v["identified"]} for name, v in per_voice.items()]
    summaries.append({"case": "all presets", "utterances": len(records),
                      "wer": mean_ci([r["wer"] for r in records]).as_dict(),
                      "cer": mean_ci([r["cer"] for r in records]).as_dict(),
                      "identified": pass_rate(sum(c["passed"] for c in cases), len(cases))})
    return {"mode": "voices", "voices": list(names), "records": records, "cases": cases, "per_voice": per_voice,
            "identified": summaries[-1]["identified"],
            "mean_wer_over_voices": float(np.mean(means)), "worst_voice_wer": float(np.max(means)),
            "summaries": summaries}


def _cosine(a, b) -> float:
    similarity = cosine(a, b)
    return -math.inf if similarity is None else similarity  # no speech found: never anyone's nearest


__all__ = ["run_presets"]
