"""The built-in voice: which models `Synthesizer.from_pretrained()` and the CLI use when none is given.

The speech lab's trained voice when this package ships one (`pcgtts/voice/`: compact fp16 files,
expanded once into the released layouts in the user's cache by `train/package.py`); otherwise
the random-weight demo pair (`tools/demo.py`), whose every use says that its audio is not speech.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from pcgtts.runtime.config import ModelPaths, Settings

log = logging.getLogger(__name__)

VOICE_DIR = Path(__file__).with_name("voice")  # the committed trained voice, when there is one


def trained_voice(pack_dir: Path | None = None, cache_root: Path | None = None) -> ModelPaths | None:
    """The trained voice's models, expanded on first use into the cache; None if none ships."""
    pack_dir = Path(pack_dir) if pack_dir is not None else VOICE_DIR
    if not (pack_dir / "voice.json").is_file():
        return None
    import hashlib

    from pcgtts.tools.demo import default_cache_dir
    from pcgtts.train.package import expand_voice

    digest = hashlib.sha256((pack_dir / "voice.json").read_bytes()).hexdigest()[:16]
    cache = (cache_root or default_cache_dir().parent) / f"voice-{digest}"
    names = ("target", "draft", "codec", "groups")
    paths = {"target": cache / "target", "draft": cache / "draft", "codec": cache / "codec",
             "groups": cache / "groups.pcg"}
    if not all(p.exists() for p in paths.values()):
        log.warning("expanding the built-in voice into %s (once; about a minute on a 2-core CPU)", cache)
        paths = expand_voice(pack_dir, cache)
    return ModelPaths(**{name: str(paths[name]) for name in names})


def builtin_models() -> ModelPaths:
    voice = trained_voice()
    if voice is not None:
        return voice
    from pcgtts.tools.demo import NOT_SPEECH_NOTICE, ensure_demo

    log.warning("no target model given: using the built-in demo models (%s)", NOT_SPEECH_NOTICE)
    paths = ensure_demo()
    return ModelPaths(**{name: str(path) for name, path in paths.items()})


def with_builtin_models(settings: Settings) -> Settings:
    """`settings` with the built-in voice's models when no target is given (refusing draft, codec or
    groups without a target: they would be ignored)."""
    models = settings.models
    if models.target is not None:
        return settings
    given = [name for name in ("draft", "codec", "groups") if getattr(models, name) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} given without a target model; give the target too "
                         "(without one the built-in voice's own models are used)")
    return replace(settings, models=builtin_models())
