"""Preset voices: named `.voice` files that ship with a model, in a folder indexed by `voices.json`.

    voices.json  {"format": "pcgtts-presets", "version": 1, "default": "heart",
                  "voices": [{"name": "heart", "file": "heart.voice", "description": "..."}, ...],
                  "aliases": {"alloy": "heart", ...}}

A preset is a voice file (reference codes + transcript, `runtime/audio/voice.py`) that the target
was trained to follow as a voice prompt. `default` names the preset the target speaks as when no
voice is given: the model's own voice, so naming it (or an alias of it) speaks unprompted too, as
no voice does (`prompt`), and it is heard through the model's own codec; its file is the reference
it was learnt from. Aliases (OpenAI's voice names, for example) map onto presets. The built-in voice's presets live in its voice folder; any target may carry its
own in `<target>/voices`.

    presets = Presets.load(folder)
    presets.voice("nova")            # the Voice of the preset "nova" names (an alias)
    presets.prompt("alloy")          # what it is spoken with: None for the default preset (no prompt)
    presets.listing()                # [{"name": ..., "description": ..., "default": ...}, {"name": "alloy", "alias_of": ...}]
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from pcgtts.runtime.audio.voice import Voice

FORMAT, VERSION, INDEX = "pcgtts-presets", 1, "voices.json"
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
    file: str  # relative to the presets folder
    description: str = ""


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
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(f"{folder / INDEX}: format {meta.get('format')!r} version {meta.get('version')!r}, "
                             f"expected {FORMAT!r} {VERSION}")
        voices = tuple(Preset(v["name"], v["file"], v.get("description", "")) for v in meta.get("voices", ()))
        for p in voices:
            if Path(p.file).name != p.file or not (folder / p.file).is_file():
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
            return self.prompt(voice)
        return Voice.load(path)

    def prompt(self, name: str) -> Voice | None:
        """The voice prompt preset (or alias) `name` speaks with: None for the default preset (the model's
        own voice, unprompted), else its Voice."""
        name = self.resolve(name)
        return None if name == self.default else self.voice(name)

    def voice(self, name: str) -> Voice:
        """The Voice of preset (or alias) `name`, read once."""
        name = self.resolve(name)
        with self._lock:
            if name not in self._loaded:
                preset = next(p for p in self.voices if p.name == name)
                self._loaded[name] = Voice.load(self.folder / preset.file)
            return self._loaded[name]

    def listing(self) -> list[dict]:
        """Presets (name, description, seconds of reference, whether it is the default) then aliases (alias_of)."""
        rows = [{"name": p.name, "description": p.description, "default": p.name == self.default,
                 "seconds": round(len(self.voice(p.name).codes) / 50, 2)} for p in self.voices]
        return rows + [{"name": a, "alias_of": n} for a, n in self.aliases.items()]


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


def write_presets(folder: str | Path, voices: dict[str, tuple[Voice, str]], default: str | None,
                  aliases: dict[str, str]) -> Path:
    """Write `voices` ({name: (Voice, description)}) as NAME.voice files and their voices.json into
    `folder` (checked as `Presets` first). Returns the index's path."""
    folder = Path(folder)
    presets = Presets(folder, tuple(Preset(n, f"{n}.voice", d) for n, (_, d) in voices.items()), default, aliases)
    folder.mkdir(parents=True, exist_ok=True)
    for name, (voice, _) in voices.items():
        voice.save(folder / f"{name}.voice")
    index = {"format": FORMAT, "version": VERSION, "default": presets.default,
             "voices": [{"name": p.name, "file": p.file, "description": p.description} for p in presets.voices],
             "aliases": presets.aliases}
    tmp = folder / f"{INDEX}.tmp"
    tmp.write_text(json.dumps(index, indent=2) + "\n")
    tmp.replace(folder / INDEX)
    return folder / INDEX


__all__ = ["DEFAULT_VOICE", "Preset", "Presets", "UnknownVoice", "is_recording", "write_presets", "INDEX"]
