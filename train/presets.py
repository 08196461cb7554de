"""The built-in voice's presets, made from the lab corpus: one reference utterance per preset speaker.

A preset is a corpus speaker the target was trained on behind voice prompts. Its voice file holds
the codes of one of that speaker's training utterances (3-5 s) and its transcript: the utterance
whose speaker embedding lies nearest the speaker's centroid (a typical one, not an outlier). A spec
file names the presets:

    {"default": "heart",
     "voices": [{"name": "heart", "speaker": "hibari_s100", "description": "..."}, ...],
     "aliases": {"alloy": "heart", ...}}

    pcgtts train presets --corpus LAB/corpus --codes LAB/lm/codes.npz --spec train/presets.json --out DIR
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np

from pcgtts.runtime.audio.io import load_audio
from pcgtts.runtime.audio.presets import write_presets
from pcgtts.runtime.audio.voice import Voice
from pcgtts.train.corpus import read_manifest

log = logging.getLogger(__name__)

REF_SECONDS = (3.0, 5.0)


def typical_reference(rows: list[dict], corpus: Path, embed, candidates: int = 12) -> dict:
    """Of a speaker's 3-5 s utterances (the first `candidates` by id), the one nearest their centroid."""
    pool = sorted((r for r in rows if REF_SECONDS[0] <= r["seconds"] <= REF_SECONDS[1]), key=lambda r: r["id"])
    if not pool:
        raise ValueError(f"speaker {rows[0]['speaker'] if rows else '?'} has no 3-5 s training utterance")
    pool = pool[:candidates]
    embs = np.stack([embed(load_audio(corpus / r["path"])) for r in pool])
    centroid = embs.mean(axis=0)
    scores = embs @ centroid / (np.linalg.norm(embs, axis=1) * np.linalg.norm(centroid))
    return pool[int(np.argmax(scores))]


def make_presets(corpus: str | Path, codes_path: str | Path, spec_path: str | Path, out: str | Path,
                 embed, progress=lambda message: None) -> Path:
    """Write the presets `spec_path` names into `out` (voices.json + NAME.voice); returns the index path.
    `embed`: audio -> speaker embedding (the quality harness's resemblyzer encoder)."""
    corpus, out = Path(corpus), Path(out)
    spec = json.loads(Path(spec_path).read_text())
    rows = [r for r in read_manifest(corpus) if r["split"] == "train"]
    codes = np.load(codes_path)
    speakers = {r["speaker"] for r in rows}
    unknown = [v["speaker"] for v in spec["voices"] if v["speaker"] not in speakers]
    if unknown:
        raise ValueError(f"{spec_path}: no training speaker {', '.join(unknown)} in {corpus}")
    voices = {}
    for entry in spec["voices"]:
        progress(f"preset {entry['name']} ({entry['speaker']})")
        ref = typical_reference([r for r in rows if r["speaker"] == entry["speaker"]], corpus, embed)
        source = hashlib.sha256(load_audio(corpus / ref["path"]).tobytes()).hexdigest()
        voice = Voice(np.asarray(codes[ref["id"]], dtype=np.int64), ref["text"], source)
        voices[entry["name"]] = (voice, entry.get("description", ""))
        log.info("preset %s: %s (%.1f s) %r", entry["name"], ref["id"], ref["seconds"], ref["text"])
    return write_presets(out, voices, spec.get("default"), spec.get("aliases", {}))


__all__ = ["make_presets", "typical_reference"]
