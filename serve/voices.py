"""The voice store: named `.voice` files (runtime `Voice`) in one directory, plus the model's own voice
("default": no voice prompt) and its preset voices (`runtime/audio/presets.py`).

Names are validated (letters, digits, `_`, `-`; no paths) before touching the disk; a voice is
written with `Voice.save` (temporary file + os.replace, so a reader never sees half a file).
Replicas share voices by pointing `voices_dir` at one shared directory (NFS, a mounted bucket):
each request loads its voice file from there, so a voice added on one replica is seen by all.
OpenAI's voice names (alloy, echo, ...) are the presets' aliases where the model names them, else
aliases of "default", so existing clients work unchanged; uploads may take no built-in name.
"""

from __future__ import annotations

import logging
import re
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from pcgtts.runtime.audio.chunk import SAMPLE_RATE
from pcgtts.runtime.audio.presets import DEFAULT_VOICE, Presets, PresetVoice
from pcgtts.runtime.audio.voice import Voice

log = logging.getLogger(__name__)

BUILTIN = DEFAULT_VOICE
OPENAI_ALIASES = ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
                  "shimmer", "verse")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
SUFFIX = ".voice"


class UploadError(ValueError):
    """A voice upload refused for one of its form fields (`param`: "name", "text" or "audio")."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class VoiceExists(UploadError):
    def __init__(self, name: str):
        super().__init__(f"voice {name!r} already exists; DELETE it first", "name")


class CannotEncode(RuntimeError):
    """This server has no codec encoder to turn reference recordings into voices."""


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError("voice names are 1-64 letters, digits, '_' or '-', starting with a letter or digit")
    return name


class VoiceStore:
    def __init__(self, directory: str | Path, encoder: Callable[[], object] | None, presets: Presets | None = None):
        """encoder: returns the codec that encodes reference recordings, loading it on first use
        (`Synthesizer.reference_encoder`: the same encoder `pcgtts speak --ref-audio` uses);
        None: this store only serves voices made elsewhere. presets: the model's preset voices."""
        self.presets = presets if presets is not None else Presets()
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._reference_encoder = encoder
        self._encoder_lock = threading.Lock()
        self._cache: dict[str, tuple[int, Voice]] = {}

    def is_builtin(self, name: str) -> bool:
        return name in (BUILTIN, *OPENAI_ALIASES, *self.presets.names, *self.presets.aliases)

    def path(self, name: str) -> Path:
        return self.dir / f"{check_name(name)}{SUFFIX}"

    def get(self, name: str) -> Voice | PresetVoice | None:
        """The voice called `name`: a preset's PresetVoice, a stored Voice, None for the model's own voice;
        KeyError if there is none."""
        if name in self.presets.names or name in self.presets.aliases:
            return self.presets.speaker(name)
        if self.is_builtin(name):
            return None
        path = self.path(name)
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            raise KeyError(name) from None
        cached = self._cache.get(name)
        if cached is None or cached[0] != mtime:
            cached = (mtime, Voice.load(path))
            self._cache[name] = cached
        return cached[1]

    def list(self) -> list[dict]:
        own = {"name": BUILTIN, "builtin": True, "description": "the model's own voice (no voice prompt)"}
        if self.presets.default is not None:
            own["sounds_like"] = self.presets.default
        voices = [own] + [{**row, "builtin": True} for row in self.presets.listing()]
        voices += [{"name": a, "builtin": True, "alias_of": BUILTIN} for a in OPENAI_ALIASES
                   if a not in self.presets.aliases and a not in self.presets.names]
        for path in sorted(self.dir.glob(f"*{SUFFIX}")):
            name = path.name[:-len(SUFFIX)]
            if not NAME.fullmatch(name):
                continue
            try:
                voice = self.get(name)
            except (KeyError, ValueError, OSError) as err:
                log.warning("skipping unreadable voice file %s: %s", path, err)
                continue
            voices.append({"name": name, "builtin": False, "text": voice.text,
                           "seconds": round(len(voice.codes) / 50, 2)})
        return voices

    def add(self, name: str, audio_path: str | Path, text: str, max_seconds: float) -> Voice:
        """Encode a reference recording into a stored voice (validated like `pcgtts voice add`).
        Raises UploadError naming the field at fault, VoiceExists, or CannotEncode."""
        from pcgtts.runtime.audio.io import load_audio
        from pcgtts.runtime.text.prompt import check_text

        try:
            check_name(name)
        except ValueError as err:
            raise UploadError(str(err), "name") from None
        if self.is_builtin(name):
            raise UploadError(f"{name!r} is a built-in voice name; choose another", "name")
        try:
            check_text(text)
        except ValueError as err:
            raise UploadError(str(err), "text") from None
        try:
            samples = load_audio(audio_path)  # readable, 0.5-30 s, not silent
        except ValueError as err:
            raise UploadError(str(err), "audio") from None
        if len(samples) / SAMPLE_RATE > max_seconds:
            raise UploadError(f"the recording is {len(samples) / SAMPLE_RATE:.1f} s long; this server accepts "
                              f"at most {max_seconds:g} s", "audio")
        with self._encoder_lock:  # one encode at a time; two uploads of one name: the second is refused
            if self.path(name).exists():
                raise VoiceExists(name)
            voice = Voice.from_audio(audio_path, text, self._encoder())
            voice.save(self.path(name))
        log.info("voice %r stored (%d tokens)", name, len(voice.codes))
        return voice

    def delete(self, name: str) -> None:
        if self.is_builtin(name):
            raise ValueError(f"{name!r} is built in and cannot be deleted")
        try:
            self.path(name).unlink()
        except FileNotFoundError:
            raise KeyError(name) from None
        self._cache.pop(name, None)

    def _encoder(self):
        if self._reference_encoder is None:
            raise CannotEncode("it has no codec to encode reference recordings with")
        try:
            return self._reference_encoder()
        except ValueError as err:  # e.g. an exported decoder whose checkpoint is gone
            raise CannotEncode(str(err)) from None


def spooled_to_file(upload_file, suffix: str) -> tempfile.NamedTemporaryFile:
    """Copy an uploaded file object to a named temporary file (soundfile reads by path)."""
    tmp = tempfile.NamedTemporaryFile(suffix=suffix)
    upload_file.seek(0)
    while block := upload_file.read(1 << 20):
        tmp.write(block)
    tmp.flush()
    return tmp
