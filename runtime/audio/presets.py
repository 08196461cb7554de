"""Preset voices: named voices that ship with a model, in a folder indexed by `voices.json`.

    voices.json  {"format": "pcgtts-presets", "version": 2, "default": "heart",
                  "voices": [{"name": "heart", "file": "heart.voice", "description": "..."},
                             {"name": "ember", "transform": {"formant": 0.9, "pitch": 0.8}, "description": "..."}, ...],
                  "aliases": {"alloy": "heart", ...}}

A preset is spoken with a voice prompt, an audio transform, or both:
- `file`: a voice file (reference codes + transcript, `runtime/audio/voice.py`) that the target was
  trained to follow as a voice prompt;
- `transform`: the model's voice (or the prompt's) with its formants and pitch moved
  (`runtime/audio/transform.py`): a preset made this way is as intelligible as the voice it is made of.
`default` names the preset the target speaks as when no voice is given: the model's own voice, so
naming it (or an alias of it) speaks unprompted too, as no voice does (`speaker`), and it is heard
through the model's own codec; its file, if any, is the reference it was learnt from. Aliases
(OpenAI's voice names, for example) map onto presets. The built-in voice's presets live in its voice
folder; any target may carry its own in `<target>/voices`. Version 1 indexes (every preset a file)
are read too.

    presets = Presets.load(folder)
    presets.speaker("nova")          # PresetVoice(name, prompt: Voice | None, transform: VoiceTransform | None)
    presets.listing()                # [{"name": ..., "description": ..., "default": ...}, {"name": "alloy", "alias_of": ...}]
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from pcgtts.runtime.audio.transform import VoiceTransform
from pcgtts.runtime.audio.voice import Voice

FORMAT, VERSION, INDEX = "pcgtts-presets", 2, "voices.json"
READABLE_VERSIONS = (1, 2)
NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
DEFAULT_VOICE = "default"  # wherever a voice is named: the model's own voice, unprompted
# Recordings, told from voice files (zip archives) by their suffix or their first bytes.
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".m4a", ".aac", ".aif", ".aiff", ".webm")
AUDIO_MAGIC = (b"RIFF", b"fLaC", b"OggS", b"ID3", b"FORM", b"\xff\xfb", b"\xff\xf3", b"\xff\xf2")


class UnknownVoice(ValueError):
    """A voice name that is neither a preset, an alias nor an existing file."""


@dataclass(frozen=True)
class Preset:
    name: str
    file: str | None = None  # its voice prompt, relative to the presets folder (None: unprompted)
    description: str = ""
    transform: VoiceTransform | None = None  # applied to its audio (None: heard as spoken)


@dataclass(frozen=True, eq=False)
class PresetVoice:
    """What a preset is spoken with: a voice prompt (None: the model's own voice) and an audio transform."""

    name: str
    prompt: Voice | None
    transform: VoiceTransform | None


@dataclass(frozen=True, eq=False)
class Presets:
    folder: Path | None = None
    voices: tuple[Preset, ...] = ()
    default: str | None = None  # the preset heard when no voice is given
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> preset name
    _loaded: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        names = [p.name for p in self.voices]
        for name in names + list(self.aliases):
            if not NAME.fullmatch(name):
                raise ValueError(f"preset voice name {name!r}: 1-32 lower-case letters, digits, '_' or '-'")
        if len(set(names)) != len(names) or set(names) & set(self.aliases):
            raise ValueError("preset voice names and aliases must all be distinct")
        missing = {a: n for a, n in self.aliases.items() if n not in names}
        if missing:
            raise ValueError(f"aliases of no preset: {missing}")
        if self.default is not None and self.default not in names:
            raise ValueError(f"the default voice {self.default!r} is not a preset")

    @classmethod
    def load(cls, folder: str | Path | None) -> "Presets":
        """The presets indexed in `folder`/voices.json; none when `folder` is None or has no index."""
        if folder is None or not (Path(folder) / INDEX).is_file():
            return cls()
        folder = Path(folder)
        try:
            meta = json.loads((folder / INDEX).read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{folder / INDEX}: unreadable ({err})") from None
        if meta.get("format") != FORMAT or meta.get("version") not in READABLE_VERSIONS:
            raise ValueError(f"{folder / INDEX}: format {meta.get('format')!r} version {meta.get('version')!r}, "
                             f"expected {FORMAT!r} {' or '.join(map(str, READABLE_VERSIONS))}")
        voices = tuple(_entry(v, folder / INDEX) for v in meta.get("voices", ()))
        for p in voices:
            if p.file is not None and (Path(p.file).name != p.file or not (folder / p.file).is_file()):
                raise ValueError(f"{folder / INDEX}: preset {p.name!r} names a missing file {p.file!r}")
        return cls(folder, voices, meta.get("default"), dict(meta.get("aliases", {})))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.voices)

    def resolve(self, name: str) -> str:
        """The preset `name` means (itself or what it is an alias of); UnknownVoice, listing the names, if none."""
        if name in self.names:
            return name
        if name in self.aliases:
            return self.aliases[name]
        if not self.voices:
            raise UnknownVoice(f"voice {name!r} is neither a voice file nor a preset: this model has no preset "
                               f"voices")
        raise UnknownVoice(f"voice {name!r} is neither a voice file nor a preset; presets: {', '.join(self.names)}"
                           + (f" (aliases: {', '.join(self.aliases)})" if self.aliases else ""))

    def find(self, voice: str | Path, audio_hint: str) -> Voice | None:
        """The Voice that `voice` names: `default` (None: the model's own voice), an existing path (a
        voice file), or else a preset's name. A one-line ValueError for an empty name, a folder, or a
        recording (`audio_hint` then says how to clone from one); UnknownVoice for an unknown name."""
        if isinstance(voice, str):
            if not voice.strip():
                raise ValueError(f"an empty voice name: give a preset's name, {DEFAULT_VOICE!r} or a voice file")
            if voice == DEFAULT_VOICE and voice not in self.names and voice not in self.aliases:
                return None
        path = Path(voice)
        if path.is_dir():
            raise ValueError(f"{voice} is a directory, not a voice file")
        if path.is_file() and is_recording(path):
            raise ValueError(f"{voice} is an audio file: {audio_hint}")
        if isinstance(voice, str) and not path.exists():
            return self.speaker(voice)
        return Voice.load(path)

    def speaker(self, name: str) -> PresetVoice:
        """What preset (or alias) `name` is spoken with: its voice prompt (None for the default preset, the
        model's own voice, and for presets made by a transform alone) and its audio transform."""
        name = self.resolve(name)
        preset = self._preset(name)
        prompt = None if name == self.default or preset.file is None else self.voice(name)
        return PresetVoice(name, prompt, preset.transform)

    def voice(self, name: str) -> Voice | None:
        """The voice file of preset (or alias) `name`, read once; None for a preset without one."""
        name = self.resolve(name)
        preset = self._preset(name)
        if preset.file is None:
            return None
        with self._lock:
            if name not in self._loaded:
                self._loaded[name] = Voice.load(self.folder / preset.file)
            return self._loaded[name]

    def _preset(self, name: str) -> Preset:
        return next(p for p in self.voices if p.name == name)

    def listing(self) -> list[dict]:
        """Presets (name, description, seconds of reference if it has one, its transform, whether it is
        the default) then aliases (alias_of)."""
        rows = []
        for p in self.voices:
            row = {"name": p.name, "description": p.description, "default": p.name == self.default}
            if p.file is not None:
                row["seconds"] = round(len(self.voice(p.name).codes) / 50, 2)
            if p.transform is not None:
                row["transform"] = p.transform.to_dict()
            rows.append(row)
        return rows + [{"name": a, "alias_of": n} for a, n in self.aliases.items()]


def _entry(entry: dict, index: Path) -> Preset:
    """One entry of an index: a name, and a file, a transform, both or neither (the model's own voice)."""
    try:
        transform = VoiceTransform.from_dict(entry["transform"]) if "transform" in entry else None
        return Preset(entry["name"], entry.get("file"), entry.get("description", ""), transform)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{index}: preset entry {entry!r}: {err}") from None


def is_recording(path: Path) -> bool:
    """Whether the file at `path` is a recording (by its suffix or its first bytes), not a voice file."""
    if path.suffix.lower() in AUDIO_SUFFIXES:
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head.startswith(AUDIO_MAGIC)


def write_presets(folder: str | Path, voices: dict[str, tuple[Voice | None, str]], default: str | None,
                  aliases: dict[str, str], transforms: dict[str, VoiceTransform] | None = None) -> Path:
    """Write `voices` ({name: (Voice or None, description)}) as NAME.voice files and their voices.json
    into `folder` (checked as `Presets` first); `transforms`: {name: VoiceTransform} of presets heard
    through one (a preset with neither a Voice nor a transform is the model's own voice). Returns the
    index's path."""
    folder = Path(folder)
    transforms = transforms or {}
    unknown = set(transforms) - set(voices)
    if unknown:
        raise ValueError(f"transforms of no preset: {sorted(unknown)}")
    presets = Presets(folder, tuple(Preset(n, f"{n}.voice" if v is not None else None, d, transforms.get(n))
                                    for n, (v, d) in voices.items()), default, aliases)
    folder.mkdir(parents=True, exist_ok=True)
    for name, (voice, _) in voices.items():
        if voice is not None:
            voice.save(folder / f"{name}.voice")
    index = {"format": FORMAT, "version": VERSION, "default": presets.default,
             "voices": [{"name": p.name, **({"file": p.file} if p.file else {}), "description": p.description,
                         **({"transform": p.transform.to_dict()} if p.transform else {})} for p in presets.voices],
             "aliases": presets.aliases}
    tmp = folder / f"{INDEX}.tmp"
    tmp.write_text(json.dumps(index, indent=2) + "\n")
    tmp.replace(folder / INDEX)
    return folder / INDEX


__all__ = ["DEFAULT_VOICE", "Preset", "PresetVoice", "Presets", "UnknownVoice", "is_recording", "write_presets", "INDEX"]
