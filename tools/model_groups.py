"""A group table for a model folder: its speech embedding rows (`runtime/lm/checkpoint.py`) grouped
by `groups/build.py` and stamped with the model's identity, so the runtime can check the pair."""

from __future__ import annotations

from pathlib import Path

from pcgtts.groups.build import build_groups
from pcgtts.groups.table import GroupTable
from pcgtts.runtime.lm.checkpoint import load_speech_embeddings


def build_groups_for_model(model_dir: str | Path, theta: float, top_k: int | None = None, device="cpu",
                           progress: bool = True) -> GroupTable:
    rows, vocab, fingerprint = load_speech_embeddings(model_dir)
    table = build_groups(rows, theta, top_k, device, progress=progress)
    return table.with_model(vocab.speech_offset, vocab.vocab_size, fingerprint)
