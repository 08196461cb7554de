"""A prepared folder: a voice's models made ready once by `pcgtts prepare` (checkpoints, group table,
onnxruntime exports) beside a manifest, read here (`config.prepared_settings` loads one).

    prepared.json   format, version, the stages planned, and per stage done: its inputs (source
                    fingerprints, options) and the files it wrote
    target/ draft/ codec/ groups.pcg     the checkpoints and the target's group table (the target's
                    preset voices in target/voices)
    clone_codec/    the codec that decodes voices with a reference, if the voice has one
    clone_target/   the target LM that speaks voices with a reference, if the voice has one
    settings.json   the voice's own decoding and sampling settings (the built-in voice's), if recorded
    onnx-int8/{target,draft,codec,clone_codec,clone_target}  their onnxruntime exports (LMs int8, codecs
                    float32), if made

A stage is recorded only once its files are in place, so a folder whose every planned stage is
recorded (and present) is complete; reading one needs nothing of the tools that made it."""

from __future__ import annotations

import json
from pathlib import Path


MANIFEST = "prepared.json"
FORMAT, VERSION = "pcgtts-prepared", 1
ONNX_FOLDER = "onnx-int8"  # beside the checkpoints: their onnxruntime exports (LM int8, codec float32)
LAYOUT = {"target": "target", "draft": "draft", "codec": "codec", "clone_codec": "clone_codec",
          "clone_target": "clone_target", "groups": "groups.pcg"}
OPTIONAL = ("clone_codec", "clone_target")  # in LAYOUT, present only in a voice that has them
ONNX_STAGE = "onnx"
EXPORTED = ("target", "draft", "codec", "clone_codec", "clone_target")  # exported into ONNX_FOLDER when present
SETTINGS = "settings.json"  # the voice's own settings, played at unless the caller names others


def read_manifest(folder: str | Path) -> dict | None:
    """The folder's manifest, or None where it has none; a ValueError for one that is not a manifest."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"{path}: not a {FORMAT} manifest version {VERSION}")
    return manifest


def stage_done(folder: str | Path, manifest: dict, name: str) -> bool:
    """Whether `manifest` records stage `name` and every file it wrote is still there."""
    record = manifest.get("stages", {}).get(name)
    return record is not None and all((Path(folder) / file).exists() for file in record["files"])


def is_prepared(folder: str | Path, stages: tuple[str, ...] | None = None) -> bool:
    """Whether `folder` holds `stages` (None: every stage its manifest plans) done and present."""
    try:
        manifest = read_manifest(folder)
    except ValueError:
        return False
    if manifest is None:
        return False
    wanted = manifest.get("plan", []) if stages is None else stages
    return all(stage_done(folder, manifest, name) for name in wanted)


def voice_settings(folder: str | Path) -> dict:
    """The prepared voice's own settings (e.g. the built-in voice's temperature; decoding and sampling
    only, checked by `resolve_settings`, which puts them under the config file and the flags); {} where
    none are recorded."""
    path = Path(folder) / SETTINGS
    if not path.is_file():
        return {}
    try:
        settings = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not readable ({err})") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{path}: not a table of settings")
    return settings


def checkpoint_paths(folder: str | Path) -> dict[str, str]:
    """The checkpoints (and group table) a prepared folder holds, by `ModelPaths` field."""
    folder = Path(folder)
    return {name: str(folder / rel) for name, rel in LAYOUT.items() if (folder / rel).exists()}


def onnx_paths(folder: str | Path, paths: dict[str, str]) -> dict[str, str]:
    """`paths` with the target, draft, codec, clone codec and clone target replaced by their exports in
    the folder's ONNX_FOLDER."""
    root = Path(folder) / ONNX_FOLDER
    return {**paths, **{name: str(root / name) for name in EXPORTED if name in paths}}


__all__ = ["MANIFEST", "FORMAT", "VERSION", "ONNX_FOLDER", "LAYOUT", "OPTIONAL", "ONNX_STAGE", "EXPORTED", "SETTINGS", "read_manifest",
           "stage_done", "is_prepared", "voice_settings", "checkpoint_paths", "onnx_paths"]
