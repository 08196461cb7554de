"""A group table for a model folder: its speech embedding rows (`runtime/lm/checkpoint.py`) grouped
by `groups/build.py` and stamped with the model's identity, so the runtime can check the pair."""

from __future__ import annotations

from pathlib import Path

from pcgtts.groups.build import build_groups, theta_for_mean_size
from pcgtts.groups.table import GroupTable
from pcgtts.runtime.lm.checkpoint import load_speech_embeddings


def build_groups_for_model(model_dir: str | Path, theta: float | None, top_k: int | None = None, device="cpu",
                           progress: bool = True, mean_size: float | None = None,
                           max_bytes: int | None = None) -> GroupTable:
    """theta, or (theta None) the theta whose groups average `mean_size` members; `max_bytes`
    refuses a table whose estimated build memory is larger (see groups/build.py)."""
    rows, vocab, fingerprint = load_speech_embeddings(model_dir)
    if theta is None:
        if mean_size is None:
            raise ValueError("give theta or a target mean group size")
        theta = theta_for_mean_size(rows, mean_size, top_k)
    table = build_groups(rows, theta, top_k, device, progress=progress, max_bytes=max_bytes)
    return table.with_model(vocab.speech_offset, vocab.vocab_size, fingerprint)
