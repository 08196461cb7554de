"""`pcgtts.Synthesizer`: the runtime's `Synthesizer` whose `from_pretrained()` with no model named loads
the built-in voice (`pcgtts/builtin.py`: its models, prepared on first use, its own settings and its
preset voices). Everything else is the runtime's (`runtime/synthesizer.py`), which loads only the
models it is given."""

from __future__ import annotations

from pathlib import Path

from pcgtts import builtin
from pcgtts.runtime.checks import voice_scripts
from pcgtts.runtime.config import SynthesisConfig
from pcgtts.runtime.synthesizer import Synthesizer as RuntimeSynthesizer
from pcgtts.runtime.synthesizer import pretrained_settings


class Synthesizer(RuntimeSynthesizer):
    __doc__ = RuntimeSynthesizer.__doc__

    @classmethod
    def from_pretrained(cls, target: str | Path | None = None, draft: str | Path | None = None,
                        codec: str | Path | None = None, groups: str | Path | None = None, *,
                        config: SynthesisConfig | None = None, config_file: str | Path | None = None,
                        force_export: bool = False, **settings) -> "Synthesizer":
        """Load models from local folders (`target=`, or `prepared=` a folder `pcgtts prepare` made).
        None named: the built-in voice, prepared on first use into the cache (`pcgtts prepare` does it
        ahead). On a CPU its int8 onnxruntime graphs are exported once by a background process while
        the first loads run it on torch (the same model in float32; `PCGTTS_BACKGROUND_EXPORT=0`
        exports before loading instead; README: "First use").

        Any setting of `runtime/config.py` may be given by name (`policy="sd"`, `temperature=0.6`,
        `compute_device="cuda"`, `draft_length=4`, ...); precedence is keyword > `config_file`
        (TOML) > `config` > the built-in voice's own settings (no model named, no `config`; e.g. its
        temperature) > default. Everything is validated before a model is loaded. The built-in voice
        reads Latin script only: text mostly in another logs a warning (`scripts`).
        """
        named = pretrained_settings(target, draft, codec, groups, config=config, config_file=config_file,
                                    voice=builtin.voice_settings() if config is None else None, **settings)
        resolved = builtin.with_builtin_models(named)
        return cls.load(resolved.models, resolved.device, resolved.synthesis, force_export=force_export,
                        scripts=voice_scripts(named.models.target))


__all__ = ["Synthesizer"]
