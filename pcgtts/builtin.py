"""The built-in voice: which models `Synthesizer.from_pretrained()` and the CLI use when none is given.

The speech lab's trained voice when this package ships one (`pcgtts/voice/`: compact fp16 files,
prepared once into the released layouts in the user's cache by `pcgtts prepare`, `tools/prepare.py`,
which runs on first use when it has not run); otherwise
the random-weight demo pair (`tools/demo.py`), whose every use says that its audio is not speech.

On a CPU with the backend left at "auto", the voice's target and draft run on onnxruntime as
weight-only int8 graphs (and its codec decoder as a float32 graph), the fastest CPU route
(measured in BENCHMARKS.md; its quality cost is within noise, QUALITY.md), exported once beside
the voice's checkpoints (about two minutes on a 2-core CPU, each graph checked against PyTorch). The
first use starts that export in a background process at the lowest CPU priority (one per folder: a
lock; its log is `export.log` in the voice's cache folder) and runs the torch checkpoints meanwhile,
the same model in float32, so the first sound comes in seconds; later runs find the graphs.
`PCGTTS_BACKGROUND_EXPORT=0` exports before loading instead (with a progress bar; the exporter's own
warnings are held back, `export/noise.py`), and so does `backend="onnxruntime"`. Without onnxruntime's
export tools installed, or with `backend="torch"`, the torch checkpoints run.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from pcgtts.runtime.config import PRESETS_FOLDER, ModelPaths, Settings, preset_folder
from pcgtts.runtime.voicepack import check_voice_settings
from pcgtts.runtime.config import codec_graph_beside_a_batch, runs_int8_graphs
from pcgtts.runtime.prepared import EXPORTED, ONNX_FOLDER, ONNX_STAGE, checkpoint_paths, is_prepared

log = logging.getLogger(__name__)

VOICE_DIR = Path(__file__).with_name("voice")  # the committed trained voice, when there is one
BACKGROUND_ENV = "PCGTTS_BACKGROUND_EXPORT"  # "0": export the onnxruntime graphs before loading instead
EXPORT_LOG = "export.log"  # in the voice's cache folder: what the background export did
# what the background process runs (argv: the cache folder, the voice folder)
BACKGROUND_EXPORT = "import sys; from pcgtts.builtin import background_export_main; background_export_main(*sys.argv[1:])"


def runs_demo_models(target: str | None) -> bool:
    """Whether a command given `target` (None: the built-in voice) runs the random-weight demo pair:
    no target, and no trained voice ships. Reports say so and cap its sentences; nothing loads."""
    return target is None and not (VOICE_DIR / "voice.json").is_file()


def trained_voice(pack_dir: Path | None = None, cache_root: Path | None = None) -> ModelPaths | None:
    """The trained voice's models, prepared on first use into the cache (`pcgtts prepare` does it
    ahead); None if none ships. Once prepared, this reads the cache folder's manifest and nothing else."""
    pack_dir = Path(pack_dir) if pack_dir is not None else VOICE_DIR
    if not (pack_dir / "voice.json").is_file():
        return None
    cache = voice_cache(pack_dir, cache_root)
    if not is_prepared(cache, ("expand",)):
        from pcgtts.tools.prepare import prepare_builtin

        log.warning("expanding the built-in voice into %s (once, about 15 s on a 2-core CPU; `pcgtts prepare` "
                    "does it ahead)", cache)
        prepare_builtin(cache, pack_dir, onnx=False, wait=True)  # two first uses at once: one waits for the other
        _note_earlier_expansions(cache)
    return ModelPaths(**checkpoint_paths(cache), presets=builtin_preset_folder(pack_dir))


def builtin_preset_folder(pack_dir: Path | None = None) -> str | None:
    """The shipped voice's preset voices (read in place from its folder), or None when it has none."""
    folder = Path(pack_dir if pack_dir is not None else VOICE_DIR) / PRESETS_FOLDER
    return str(folder) if (folder / "voices.json").is_file() else None


def named_presets(models: ModelPaths):
    """The `Presets` of the models settings name, before anything loads (no target: the built-in voice's)."""
    from pcgtts.runtime.audio.presets import Presets

    if models.target is None and models.prepared is None:
        return Presets.load(models.presets or builtin_preset_folder())
    return Presets.load(preset_folder(models))


