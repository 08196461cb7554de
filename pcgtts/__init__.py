"""pcgtts: streaming speculative text-to-speech for LLaSA-style speech LMs with PCG acceptance.

    from pcgtts import Synthesizer

    synth = Synthesizer.from_pretrained()             # the built-in voice
    for chunk in synth.stream("Hello there."):
        samples = chunk.samples                       # float32 mono 16 kHz, ready to play

The public API is what this module exports; everything else is reached through the sub-packages
(`pcgtts.runtime`, `pcgtts.groups`, `pcgtts.export`, ...). Names are imported on first use, so
`import pcgtts.groups` does not load the runtime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.2.0"

_EXPORTS = {
    "Synthesizer": "pcgtts.front",  # the runtime's, with the built-in voice when no model is named
    "SynthesisStream": "pcgtts.runtime.synthesizer",
    "StreamStats": "pcgtts.runtime.synthesizer",
    "EmptySynthesis": "pcgtts.runtime.synthesizer",
    "BatchFull": "pcgtts.runtime.synthesizer",  # every stream slot of a Synthesizer's batch is taken
    "AudioChunk": "pcgtts.runtime.audio.chunk",
    "Voice": "pcgtts.runtime.audio.voice",
    "Settings": "pcgtts.runtime.config",
    "ModelPaths": "pcgtts.runtime.config",
    "DeviceConfig": "pcgtts.runtime.config",
    "SynthesisConfig": "pcgtts.runtime.config",
    "DecodeConfig": "pcgtts.runtime.config",
    "SamplingConfig": "pcgtts.runtime.config",
    "StreamConfig": "pcgtts.runtime.config",
    "resolve_settings": "pcgtts.runtime.config",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from pcgtts.runtime.audio.chunk import AudioChunk
    from pcgtts.runtime.audio.voice import Voice
    from pcgtts.runtime.config import (DecodeConfig, DeviceConfig, ModelPaths, SamplingConfig, Settings,
                                       StreamConfig, SynthesisConfig, resolve_settings)
    from pcgtts.front import Synthesizer
    from pcgtts.runtime.synthesizer import BatchFull, EmptySynthesis, StreamStats, SynthesisStream


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pcgtts' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
