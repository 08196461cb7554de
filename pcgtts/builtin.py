"""The built-in voice: which models `Synthesizer.from_pretrained()` and the CLI use when none is given.

Until the speech lab's trained voice ships, this is the random-weight demo pair (`tools/demo.py`),
made once in the user's cache; every use says that its audio is not speech.
"""

from __future__ import annotations

import logging

from dataclasses import replace

from pcgtts.runtime.config import ModelPaths, Settings

log = logging.getLogger(__name__)


def builtin_models() -> ModelPaths:
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