def voice_cache(pack_dir: Path | None = None, cache_root: Path | None = None) -> Path:
    """The folder the built-in voice is prepared into: one per voice.json (a changed voice gets a new one)."""
    from pcgtts.runtime.voicepack import voice_cache_folder

    return voice_cache_folder(pack_dir if pack_dir is not None else VOICE_DIR, cache_root)


def _note_earlier_expansions(cache: Path) -> None:
    """Log the other built-in voice expansions beside `cache` (an earlier version's weights, or another
    install's) and what they hold: ~0.5 GB each with their exports. They are left in place, since another
    install sharing the cache may still use one."""
    earlier = sorted(p for p in cache.parent.glob("voice-*") if p.is_dir() and p != cache)
    if earlier:
        size = sum(f.stat().st_size for folder in earlier for f in folder.rglob("*") if f.is_file())
        log.warning("%d earlier expansion(s) of the built-in voice remain beside it (%.0f MB): %s; remove them "
                    "if no other pcgtts install uses them", len(earlier), size / 1e6,
                    ", ".join(str(p) for p in earlier))


def voice_settings(pack_dir: Path | None = None) -> dict:
    """The shipped voice's own settings (voice.json's "settings", e.g. the temperature it reads best
    at): `resolve_settings` puts them under the config file and the flags when no target is named.
    {} when no trained voice ships. Only sampling and decoding settings may be there."""
    import json

    path = Path(pack_dir if pack_dir is not None else VOICE_DIR) / "voice.json"
    if not path.is_file():
        return {}
    return check_voice_settings(json.loads(path.read_text()).get("settings", {}), path)


def builtin_models() -> ModelPaths:
    voice = trained_voice()
    if voice is not None:
        settings = voice_settings()
        if settings:
            log.info("the built-in voice plays at its own settings unless given: %s", settings)
        return voice
    from pcgtts.export.noise import held_back
    from pcgtts.tools.demo import NOT_SPEECH_NOTICE, ensure_demo

    log.warning("no target model given: using the built-in demo models (%s)", NOT_SPEECH_NOTICE)
    with held_back("the demo models", streams=False):  # made on first use; their group table draws a bar
        paths = ensure_demo()
    return ModelPaths(**{name: str(path) for name, path in paths.items()})


