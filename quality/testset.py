"""The fixed, versioned evaluation set: sentences plus reference voices given as recipes.

Data flow: `testset_v1.json` (committed) -> `TestSet` -> `render(voice, text)` -> a 16 kHz mono
WAV in the cache (`~/.cache/pcgtts/eval/<test set>-v<version>/`, never in the repo). A voice is
a recipe for a packaged TTS engine, so the audio is reproducible on any machine that installs
the same packages:

    hibari   the `hibari-tts` wheel (voice "heart" ships inside it), fixed speed and noise seed
    flite    the `flite` command (apt `flite`): voices slt, rms, awb, kal

Rendered files are keyed by a hash of the recipe and the text, written to a temporary name and
moved into place, so a cache never holds a half-written or stale file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pcgtts.runtime.audio.chunk import SAMPLE_RATE

log = logging.getLogger(__name__)

DEFAULT_TESTSET = Path(__file__).with_name("testset_v1.json")
DEFAULT_PARAGRAPH = Path(__file__).with_name("paragraph_v1.json")  # eval --mode consistency's long text
ENGINES = ("hibari", "flite")
FLITE_VOICES = ("slt", "rms", "awb", "kal", "kal16")


@dataclass(frozen=True)
class Sentence:
    id: str
    text: str

    def __post_init__(self) -> None:
        if not self.id or not self.text.strip():
            raise ValueError(f"a test sentence needs an id and a text, got {self!r}")


@dataclass(frozen=True)
class VoiceRecipe:
    """How to render a reference voice with a packaged TTS engine."""

    name: str
    engine: str
    voice: str
    speed: float = 1.0  # hibari only
    seed: int = 0  # hibari only: its noise component

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"voice {self.name!r}: engine must be one of {ENGINES}, got {self.engine!r}")
        if self.engine == "flite" and self.voice not in FLITE_VOICES:
            raise ValueError(f"voice {self.name!r}: flite voice must be one of {FLITE_VOICES}, got {self.voice!r}")
        if not 0.5 <= self.speed <= 2.0:
            raise ValueError(f"voice {self.name!r}: speed must lie in [0.5, 2], got {self.speed}")

    def key(self, text: str) -> str:
        recipe = json.dumps([self.engine, self.voice, self.speed, self.seed, text], ensure_ascii=False)
        return hashlib.sha256(recipe.encode()).hexdigest()[:20]

    def check_available(self) -> None:
        """A one-line error when this machine cannot render the voice (checked before any model loads)."""
        if self.engine == "flite" and shutil.which("flite") is None:
            raise ValueError(f"voice {self.name!r} needs the `flite` command (apt-get install flite)")
        if self.engine == "hibari":
            try:
                import hibari  # noqa: F401
            except ImportError:
                raise ValueError(f"voice {self.name!r} needs the hibari-tts package (pip install hibari-tts)") from None


@dataclass(frozen=True)
class TestSet:
    name: str
    version: int
    reference_text: str  # what every voice says for its reference recording (cloning prompt, Sim target)
    sentences: tuple[Sentence, ...]
    voices: tuple[VoiceRecipe, ...]

    __test__ = False  # not a pytest class

    def __post_init__(self) -> None:
        if not self.sentences or not self.voices:
            raise ValueError("a test set needs sentences and voices")
        for kind, names in (("sentence", [s.id for s in self.sentences]), ("voice", [v.name for v in self.voices])):
            if len(set(names)) != len(names):
                raise ValueError(f"duplicate {kind} ids in the test set")

    @classmethod
    def load(cls, path: str | Path = DEFAULT_TESTSET) -> "TestSet":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"test set not found: {path}")
        try:
            data = json.loads(path.read_text())
            return cls(name=data["name"], version=int(data["version"]), reference_text=data["reference_text"],
                       sentences=tuple(Sentence(**s) for s in data["sentences"]),
                       voices=tuple(VoiceRecipe(**v) for v in data["voices"]))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{path}: not a valid test set ({type(err).__name__}: {err})") from None

    @property
    def tag(self) -> str:
        return f"{self.name}-v{self.version}"

    def voice(self, name: str) -> VoiceRecipe:
        for v in self.voices:
            if v.name == name:
                return v
        raise ValueError(f"unknown voice {name!r}; the test set has {', '.join(v.name for v in self.voices)}")

    def take(self, count: int | None) -> tuple[Sentence, ...]:
        if count is not None and not 1 <= count <= len(self.sentences):
            raise ValueError(f"--sentences must lie in [1, {len(self.sentences)}], got {count}")
        return self.sentences[:count] if count else self.sentences


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pcgtts" / "eval"


@functools.lru_cache(maxsize=4)
def _hibari(voice: str):
    import hibari

    return hibari.Hibari(voice=voice, threads=1)


def synthesize(recipe: VoiceRecipe, text: str) -> np.ndarray:
    """Render `text` with the recipe's engine: float32 mono 16 kHz."""
    from pcgtts.runtime.audio.io import to_mono_16k

    recipe.check_available()
    if recipe.engine == "hibari":
        tts = _hibari(recipe.voice)
        return to_mono_16k(tts(text, speed=recipe.speed, seed=recipe.seed), tts.sample_rate)
    import soundfile as sf

    with tempfile.TemporaryDirectory(prefix="pcgtts-flite-") as tmp:
        out = Path(tmp) / "out.wav"
        proc = subprocess.run(["flite", "-voice", recipe.voice, "-t", text, "-o", str(out)],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"flite failed for voice {recipe.voice}: {proc.stderr.strip()[:200]}")
        samples, rate = sf.read(str(out), dtype="float32", always_2d=True)
    return to_mono_16k(samples, rate)


def render(recipe: VoiceRecipe, text: str, cache_dir: str | Path | None = None) -> Path:
    """The cached WAV of `recipe` saying `text` (rendered on first use)."""
    from pcgtts.runtime.audio.io import write_wav

    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = folder / recipe.name
    path = folder / f"{recipe.key(text)}.wav"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    audio = synthesize(recipe, text)
    if audio.size < SAMPLE_RATE // 4:
        raise RuntimeError(f"{recipe.name} rendered {audio.size} samples for {text!r}")
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.wav")
    write_wav(tmp, audio)
    os.replace(tmp, path)
    log.debug("rendered %s: %s", recipe.name, path)
    return path


def load_rendered(recipe: VoiceRecipe, text: str, cache_dir: str | Path | None = None) -> np.ndarray:
    import soundfile as sf

    samples, rate = sf.read(str(render(recipe, text, cache_dir)), dtype="float32")
    if rate != SAMPLE_RATE:
        raise RuntimeError(f"cached file has rate {rate}, expected {SAMPLE_RATE}")
    return samples


def load_paragraph(path: str | Path = DEFAULT_PARAGRAPH) -> list[str]:
    """The sentences of a paragraph file ({"sentences": [...]}), in order."""
    import json

    sentences = json.loads(Path(path).read_text()).get("sentences")
    if not isinstance(sentences, list) or not all(isinstance(s, str) and s.strip() for s in sentences):
        raise ValueError(f"{path}: expected a list of sentences under \"sentences\"")
    return sentences


__all__ = ["DEFAULT_PARAGRAPH", "DEFAULT_TESTSET", "Sentence", "VoiceRecipe", "TestSet", "default_cache_dir",
           "synthesize", "render", "load_rendered", "load_paragraph"]
