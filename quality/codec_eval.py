"""The codec's bar on held-out utterances of the lab corpus: STOI of resynthesis against the source,
PocketSphinx WER of the source and of the resynthesis, and how many distinct codes it used
(`pcgtts train codec --eval`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pcgtts.quality.metrics import error_rates, recognizer
from pcgtts.runtime.audio.chunk import SAMPLE_RATE
from pcgtts.train.corpus import read_manifest


def evaluate_codec(codec_dir: Path, corpus: Path, split: str = "heldout_speakers", limit: int = 24) -> dict:
    """The issue's codec bar on held-out utterances, through the runtime's `Codec` (stock encode /
    decode): STOI (pystoi) of resynthesis vs source, and PocketSphinx WER of the source and of the
    resynthesis against the transcript (quality/metrics.py), with the number of distinct codes.
    Utterances are spread over the split's speakers (sorted by id, every k-th)."""
    import soundfile as sf
    from pystoi import stoi

    from pcgtts.runtime.audio.codec import Codec

    codec = Codec.from_pretrained(codec_dir, decode_only=False)
    records = sorted((r for r in read_manifest(corpus) if r["split"] == split), key=lambda r: r["id"])
    if not records:
        raise ValueError(f"{corpus}: no {split} utterances")
    records = records[::max(1, len(records) // limit)][:limit]
    asr = recognizer()
    scores, wer_source, wer_resyn, codes_seen = [], [], [], set()
    for rec in records:
        audio, _ = sf.read(str(Path(corpus) / rec["path"]), dtype="float32")
        codes = codec.encode(audio)
        codes_seen.update(codes.tolist())
        resyn = codec.decode(codes)[:audio.size]
        scores.append(float(stoi(audio[:resyn.size], resyn, SAMPLE_RATE, extended=False)))
        wer_source.append(error_rates(rec["text"], asr.transcribe(audio))[0])
        wer_resyn.append(error_rates(rec["text"], asr.transcribe(resyn))[0])
    return {"split": split, "utterances": len(records), "speakers": len({r["speaker"] for r in records}),
            "stoi_mean": float(np.mean(scores)), "stoi_min": float(np.min(scores)),
            "wer_source": float(np.mean(wer_source)), "wer_resynthesis": float(np.mean(wer_resyn)),
            "distinct_codes": len(codes_seen)}
