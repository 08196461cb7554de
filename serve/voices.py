"""The voice store: named `.voice` files (runtime `Voice`) in one directory, plus the built-in voice.

Names are validated (letters, digits, `_`, `-`; no paths) before touching the disk; a voice is
written with `Voice.save` (temporary file + os.replace, so a reader never sees half a file).
Replicas share voices by pointing `voices_dir` at one shared directory (NFS, a mounted bucket):
each request loads its voice file from there, so a voice added on one replica is seen by all.
OpenAI's voice names (alloy, echo, ...) are aliases of the built-in voice, so existing clients
work unchanged; uploads may not take them.
"""

from __future__ import annotations

import logging
import re
import tempfile
import threading
from pathlib import Path

from pcgtts.runtime.audio.chunk import SAMPLE_RATE
from pcgtts.runtime.audio.voice import Voice

log = logging.getLogger(__name__)

BUILTIN = "default"
OPENAI_ALIASES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
SUFFIX = ".voice"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError("voice names are 1-64 letters, digits, '_' or '-', starting with a letter or digit")
    return name


class VoiceStore:
    def __init__(self, directory: str | Path, codec_dir: str | Path | None):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.codec_dir = codec_dir
        self._encoder = None
        self._encoder_lock = threading.Lock()
        self._cache: dict[str, tuple[int, Voice]] = {}

    @staticmethod
    def is_builtin(name: str) -> bool:
        return name == BUILTIN or name in OPENAI_ALIASES

    def path(self, name: str) -> Path:
        return self.dir / f"{check_name(name)}{SUFFIX}"

    def get(self, name: str) -> Voice | None:
        """The Voice called `name` (None for the built-in voice); KeyError if there is none."""
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
        voices = [{"name": BUILTIN, "builtin": True}]
        voices += [{"name": a, "builtin": True, "alias_of": BUILTIN} for a in OPENAI_ALIASES]
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
        """Encode a reference recording into a stored voice (validated like `pcgtts voice add`)."""
        from pcgtts.runtime.audio.io import load_audio
        from pcgtts.runtime.text.prompt import check_text

        check_name(name)
        if self.is_builtin(name):
            raise ValueError(f"{name!r} is a built-in voice name; choose another")
        check_text(text)
        samples = load_audio(audio_path)  # readable, 0.5-30 s, not silent
        if len(samples) / SAMPLE_RATE > max_seconds:
            raise ValueError(f"the recording is {len(samples) / SAMPLE_RATE:.1f} s long; this server accepts "
                             f"at most {max_seconds:g} s")
        with self._encoder_lock:  # one encode at a time; the encoder is loaded on first use
            voice = Voice.from_audio(audio_path, text, self._load_encoder())
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

    def _load_encoder(self):
        if self._encoder is None:
            from pcgtts.runtime.audio.codec import Codec
            from pcgtts.runtime.audio.onnx_codec import is_exported_codec

            if self.codec_dir is None:
                raise ValueError("this server has no codec folder to encode voices with")
            if is_exported_codec(self.codec_dir):
                raise ValueError("the server's codec is an ONNX export (decoder only): encode voices with "
                                 "`pcgtts voice add --codec <X-codec2 folder>` and copy them into the voices folder")
            self._encoder = Codec.from_pretrained(self.codec_dir, device="cpu", decode_only=False)
        return self._encoder


def spooled_to_file(upload_file, suffix: str) -> tempfile.NamedTemporaryFile:
    """Copy an uploaded file object to a named temporary file (soundfile reads by path)."""
    tmp = tempfile.NamedTemporaryFile(suffix=suffix)
    upload_file.seek(0)
    while block := upload_file.read(1 << 20):
        tmp.write(block)
    tmp.flush()
    return tmp
