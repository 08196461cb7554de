"""Reading a voice folder (the built-in voice's committed form, `train/package.py` writes it): its
voice.json checked against its files, and the digest its expansion in the cache is named by.

Needs nothing of training: the runtime reads a voice folder without the lab's code."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

FORMAT, VERSION = "pcgtts-voice", 1
FILES = ("target.safetensors", "draft.safetensors", "codec.safetensors")


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, read a MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def voice_digest(pack_dir: str | Path) -> str:
    """The first 16 hex digits of voice.json's sha256: a changed voice (new weights, group size or
    settings) gets a new cache folder."""
    return hashlib.sha256((Path(pack_dir) / "voice.json").read_bytes()).hexdigest()[:16]


def read_voice(pack_dir: str | Path, files: tuple[str, ...] | None = None) -> dict:
    """voice.json, checked: format, version, every file (or only `files`) present with its recorded
    checksum."""
    pack = Path(pack_dir)
    try:
        meta = json.loads((pack / "voice.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{pack}: not a voice folder ({err})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{pack}/voice.json: format {meta.get('format')!r} version {meta.get('version')!r}, "
                         f"expected {FORMAT!r} {VERSION}")
    for file, digest in meta["sha256"].items():
        if files is not None and file not in files:
            continue
        if not (pack / file).is_file() or file_sha256(pack / file) != digest:
            raise ValueError(f"{pack}/{file} is missing or damaged (checksum differs from voice.json)")
    return meta


__all__ = ["FORMAT", "VERSION", "FILES", "file_sha256", "voice_digest", "read_voice"]
