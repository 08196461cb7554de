"""Reading a voice folder (the built-in voice's committed form, `train/package.py` writes it): its
voice.json checked against its files, the digest its expansion in the cache is named by, the
settings a voice may carry (`check_voice_settings`) and its weights loaded into a model to start a
training run from (`init_weights`).

Needs nothing of training: the runtime reads a voice folder without the lab's code."""

from __future__ import annotations

import hashlib
import logging
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: reading a pack needs no torch
    import torch

log = logging.getLogger(__name__)

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


def voice_cache_folder(pack_dir: str | Path, cache_root: str | Path | None = None) -> Path:
    """The folder a voice folder is prepared into: one per voice.json (`voice_digest`), in `cache_root`
    (default the user's cache, `files.cache_root`)."""
    from pcgtts.runtime.files import cache_root as default_root

    return Path(cache_root if cache_root is not None else default_root()) / f"voice-{voice_digest(pack_dir)}"


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


def check_voice_settings(settings: dict, where: Path | str) -> dict:
    """`settings` if a voice may hold them (decoding and sampling keys only, valid values); else a
    ValueError naming `where`."""
    from pcgtts.runtime.config import check_voice_keys, resolve_settings

    check_voice_keys(settings, where)
    resolve_settings({}, voice=settings)  # the values themselves (e.g. a negative temperature)
    return settings


def init_weights(model: torch.nn.Module, pack_dir: str | Path, role: str, model_config: dict | None = None) -> dict:
    """Start a lab run from a committed voice's weights (`--init-from`): load `role`
    ("target" or "codec") into `model`; a target must have the same model config. Only that file must be
    there, so a GPU machine needs only it and the training data copied to it. Returns voice.json."""
    from safetensors.torch import load_file

    meta = read_voice(pack_dir, files=(f"{role}.safetensors",))
    if role == "target" and model_config is not None and meta["target"]["model_config"] != model_config:
        raise ValueError(f"{pack_dir}: its target was trained with {meta['target']['model_config']}, "
                         f"not {model_config}; choose the matching --size")
    state = {k: v.float() for k, v in load_file(str(Path(pack_dir) / f"{role}.safetensors")).items()}
    model.load_state_dict(state)
    log.info("initialised the %s from %s (%s)", role, pack_dir, meta["name"])
    return meta

__all__ = ["init_weights", "check_voice_settings", "FORMAT", "VERSION", "FILES", "file_sha256", "voice_digest", "voice_cache_folder",
           "read_voice"]
