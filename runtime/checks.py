"""The checks a synthesis call's arguments and per-call settings pass before any work starts.

Each is a TypeError or ValueError naming the argument; `call_config` builds per-call settings
through the config dataclasses, which check every value (runtime/config.py).
"""

from __future__ import annotations

import typing
from pathlib import Path

import numpy as np

from pcgtts.runtime.audio.presets import PresetVoice
from pcgtts.runtime.audio.voice import Voice
from pcgtts.runtime.config import KEYS, Settings, SynthesisConfig, resolve_settings
from pcgtts.runtime.text.prompt import check_text
from pcgtts.runtime.text.script import LATIN

# The scripts the built-in voice reads (and the demo pair stands in for it): English only
# (pcgtts/voice/MODEL_CARD.md). A checkpoint the user names reads what it was trained on, which
# the runtime cannot tell (LLaSA's own read Chinese and English): no script check unless declared.
BUILTIN_VOICE_SCRIPTS = (LATIN,)


def check_stream_arguments(text, ref_audio, ref_text, voice, config) -> None:
    """`stream()`'s arguments, checked by type and pairing before any work (TypeError / ValueError
    naming the argument)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if ref_audio is not None and not isinstance(ref_audio, (str, Path)):
        raise TypeError(f"ref_audio must be a path (str or Path), got {type(ref_audio).__name__}")
    if ref_text is not None and not isinstance(ref_text, str):
        raise TypeError(f"ref_text must be a str, got {type(ref_text).__name__}")
    if ref_text is not None and ref_audio is None:
        raise ValueError("ref_text is the transcript of ref_audio: give ref_audio too (or a voice=)")
    if voice is not None and not isinstance(voice, (Voice, PresetVoice, str, Path)):
        raise TypeError(f"voice must be a Voice, a voice file path or a preset name, got {type(voice).__name__}")
    if config is not None and not isinstance(config, SynthesisConfig):
        raise TypeError(f"config must be a SynthesisConfig, got {type(config).__name__}")
    check_text(text)  # something to say (before a reference recording is encoded)


def call_config(base: SynthesisConfig, settings: dict) -> SynthesisConfig:
    """`base` with per-call settings given by name (`seed=7`, `temperature=0.6`; None: as in `base`),
    built through the config dataclasses, which check every value; before that, an unknown name or a
    value of the wrong type is a TypeError naming it, and a setting fixed when the models load a
    ValueError."""
    given = {name: value for name, value in settings.items() if value is not None}
    if not given:
        return base
    settings_now = Settings(synthesis=base)
    for name, value in given.items():
        path = KEYS.get(name)
        if path is None or path[0] != "synthesis":
            if path is not None:
                raise ValueError(f"{name} is fixed when the models load: give it to Synthesizer.from_pretrained")
            per_call = ", ".join(sorted(key for key, where in KEYS.items() if where[0] == "synthesis"))
            raise TypeError(f"unexpected keyword argument {name!r}; the per-call settings are {per_call}")
        check_setting_type(name, value, settings_now)
    return resolve_settings(given, base=settings_now).synthesis


def check_setting_type(name: str, value, settings: Settings) -> None:
    """TypeError naming `name` unless `value` has the type its config dataclass field declares (an
    int is a float; a bool is no number)."""
    owner = settings
    for attr in KEYS[name][:-1]:
        owner = getattr(owner, attr)
    declared = typing.get_type_hints(type(owner))[name]
    allowed = [t for t in typing.get_args(declared) or (declared,) if t is not type(None)]
    if not any(_has_type(value, t) for t in allowed):
        expected = " or ".join(t.__name__ for t in allowed)
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")


def _has_type(value, kind: type) -> bool:
    if kind in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


def check_voice_fits(voice: Voice, num_speech: int) -> None:
    """A voice's codes must be speech tokens of the loaded model (a voice made for a model with a larger
    codebook is refused before any work)."""
    highest = int(np.asarray(voice.codes).max())
    if highest >= num_speech:
        raise ValueError(f"the voice holds codec token {highest}, beyond this model's {num_speech} speech tokens "
                         f"(it was made for another model)")


def check_scripts(scripts) -> tuple[str, ...] | None:
    """`Synthesizer`'s `scripts`: None, or a non-empty tuple of script names (TypeError otherwise)."""
    if scripts is None:
        return None
    if isinstance(scripts, str) or not isinstance(scripts, (tuple, list)) or not scripts \
            or not all(isinstance(name, str) and name for name in scripts):
        raise TypeError(f"scripts must be a tuple of script names such as ('Latin',), got {scripts!r}")
    return tuple(scripts)


def voice_scripts(target: str | Path | None) -> tuple[str, ...] | None:
    """The scripts the voice of `target` reads, as settings name it before the built-in voice fills in:
    the built-in voice's (no target), else None (a named checkpoint's training is not known here)."""
    return BUILTIN_VOICE_SCRIPTS if target is None else None
