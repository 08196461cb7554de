"""Voices: a reference recording encoded once into codec tokens + its transcript, in a small file.

A `.voice` file is an uncompressed numpy archive (no pickles) holding the format version, the
codes, the transcript and a fingerprint of the source audio.
"""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pcgtts.runtime.audio.io import load_audio
from pcgtts.runtime.files import atomic_output, check_output_file
from pcgtts.runtime.text.prompt import check_text

FORMAT = "pcgtts-voice-1"


@dataclass(frozen=True, eq=False)
class Voice:
    codes: np.ndarray  # int64 [T] X-codec2 indices of the reference recording
    text: str  # its transcript
    source: str = ""  # sha256 of the 16 kHz reference samples

    def __post_init__(self) -> None:
        check_text(self.text)
        codes = np.asarray(self.codes)
        if codes.ndim != 1 or codes.size == 0 or codes.min() < 0 or codes.max() >= 65536:
            raise ValueError("voice codes must be a non-empty 1-D array of indices in [0, 65536)")

    @classmethod
    def from_audio(cls, path: str | Path, text: str, codec) -> "Voice":
        samples = load_audio(path)
        source = hashlib.sha256(samples.tobytes()).hexdigest()
        return cls(np.asarray(codec.encode(samples), dtype=np.int64), check_text(text), source)

    def save(self, path: str | Path) -> Path:
        path = check_output_file(path)
        with atomic_output(path) as tmp, open(tmp, "wb") as f:  # a file object keeps numpy from adding ".npz"
            np.savez(f, format=np.array(FORMAT), codes=self.codes.astype(np.int64), text=np.array(self.text),
                     source=np.array(self.source))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Voice":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"voice file not found: {path}")
        not_a_voice = f"{path} is not a pcgtts voice file (make one with `pcgtts voice add`)"
        try:
            data = np.load(path, allow_pickle=False)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
            reason = "it holds pickled objects, which are never loaded" if "pickle" in str(err) else str(err)
            raise ValueError(f"{not_a_voice}: {reason}") from None
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError(f"{not_a_voice}: it is a bare numpy array")
        try:
            with data:
                fields = {k: data[k] for k in ("format", "codes", "text", "source")}
        except (KeyError, ValueError, zipfile.BadZipFile) as err:
            raise ValueError(f"{not_a_voice}: {err}") from None
        if str(fields["format"]) != FORMAT:
            raise ValueError(f"{path}: unsupported voice format {str(fields['format'])!r}")
        return cls(fields["codes"].astype(np.int64), str(fields["text"]), str(fields["source"]))
