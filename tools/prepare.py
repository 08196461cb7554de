"""`pcgtts prepare`: a voice's models made ready once, in stages, into one folder the runtime loads
(`runtime/prepared.py` reads it).

The built-in voice: its committed form expanded (`train/package.py: expand_voice`, group table
included), then exported for onnxruntime. A LLaSA-format checkpoint a user brings: copied, with its
codec; its group table built for a mean group size; a draft made from a subset of its layers;
optionally an EAGLE draft trained for it (`train/eagle.py`); all exported for onnxruntime, each graph
checked against PyTorch (`export/onnx_lm.py`, `export/codec_graph.py`).

Each stage writes into a staging folder inside the output and is recorded in the manifest only
once its files are in place. Running again skips the stages done whose inputs (source
fingerprints, options) are unchanged; a stage whose inputs changed, or whose files are gone, is
made again, and so is every stage after it. An interrupted run resumes at the stage it was in."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pcgtts.runtime.config import ModelPaths
from pcgtts.runtime.prepared import (EXPORTED, FORMAT, LAYOUT, MANIFEST, ONNX_FOLDER, ONNX_STAGE, OPTIONAL, VERSION,
                                     read_manifest, stage_done)

log = logging.getLogger(__name__)

STAGING = ".staging"  # inside the output folder: a stage's files until it is complete
LOCK = ".prepare.lock"  # inside the output folder: held by the one preparation working on it
# a redone stage redoes those after it
ORDER = ("expand", "codec", "clone_codec", "target", "groups", "draft", "eagle", "clone_target", ONNX_STAGE)
DEFAULT_GROUP_SIZE, GROUP_CAP = 48, 512  # mean group size (140 cost the built-in voice intelligibility, 48 did not: QUALITY.md) and cap


@dataclass(frozen=True)
class Stage:
    """One step of a preparation: `make(staging)` writes `outputs` (paths relative to the output folder)
    under `staging`; `inputs` is what it was made from (a change makes it again)."""

    name: str
    outputs: tuple[str, ...]
    make: Callable[[Path], None] = field(compare=False)
    inputs: dict = field(default_factory=dict)


def folder_fingerprint(folder: Path) -> dict:
    """{file: [size, mtime in ns]} of a folder's files: a changed source is seen without reading its weights."""
    return {str(p.relative_to(folder)): [p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _write_manifest(out: Path, manifest: dict) -> None:
    tmp = out / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(out / MANIFEST)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _bar(total: int, desc: str, unit: str, progress: bool):
    """A progress bar on stderr when it is a terminal (none in logs and pipes, none without `progress`)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=None if progress else True)


class FolderBusy(ValueError):
    """Another process is preparing the same folder."""


@contextlib.contextmanager
def preparing(out: Path, wait: bool = False):
    """Hold `out`'s lock (an exclusive `flock` on out/LOCK, which holds the holder's pid) while the
    block runs; another holder is a one-line `FolderBusy` at once, or with `wait` is waited for (said
    once in the log). The kernel drops a lock when its process ends, however it ends, so a lock file a
    killed run left behind is simply taken over."""
    import fcntl

    path = out / LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not wait:
                    raise
                log.warning("waiting for another prepare of %s (%s) to finish", out, _holder(path))
                fcntl.flock(fd, fcntl.LOCK_EX)
        except BlockingIOError:
            os.close(fd)
            raise FolderBusy(f"another prepare is working on {out} ({_holder(path)}); wait for it to end, "
                             "or stop it and run again") from None
        except BaseException:
            os.close(fd)
            raise
        try:  # the file may have been removed by the holder that just let go: lock the one in place
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # while still held: no one can be waiting to lock this file and find it gone
        os.close(fd)


def _holder(path: Path) -> str:
    """"pid N" of the lock's holder, as it wrote it (it writes just after locking: wait a moment)."""
    for _ in range(20):
        try:
            pid = path.read_text().strip()
        except OSError:
            pid = ""
        if pid.isdigit():
            return f"pid {pid}"
        time.sleep(0.01)
    return "pid unknown"


def run_stages(out: Path, stages: list[Stage], desc: str, progress: bool = True, wait: bool = False) -> dict[str, str]:
    """Run `stages` (in ORDER) into `out`: {stage: "made" or "skipped"}. Stages recorded but no longer
    planned are removed with their files (and the stages after them made again). One preparation of
    a folder at a time: another one already at work is a `FolderBusy` error (`preparing`), or with
    `wait` is waited for, and what it made is then skipped."""
    out.mkdir(parents=True, exist_ok=True)
    with preparing(out, wait):
        return _run_stages(out, stages, desc, progress)


def _run_stages(out: Path, stages: list[Stage], desc: str, progress: bool) -> dict[str, str]:
    try:
        manifest = read_manifest(out)
    except ValueError as err:
        log.warning("%s; preparing %s from the start", err, out)
        manifest = None
    if manifest is None:
        manifest = {"format": FORMAT, "version": VERSION, "plan": [], "stages": {}}
    planned = [stage.name for stage in stages]
    redo_from = len(ORDER)
    for name in [n for n in manifest["stages"] if n not in planned]:
        for file in manifest["stages"].pop(name)["files"]:
            _remove(out / file)
        redo_from = min(redo_from, ORDER.index(name))
    manifest["plan"] = planned
    _write_manifest(out, manifest)
    report: dict[str, str] = {}
    with _bar(len(stages), desc, "stage", progress) as bar:
        for stage in stages:
            bar.set_postfix_str(stage.name)
            record = manifest["stages"].get(stage.name)
            if (ORDER.index(stage.name) < redo_from and stage_done(out, manifest, stage.name)
                    and record["inputs"] == stage.inputs):
                log.info("%s: stage %s already done; skipped", out, stage.name)
                report[stage.name] = "skipped"
                bar.update()
                continue
            redo_from = min(redo_from, ORDER.index(stage.name))
            for name in [n for n in manifest["stages"] if ORDER.index(n) >= ORDER.index(stage.name)]:
                del manifest["stages"][name]  # forgotten before their files change
            _write_manifest(out, manifest)
            staging = out / STAGING / stage.name
            _remove(staging)
            staging.mkdir(parents=True)
            log.info("%s: stage %s", out, stage.name)
            stage.make(staging)
            for rel in stage.outputs:
                if not (staging / rel).exists():
                    raise RuntimeError(f"stage {stage.name} did not write {rel}")
                _remove(out / rel)
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                (staging / rel).rename(out / rel)
            shutil.rmtree(out / STAGING)
            manifest["stages"][stage.name] = {"inputs": stage.inputs, "files": list(stage.outputs)}
            _write_manifest(out, manifest)
            report[stage.name] = "made"
            bar.update()
    return report


# ---------------------------------------------------------------- onnxruntime exports

def export_for_onnxruntime(name: str, source: str | Path, out: Path) -> None:
    """Export one model into `out`: an LM ("target", "draft" or "clone_target") as a checked weight-only
    int8 graph (the target with the proposers trained for it, found beside it), a codec ("codec",
    "clone_codec") as its checked float32 decoder graph."""
    if name in ("codec", "clone_codec"):
        from pcgtts.export.codec_graph import export_codec

        log.info("exporting the %s decoder into %s", name.replace("_", " "), out)
        export_codec(source, out)
        return
    from pcgtts.export.onnx_lm import export_lm
    from pcgtts.runtime.loading import proposer_files

    log.info("exporting the %s (int8) into %s", name, out)
    heads, _, eagle = proposer_files(ModelPaths(target=str(source)))  # a target's own, carried with it
    export_lm(source, out, quantize="int8", **({"eagle": eagle, "heads": heads} if name == "target" else {}))


def export_models(models: ModelPaths, root: Path, names: list[str], desc: str, progress: bool = True) -> None:
    """Export `names` of `models` into `root/<name>`, one bar step each, other libraries' output held back."""
    from pcgtts.export.noise import held_back

    with _bar(len(names), desc, "model", progress) as bar, held_back("export"):
        for name in names:
            bar.set_postfix_str(name)
            export_for_onnxruntime(name, getattr(models, name), root / name)
            bar.update()


def _onnx_stage(models: ModelPaths, progress: bool) -> Stage:
    names = [name for name in EXPORTED if getattr(models, name) is not None]
    return Stage(ONNX_STAGE, tuple(f"{ONNX_FOLDER}/{name}" for name in names),
                 lambda staging: export_models(models, staging / ONNX_FOLDER, names,
                                               "exporting for onnxruntime", progress))


# ---------------------------------------------------------------- the built-in voice

def prepare_builtin(out: str | Path, pack_dir: str | Path, onnx: bool = True, progress: bool = True,
                    wait: bool = False) -> dict[str, str]:
    """Prepare the built-in voice (its committed folder `pack_dir`) into `out`: expanded (with its group
    table, its preset voices beside the target and its own settings, so that `--prepared` plays it as the
    built-in voice), and with `onnx` exported for onnxruntime. {stage: "made" or "skipped"}. With `wait`,
    another process preparing `out` is waited for rather than refused."""
    from pcgtts.runtime.config import PRESETS_FOLDER
    from pcgtts.runtime.prepared import SETTINGS
    from pcgtts.runtime.voicepack import check_voice_settings, voice_digest

    out, pack = Path(out), Path(pack_dir)
    if not (pack / "voice.json").is_file():
        raise ValueError(f"{pack}: no voice.json (no trained voice ships with this install); "
                         "give --checkpoint and --codec to prepare a checkpoint of your own")
    meta = json.loads((pack / "voice.json").read_text())
    layout = {name: rel for name, rel in LAYOUT.items() if name not in OPTIONAL or name in meta}

    def expand(staging: Path) -> None:
        from pcgtts.export.noise import held_back
        from pcgtts.train.package import expand_voice

        with held_back("the built-in voice's expansion", streams=False):  # its group table draws a bar
            paths = expand_voice(pack, staging / "expanded")
        for name, rel in layout.items():
            Path(paths[name]).rename(staging / rel)
        if (pack / PRESETS_FOLDER / "voices.json").is_file():  # found beside the target, as any checkpoint's
            shutil.copytree(pack / PRESETS_FOLDER, staging / LAYOUT["target"] / PRESETS_FOLDER)
        (staging / SETTINGS).write_text(json.dumps(check_voice_settings(meta.get("settings", {}), pack / "voice.json")))

    stages = [Stage("expand", (*layout.values(), SETTINGS), expand, {"voice": voice_digest(pack)})]
    if onnx:
        stages.append(_onnx_stage(ModelPaths(**{name: str(out / rel) for name, rel in layout.items()}), progress))
    return run_stages(out, stages, "preparing the built-in voice", progress, wait)


# ---------------------------------------------------------------- a user's checkpoint

@dataclass(frozen=True)
class CheckpointPreparation:
    """What `prepare_checkpoint` makes of a LLaSA-format checkpoint and its codec (and, optionally, the
    codec whose decoder renders voices with a reference and the target that speaks them:
    `ModelPaths.clone_codec`, `ModelPaths.clone_target`)."""

    checkpoint: Path
    codec: Path
    group_size: float = DEFAULT_GROUP_SIZE  # the table's mean group size (θ chosen for it on the target)
    draft_layers: tuple[int, ...] | int | None = None  # a count spread over the depth, or indices; None: a quarter
    eagle_steps: int = 0  # > 0: train an EAGLE draft for the target this many steps
    onnx: bool = True
    clone_codec: Path | None = None  # same encoder as `codec`, another decoder
    clone_target: Path | None = None  # a LLaSA checkpoint with the checkpoint's tokenizer (another model)

    def __post_init__(self) -> None:
        object.__setattr__(self, "checkpoint", Path(self.checkpoint))
        object.__setattr__(self, "codec", Path(self.codec))
        for name in ("clone_codec", "clone_target"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        if not 1 <= self.group_size <= GROUP_CAP:
            raise ValueError(f"group size must lie in [1, {GROUP_CAP}], got {self.group_size:g}")
        if self.eagle_steps < 0:
            raise ValueError(f"eagle steps must be >= 0, got {self.eagle_steps}")
        if isinstance(self.draft_layers, list):
            object.__setattr__(self, "draft_layers", tuple(self.draft_layers))


def check_checkpoint(prep: CheckpointPreparation) -> int:
    """A one-line ValueError unless the checkpoint is a LLaSA-format LlamaForCausalLM folder with its
    tokenizer, whose config.json describes the weights it stores (`check_weight_shapes`: headers only),
    and the codec an X-codec2 folder (`check_codec_folder`); a clone target a LLaSA checkpoint with the
    checkpoint's vocabulary (`draft.check_draft_layout`); the target's layer count."""
    from pcgtts.runtime.lm.checkpoint import check_weight_shapes, load_tokenizer, same_tokenizer_files

    for flag, folder in (("--checkpoint", prep.checkpoint), ("--codec", prep.codec), ("--clone-codec", prep.clone_codec),
                         ("--clone-target", prep.clone_target)):
        if folder is not None and not folder.is_dir():
            raise ValueError(f"{flag} {folder}: folder not found")
    config = check_llasa_checkpoint(prep.checkpoint)
    check_codec_folder(prep.codec)
    if prep.clone_codec is not None:
        check_codec_folder(prep.clone_codec, "--clone-codec")
    check_weight_shapes(prep.checkpoint)  # its errors name the folder or the damaged file
    if prep.clone_target is not None:
        from pcgtts.runtime.lm.draft import check_draft_layout

        check_llasa_checkpoint(prep.clone_target, "--clone-target")
        check_weight_shapes(prep.clone_target)
        same = same_tokenizer_files(prep.checkpoint, prep.clone_target)  # else the target's tokenizer compares
        check_draft_layout(prep.checkpoint, None if same else load_tokenizer(prep.checkpoint), prep.clone_target,
                           role="clone target")
    layers = int(config.get("num_hidden_layers", 0))
    wanted = prep.draft_layers
    if isinstance(wanted, int) and not 1 <= wanted <= layers:
        raise ValueError(f"--draft-layers: a count in [1, {layers}], got {wanted}")
    if isinstance(wanted, tuple) and (not wanted or min(wanted) < 0 or max(wanted) >= layers):
        raise ValueError(f"--draft-layers: layer indices in [0, {layers}), got {','.join(map(str, wanted))}")
    return layers


def check_llasa_checkpoint(folder: Path, flag: str = "--checkpoint") -> dict:
    """A one-line ValueError unless `folder` is a LLaSA-format LlamaForCausalLM checkpoint (Hugging Face
    format, not an export) with its tokenizer; its config.json."""
    from pcgtts.runtime.lm.checkpoint import read_config, weight_files
    from pcgtts.runtime.lm.graph_meta import exported_kind

    if exported_kind(folder) is not None:
        raise ValueError(f"{flag} {folder}: an exported graph folder, not a checkpoint; give the "
                         "Hugging Face-format checkpoint it was exported from")
    try:
        config = read_config(folder)
        weight_files(folder)
    except (OSError, ValueError) as err:
        raise ValueError(f"{flag} {folder}: not a LLaSA checkpoint ({err})") from None
    if "LlamaForCausalLM" not in config.get("architectures", []):
        raise ValueError(f"{flag} {folder}: not a LLaSA checkpoint (architectures "
                         f"{config.get('architectures')}, expected LlamaForCausalLM)")
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"{flag} {folder}: not a LLaSA checkpoint (no tokenizer.json)")
    return config


def check_codec_folder(folder: Path, flag: str = "--codec") -> None:
    """A one-line ValueError unless `folder` is an X-codec2 checkpoint (Hugging Face format) whose
    weights hold its decoder (read from the safetensors header); an LM checkpoint or an exported
    decoder given in its place is named as what it is."""
    from pcgtts.runtime.audio.onnx_codec import is_exported_codec
    from pcgtts.runtime.lm.checkpoint import open_weights, read_config
    from pcgtts.runtime.lm.graph_meta import exported_kind

    where = f"{flag} {folder}"
    if is_exported_codec(folder):
        raise ValueError(f"{where}: an exported codec decoder, not an X-codec2 checkpoint; give the Hugging "
                         "Face-format X-codec2 folder it was exported from")
    if exported_kind(folder) is not None:
        raise ValueError(f"{where}: an exported LM graph, not an X-codec2 folder")
    try:
        config = read_config(folder)
    except ValueError as err:
        raise ValueError(f"{where}: not an X-codec2 folder ({err})") from None
    kind = config.get("model_type")
    if kind != "xcodec2":
        lm = kind == "llama" or "LlamaForCausalLM" in (config.get("architectures") or [])
        what = "a LLaSA LM checkpoint, not its codec" if lm else f"model_type {kind!r}"
        raise ValueError(f"{where}: not an X-codec2 folder ({what}; an X-codec2 config.json has "
                         "model_type 'xcodec2')")
    with open_weights(folder / "model.safetensors") as f:
        keys = list(f.keys())
    for prefix in ("quantizer.", "acoustic_decoder."):
        if not any(key.startswith(prefix) for key in keys):
            raise ValueError(f"{where}: not an X-codec2 checkpoint (its model.safetensors has no {prefix}* weights)")


def prepare_checkpoint(prep: CheckpointPreparation, out: str | Path, progress: bool = True) -> dict[str, str]:
    """Prepare a user's LLaSA-format checkpoint into `out`: {stage: "made" or "skipped"}."""
    out = Path(out)
    layers = check_checkpoint(prep)
    draft_layers = prep.draft_layers if prep.draft_layers is not None else max(1, layers // 4)
    draft_layers = list(draft_layers) if isinstance(draft_layers, tuple) else draft_layers
    target = out / LAYOUT["target"]

    def copy(source: Path, rel: str) -> Callable[[Path], None]:
        return lambda staging: shutil.copytree(source, staging / rel)

    def groups(staging: Path) -> None:
        from pcgtts.export.group_table import build_groups_for_model

        table = build_groups_for_model(target, None, GROUP_CAP, progress=progress, mean_size=prep.group_size)
        table.save(staging / LAYOUT["groups"])

    def draft(staging: Path) -> None:
        from pcgtts.train.subset_draft import make_layer_subset_draft

        make_layer_subset_draft(target, staging / LAYOUT["draft"], draft_layers)

    def eagle(staging: Path) -> None:
        from pcgtts.runtime.lm.eagle import EAGLE_FILE
        from pcgtts.train.distill import read_sentences
        from pcgtts.train.eagle import EagleTrainConfig, train_eagle

        (staging / "target").mkdir()
        cfg = EagleTrainConfig(target=target, out=staging / "target" / EAGLE_FILE, work_dir=out / ".eagle-work",
                               sentences=tuple(read_sentences(None)), steps=prep.eagle_steps)
        train_eagle(cfg)
        shutil.rmtree(cfg.work_dir, ignore_errors=True)  # kept until then: an interrupted training resumes

    from pcgtts.runtime.lm.eagle import EAGLE_FILE

    stages = [Stage("codec", (LAYOUT["codec"],), copy(prep.codec, LAYOUT["codec"]),
                    {"source": str(prep.codec.resolve()), "files": folder_fingerprint(prep.codec)}),
              *([Stage("clone_codec", (LAYOUT["clone_codec"],), copy(prep.clone_codec, LAYOUT["clone_codec"]),
                       {"source": str(prep.clone_codec.resolve()), "files": folder_fingerprint(prep.clone_codec)})]
                if prep.clone_codec is not None else []),
              Stage("target", (LAYOUT["target"],), copy(prep.checkpoint, LAYOUT["target"]),
                    {"source": str(prep.checkpoint.resolve()), "files": folder_fingerprint(prep.checkpoint)}),
              Stage("groups", (LAYOUT["groups"],), groups, {"mean_size": prep.group_size, "cap": GROUP_CAP}),
              Stage("draft", (LAYOUT["draft"],), draft, {"layers": draft_layers})]
    if prep.eagle_steps:
        stages.append(Stage("eagle", (f"{LAYOUT['target']}/{EAGLE_FILE}",), eagle, {"steps": prep.eagle_steps}))
    if prep.clone_target is not None:
        stages.append(Stage("clone_target", (LAYOUT["clone_target"],), copy(prep.clone_target, LAYOUT["clone_target"]),
                            {"source": str(prep.clone_target.resolve()), "files": folder_fingerprint(prep.clone_target)}))
    if prep.onnx:
        models = ModelPaths(**{name: str(out / LAYOUT[name]) for name in EXPORTED
                               if name not in OPTIONAL or getattr(prep, name, None) is not None})
        stages.append(_onnx_stage(models, progress))
    return run_stages(out, stages, f"preparing {prep.checkpoint.name}", progress)


__all__ = ["Stage", "ORDER", "STAGING", "LOCK", "DEFAULT_GROUP_SIZE", "GROUP_CAP", "FolderBusy", "preparing",
           "folder_fingerprint", "run_stages", "export_for_onnxruntime", "export_models", "prepare_builtin",
           "CheckpointPreparation", "check_checkpoint", "check_llasa_checkpoint", "check_codec_folder", "prepare_checkpoint"]
