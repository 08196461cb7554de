"""Reference-audio input: any file soundfile reads, any rate and channel count -> mono 16 kHz.

Clear errors for everything that cannot serve as a voice prompt: a missing or non-audio file,
NaN/inf samples, silence, or a clip too short / too long to be a useful reference.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pcgtts.runtime.audio.chunk import SAMPLE_RATE

MIN_SECONDS = 0.5  # ~25 codec tokens: less gives the LM almost nothing of the voice
MAX_SECONDS = 30.0  # LLaSA was trained on clips up to ~30 s; longer references crowd the KV cache
SILENCE_PEAK = 10 ** (-60 / 20)  # -60 dBFS


def to_mono_16k(samples: np.ndarray, sample_rate: int) -> np.ndarray:
    """[N] or [N, channels] at any rate -> float32 [M] mono at 16 kHz (soxr, high quality)."""
    import soxr

    if sample_rate <= 0:
        raise ValueError(f"invalid sample rate {sample_rate}")
    audio = np.asarray(samples, dtype=np.float32)
    if audio.ndim == 2:
        audio = audio.mean(axis=1)
    elif audio.ndim != 1:
        raise ValueError(f"expected [samples] or [samples, channels], got shape {audio.shape}")
    if not np.isfinite(audio).all():
        raise ValueError("audio contains NaN or infinite samples")
    if sample_rate != SAMPLE_RATE and audio.size:
        audio = soxr.resample(audio, sample_rate, SAMPLE_RATE, quality="HQ").astype(np.float32)
    return audio


def check_reference(audio: np.ndarray, name: str = "reference audio") -> np.ndarray:
    seconds = audio.size / SAMPLE_RATE
    if seconds < MIN_SECONDS:
        raise ValueError(f"{name} is {seconds:.2f} s long; a voice reference needs at least {MIN_SECONDS} s")
    if seconds > MAX_SECONDS:
        raise ValueError(f"{name} is {seconds:.1f} s long; use at most {MAX_SECONDS:.0f} s (trim it)")
    if np.abs(audio).max() < SILENCE_PEAK:
        raise ValueError(f"{name} is silent (peak below -60 dBFS)")
    return audio


def load_audio(path: str | Path) -> np.ndarray:
    """Read a reference recording as float32 mono 16 kHz, validated."""
    import soundfile as sf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"audio file not found: {path}")
    try:
        samples, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as err:
        formats = ", ".join(sorted(sf.available_formats()))
        raise ValueError(f"{path} is not a readable audio file (libsndfile: {err}); "
                         f"formats this machine reads: {formats}") from None
    try:
        audio = to_mono_16k(samples, rate)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return check_reference(audio, str(path))


# What an output file's suffix means: soundfile's (libsndfile's) container and encoding for it.
OUTPUT_FORMATS = {
    ".wav": ("WAV", "PCM_16"),
    ".flac": ("FLAC", "PCM_16"),
    ".ogg": ("OGG", "VORBIS"),
    ".mp3": ("MP3", "MPEG_LAYER_III"),  # libsndfile 1.1 and later
}


def writable_suffixes() -> list[str]:
    """The suffixes of `OUTPUT_FORMATS` that this machine's libsndfile can write."""
    import soundfile as sf

    formats = sf.available_formats()
    return [suffix for suffix, (container, encoding) in OUTPUT_FORMATS.items()
            if container in formats and encoding in sf.available_subtypes(container)]


def output_format(path: str | Path) -> tuple[str, str]:
    """(container, encoding) that soundfile writes for `path`, chosen by its suffix; a one-line
    ValueError naming the suffixes this machine writes when it has none of them."""
    suffix = Path(path).suffix.lower()
    writable = writable_suffixes()
    if suffix not in writable:
        what = f"a {suffix} file" if suffix else "a file without a suffix"
        raise ValueError(f"{path}: cannot write {what}; name it with one of {', '.join(writable)} "
                         "(the audio format follows the suffix)")
    return OUTPUT_FORMATS[suffix]


def write_wav(path: str | Path, samples: np.ndarray, sample_rate: int = SAMPLE_RATE) -> Path:
    import soundfile as sf

    sf.write(str(path), np.asarray(samples, dtype=np.float32), sample_rate, subtype="PCM_16")
    return Path(path)
