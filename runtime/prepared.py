"""A prepared folder: a voice's models made ready once by `pcgtts prepare` (checkpoints, group table,
onnxruntime exports) beside a manifest, and the settings that load it.

    prepared.json   format, version, the stages planned, and per stage done: its inputs (source
                    fingerprints, options) and the files it wrote
    target/ draft/ codec/ groups.pcg     the checkpoints and the target's group table
    onnx-int8/{target,draft,codec}       their onnxruntime exports (LM int8, codec float32), if made

A stage is recorded only once its files are in place, so a folder whose every planned stage is
recorded (and present) is complete; reading one needs nothing of the tools that made it."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the settings module imports this one
    from pcgtts.runtime.config import DeviceConfig, Settings


MANIFEST = "prepared.json"
FORMAT, VERSION = "pcgtts-prepared", 1
ONNX_FOLDER = "onnx-int8"  # beside the checkpoints: their onnxruntime exports (LM int8, codec float32)
LAYOUT = {"target": "target", "draft": "draft", "codec": "codec", "groups": "groups.pcg"}
ONNX_STAGE = "onnx"


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


def checkpoint_paths(folder: str | Path) -> dict[str, str]:
    """The checkpoints (and group table) a prepared folder holds, by `ModelPaths` field."""
    folder = Path(folder)
    return {name: str(folder / rel) for name, rel in LAYOUT.items() if (folder / rel).exists()}


def onnx_paths(folder: str | Path, paths: dict[str, str]) -> dict[str, str]:
    """`paths` with the target, draft and codec replaced by their exports in the folder's ONNX_FOLDER."""
    root = Path(folder) / ONNX_FOLDER
    return {**paths, **{name: str(root / name) for name in ("target", "draft", "codec") if name in paths}}


def runs_int8_graphs(device: DeviceConfig) -> bool:
    """Whether `device` is where the int8 onnxruntime graphs are the fastest route: a CPU, float32,
    no torch int8 layers, no torch.compile (BENCHMARKS.md)."""
    return (device.compute_device == "cpu" and device.dtype == "float32" and device.quantize == "none"
            and not device.compile)


def prepared_settings(settings: Settings) -> Settings:
    """`settings` with `models.prepared` (a folder `pcgtts prepare` made) turned into its model paths:
    on a CPU with the backend at "auto" (or "onnxruntime") its onnxruntime exports when it has them,
    else its checkpoints. A ValueError, before anything loads, for a folder that is not complete or
    a prepared folder given together with model paths."""
    models = settings.models
    if models.prepared is None:
        return settings
    given = [name for name in ("target", "draft", "codec", "groups", "heads", "transitions", "eagle")
             if getattr(models, name) is not None]
    if given:
        raise ValueError(f"a prepared folder names its own models: give either prepared or "
                         f"{', '.join(given)}, not both")
    folder = Path(models.prepared)
    if not folder.is_dir():
        raise ValueError(f"prepared folder not found: {folder}")
    manifest = read_manifest(folder)
    if manifest is None:
        raise ValueError(f"{folder} is not a prepared folder (no {MANIFEST}); make one with `pcgtts prepare`")
    missing = [name for name in manifest.get("plan", []) if not stage_done(folder, manifest, name)]
    if missing:
        raise ValueError(f"{folder} is not fully prepared (stages not done: {', '.join(missing)}); "
                         "run `pcgtts prepare` again to finish it")
    paths, device = checkpoint_paths(folder), settings.device
    exported = stage_done(folder, manifest, ONNX_STAGE)
    if device.backend == "onnxruntime":
        if not exported:
            raise ValueError(f"{folder} has no onnxruntime exports (prepared with --no-onnx); "
                             "leave the backend at auto or torch")
        paths = onnx_paths(folder, paths)
    elif (device.backend == "auto" and exported and runs_int8_graphs(device)
          and importlib.util.find_spec("onnxruntime") is not None):
        paths, device = onnx_paths(folder, paths), replace(device, backend="onnxruntime")
    return replace(settings, models=type(models)(**paths), device=device)


__all__ = ["MANIFEST", "FORMAT", "VERSION", "ONNX_FOLDER", "LAYOUT", "ONNX_STAGE", "read_manifest", "stage_done",
           "is_prepared", "checkpoint_paths", "onnx_paths", "runs_int8_graphs", "prepared_settings"]