def onnx_export_available() -> bool:
    """Whether this install can export and run the built-in voice on onnxruntime (`pcgtts[onnx]`)."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("onnxruntime", "onnxscript"))


def onnx_models(models: ModelPaths) -> ModelPaths:
    """`models` with the target and draft replaced by their weight-only int8 onnxruntime exports
    and the codec (and the clone codec, when the voice has one) by its float32 decoder graph, made once in `ONNX_FOLDER` beside the target (each
    checked against PyTorch, staged and then moved into place, so an interrupted export is made
    again next time; the trained voice's as a stage of its prepared folder). The codec's graph runs a
    window without holding Python's GIL, so the LM's loop is not slowed by the codec thread's per-op
    handoffs; references are still encoded by the checkpoint it was exported from."""
    folder = Path(models.target).parent
    root = folder / ONNX_FOLDER
    if is_prepared(folder, ("expand",)):  # the trained voice, prepared into the cache
        if not is_prepared(folder, (ONNX_STAGE,)):
            from pcgtts.tools.prepare import prepare_builtin

            log.warning("exporting the built-in voice for onnxruntime into %s: once, about a minute on a 2-core "
                        "CPU (each graph checked against PyTorch)", root)
            prepare_builtin(folder, VOICE_DIR, onnx=True)
    else:
        missing = _missing_exports(models, root)
        if missing:
            from pcgtts.tools.prepare import export_models

            log.warning("exporting the built-in voice for onnxruntime into %s: once, about a minute on a 2-core "
                        "CPU (each graph checked against PyTorch)", root)
            export_models(models, root, missing, "exporting the built-in voice")
    exported = {name: str(root / name) for name in EXPORTED if getattr(models, name) is not None}
    return replace(models, **exported)


def _missing_exports(models: ModelPaths, root: Path) -> list[str]:
    """Which of `models` (`EXPORTED`: target, draft, codecs, clone target) have no export in `root` yet."""
    from pcgtts.runtime.audio.onnx_codec import is_exported_codec
    from pcgtts.runtime.lm.graph_meta import exported_kind

    def exported(name: str) -> bool:
        return is_exported_codec(root / name) if "codec" in name else exported_kind(root / name) == "onnx"

    return [name for name in EXPORTED if getattr(models, name) is not None and not exported(name)]


def with_builtin_models(settings: Settings) -> Settings:
    """`settings` with the built-in voice's models when no target is given (refusing draft, codec or
    groups without a target: they would be ignored); on a CPU with the backend at "auto" (or
    "onnxruntime"), their onnxruntime int8 exports and that backend."""
    models, device = settings.models, settings.device
    if models.target is not None:
        return settings
    given = [name for name in ("draft", "codec", "clone_codec", "clone_target", "groups")
             if getattr(models, name) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} given without a target model; give the target too "
                         "(without one the built-in voice's own models are used)")
    if device.backend == "onnxruntime":  # checked before the voice is expanded (seconds on first use)
        if device.dtype != "float32":
            raise ValueError("the built-in voice runs on onnxruntime as an int8 graph; leave dtype at float32")
        if not onnx_export_available():
            raise ValueError("the built-in voice on onnxruntime is exported on first use, which needs "
                             "pip install 'pcgtts[onnx]' (or leave --backend at auto / torch)")
    models = builtin_models()
    if settings.models.presets is not None:  # the user's presets for the built-in voice
        models = replace(models, presets=settings.models.presets)
    if device.backend not in ("auto", "onnxruntime"):
        return replace(settings, models=models)
    if codec_graph_beside_a_batch(device) and onnx_export_available() and not exporting_in_background(models):
        exported = onnx_models(models)  # the batch's LMs stay on torch; its codec windows run on the graphs
        return replace(settings, models=replace(models, codec=exported.codec, clone_codec=exported.clone_codec))
    if device.backend == "auto" and not (runs_int8_graphs(device) and onnx_export_available()):
        log.info("the built-in voice runs on torch (onnxruntime's int8 graphs need a CPU, float32, no "
                 "--quantize or --compile and pcgtts[onnx] installed)")
        return replace(settings, models=models)
    if device.backend == "auto" and exporting_in_background(models):
        return replace(settings, models=models)
    return replace(settings, models=onnx_models(models), device=replace(device, backend="onnxruntime"))


def background_export_enabled() -> bool:
    """Whether the built-in voice's first use exports its onnxruntime graphs in the background (the
    default) rather than before loading (`PCGTTS_BACKGROUND_EXPORT=0`)."""
    return os.environ.get(BACKGROUND_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def exporting_in_background(models: ModelPaths) -> bool:
    """Whether the trained voice `models` (prepared into the cache) is to run on torch while a background
    process exports its onnxruntime graphs: they are not made yet and background export is on. The process
    is started here unless one is at work on the folder already."""
    folder = Path(models.target).parent
    if not background_export_enabled() or not is_prepared(folder, ("expand",)) or is_prepared(folder, (ONNX_STAGE,)):
        return False
    started = start_background_export(folder)
    log.warning("the built-in voice runs on torch (the same model in float32) while %s exports its onnxruntime "
                "graphs, once (about two minutes on a 2-core CPU; log: %s); later runs use them (%s=0: export "
                "before loading instead)", "a background process" if started else "another process",
                folder / EXPORT_LOG, BACKGROUND_ENV)
    return True


def start_background_export(cache: Path, pack_dir: Path | None = None) -> subprocess.Popen | None:
    """Start `pcgtts prepare`'s export of the built-in voice (prepared into `cache`) in a process of its
    own at the lowest CPU priority, writing to cache/EXPORT_LOG; None, starting nothing, when another
    preparation holds the folder's lock. The process outlives its starter and ends when done."""
    from pcgtts.tools.prepare import FolderBusy, preparing

    try:
        with preparing(cache):  # free now; the process takes it for itself (a second one then gives way)
            pass
    except FolderBusy:
        return None
    with open(cache / EXPORT_LOG, "ab") as out:
        return subprocess.Popen([sys.executable, "-c", BACKGROUND_EXPORT, str(cache), str(pack_dir or VOICE_DIR)],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, BACKGROUND_ENV: "0"})


def background_export_main(cache: str, pack_dir: str) -> None:
    """The background export's process: lower its priority, log to stdout (the folder's EXPORT_LOG),
    export unless another preparation got the folder first."""
    from pcgtts.tools.prepare import FolderBusy, prepare_builtin

    os.nice(19)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        report = prepare_builtin(cache, pack_dir, onnx=True, progress=False)
    except FolderBusy as busy:
        log.info("%s", busy)
        return
    log.info("the built-in voice's onnxruntime graphs are ready in %s: %s", cache, report)
