"""The cloning measure: is a cloned utterance nearest to its own speaker?

For each held-out speaker of a lab corpus and each of `refs` references (a 3-5 s utterance of
that speaker), the synthesizer speaks a test sentence prompted with the reference (zero-shot
cloning). The result's speaker embedding (resemblyzer, `metrics.speaker_encoder`) is compared by
cosine with every pool speaker's centroid: the mean embedding of up to `per_speaker` of that
speaker's utterances (never a reference). A case passes when its own speaker's centroid is the
nearest. The bar: pass rate >= 80 %, reported with a Wilson 95 % interval and the mean margin
(cosine to the own centroid minus the best other). A clone must also say its sentence: each case's
PocketSphinx WER is reported beside it (a voice copied into babble would pass the speaker test). The
corpus's derived speakers (pitch/tempo variants of one packaged voice) are near-twins to a speaker
encoder, so the rate is also given against the speakers of *other* source voices only ("distinct
sources").

`oracle=True` scores another real utterance of the speaker instead of a synthesis: the pool's
separability, the ceiling any synthesis can reach (and the harness's self-test in CI); resynthesised
through a codec, the ceiling of any synthesis through that codec.

    rows = read_manifest(corpus)                  # train/corpus.py: the lab corpus's manifest.jsonl
    plan = cloning_plan(rows, refs=4)             # references + centroid utterances per speaker
    result = run_cloning(plan, corpus, speak)     # speak(text, ref_path, ref_text, seed) -> audio
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from pcgtts.quality.stats import pass_rate
from pcgtts.train.corpus import read_manifest

REF_SECONDS = (3.0, 5.0)


@dataclass(frozen=True)
class CloningPlan:
    cloned: tuple[str, ...]  # the speakers cloned (the corpus's held-out speakers)
    sources: dict  # speaker -> its source voice (derived speakers share their source's)
    references: dict  # speaker -> [manifest rows used as references]
    centroid_rows: dict  # speaker -> [manifest rows whose embeddings make its centroid]


def cloning_plan(rows: Sequence[dict], refs: int = 4, per_speaker: int = 8, seed: int = 0,
                 speakers: Sequence[str] | None = None) -> CloningPlan:
    """References (3-5 s) and centroid utterances for every speaker; cloned = held-out speakers
    (or `speakers`). Deterministic given `seed`."""
    if refs < 1 or per_speaker < 1:
        raise ValueError("refs and per_speaker must be >= 1")
    by_speaker: dict[str, list[dict]] = {}
    for row in sorted((r for r in rows if r.get("split") != "codec_only"), key=lambda r: r["id"]):  # not the voice bank
        by_speaker.setdefault(row["speaker"], []).append(row)
    cloned = tuple(speakers) if speakers else tuple(sorted({r["speaker"] for r in rows
                                                            if r.get("split") == "heldout_speakers"}))
    unknown = set(cloned) - set(by_speaker)
    if not cloned or unknown:
        raise ValueError(f"no speakers to clone (unknown: {sorted(unknown)})" if unknown else
                         "the corpus has no held-out speakers to clone")
    if len(by_speaker) < 2:
        raise ValueError("speaker identification needs at least 2 speakers in the corpus")
    rng = random.Random(seed)
    references, centroid_rows = {}, {}
    for speaker, utterances in by_speaker.items():
        pool = list(utterances)
        rng.shuffle(pool)
        if speaker in cloned:
            fits = [r for r in pool if REF_SECONDS[0] <= r["seconds"] <= REF_SECONDS[1]]
            if len(fits) < refs:
                raise ValueError(f"speaker {speaker} has {len(fits)} utterances of 3-5 s; {refs} references asked for")
            references[speaker] = fits[:refs]
            pool = [r for r in pool if r not in references[speaker]]
        centroid_rows[speaker] = pool[:per_speaker]
    sources = {speaker: utterances[0].get("source", speaker) for speaker, utterances in by_speaker.items()}
    return CloningPlan(cloned, sources, references, centroid_rows)


def _cosines(embedding: np.ndarray, centroids: dict) -> dict:
    return {name: float(embedding @ c / (np.linalg.norm(embedding) * np.linalg.norm(c) + 1e-12))
            for name, c in centroids.items()}


def identify(embedding: np.ndarray, own: str, centroids: dict) -> tuple[bool, float]:
    """(own centroid is the nearest by cosine, own cosine - best other cosine)."""
    sims = _cosines(embedding, centroids)
    best_other = max(v for name, v in sims.items() if name != own)
    return sims[own] > best_other, sims[own] - best_other


def nearest(embedding: np.ndarray, centroids: dict) -> str:
    """The speaker whose centroid is nearest by cosine (who a clone sounds like, when not its own)."""
    sims = _cosines(embedding, centroids)
    return max(sims, key=sims.get)


def run_cloning(plan: CloningPlan, corpus: str | Path, speak: Callable | None, sentences: Sequence[str],
                embed: Callable[[np.ndarray], np.ndarray] | None = None, progress: Callable[[str], None] = lambda m: None,
                seed: int = 0, transcribe: Callable[[np.ndarray], str] | None = None,
                resynthesize: Callable[[np.ndarray], np.ndarray] | None = None) -> dict:
    """Every (speaker, reference) case: speak a sentence cloned from the reference (speak(text,
    ref_path, ref_text, seed) -> 16 kHz audio), or with `speak=None` (oracle) take the speaker's
    next real utterance (through `resynthesize`, e.g. a codec's encode + decode, when given); identify it
    against the pool's centroids and transcribe it (WER against the text it says)."""
    from pcgtts.quality.metrics import error_rates, recognizer, speaker_encoder
    from pcgtts.quality.stats import mean_ci
    from pcgtts.runtime.audio.io import load_audio

    corpus = Path(corpus)
    if embed is None:
        embed = speaker_encoder().embed
    if transcribe is None:
        transcribe = recognizer().transcribe

    def load(row):
        return load_audio(corpus / row["path"])

    centroids = {}
    for speaker, rows in plan.centroid_rows.items():
        progress(f"centroid {speaker} ({len(rows)} utterances)")
        centroids[speaker] = np.mean([embed(load(r)) for r in rows], axis=0)
    cases = []
    for speaker in plan.cloned:
        distinct = {name: c for name, c in centroids.items()  # the pool less the speaker's siblings
                    if name == speaker or plan.sources[name] != plan.sources[speaker]}
        for i, ref in enumerate(plan.references[speaker]):
            text = sentences[len(cases) % len(sentences)]
            if speak is None:  # oracle: a real utterance of the speaker that is in no centroid (the next reference)
                refs = plan.references[speaker]
                real = refs[(i + 1) % len(refs)]
                audio, text = load(real), real["text"]
                if resynthesize is not None:
                    audio = resynthesize(audio)
            else:
                progress(f"clone {speaker} ref {i + 1}: {text[:40]}")
                audio = speak(text, corpus / ref["path"], ref["text"], seed + i)
            emb = embed(audio)  # None: no speech found (a silent synthesis fails the case)
            passed, margin = identify(emb, speaker, centroids) if emb is not None else (False, None)
            passed_distinct = identify(emb, speaker, distinct)[0] if emb is not None else False
            heard = transcribe(audio)
            cases.append({"speaker": speaker, "reference": ref["id"], "text": text, "passed": passed,
                          "passed_distinct_sources": passed_distinct, "margin": margin, "seconds": len(audio) / 16000,
                          "nearest": nearest(emb, centroids) if emb is not None else None,
                          "transcript": heard, "wer": error_rates(text, heard)[0]})
    margins = [c["margin"] for c in cases if c["margin"] is not None]
    return {"mode": "cloning", "oracle": speak is None, "pool": sorted(centroids), "cases": cases,
            "all_speakers": _rate(cases, "passed"), "distinct_sources": _rate(cases, "passed_distinct_sources"),
            "mean_margin": float(np.mean(margins)) if margins else math.nan,
            "passed_by_speaker": {s: sum(c["passed"] for c in cases if c["speaker"] == s) for s in plan.cloned},
            "wer": mean_ci([c["wer"] for c in cases]).as_dict(),
            "wer_by_speaker": {s: mean_ci([c["wer"] for c in cases if c["speaker"] == s]).as_dict() for s in plan.cloned}}


def _rate(cases: Sequence[dict], key: str) -> dict:
    return pass_rate(sum(bool(c[key]) for c in cases), len(cases))


__all__ = ["read_manifest", "CloningPlan", "cloning_plan", "identify", "nearest", "run_cloning"]
