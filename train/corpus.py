"""Speech-lab corpus: English sentences rendered by packaged TTS voices into 16 kHz mono FLAC.

First step of the lab's data flow (sentences -> source TTS -> corpus -> codec -> codes -> LM).
Text comes from files that Debian packages ship (`fortunes-min`, `fortunes`: plain sentences of
4-25 words), a small template grammar for numbers, times and punctuation, and optionally sentences
drawn from the trigram Markov model that the `essential-generators` wheel ships (built from
encyclopedia text: many more distinct sentences, locally fluent, not always meaningful). Speakers are
`hibari-tts` (default voice at speeds 0.9/1.0/1.1), `flite` voices, festival voices, and sox
pitch/tempo variants of those, labelled as derived speakers. `--voice-bank` adds 20 more speakers for
the codec alone: festival's Italian, Czech, Russian, Finnish and Catalan voices (and variants) reading
the same English sentences by their own language's rules, so their transcripts are not what they say;
their utterances form the `codec_only` split, which the LM, its held-out figures and the cloning pool
never read. Everything is deterministic
(seeded sentence choice, seeded hibari noise), cached (an utterance whose FLAC exists is not
rendered again) and resumable (the manifest is rebuilt from what exists). Utterances are rendered
round-robin over speakers, so a partial corpus is balanced.

Manifest: `manifest.jsonl`, one JSON object per utterance:
id, speaker, source, variant, text, split (train / heldout_sentences / heldout_speakers / codec_only),
seconds, path.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import random
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pcgtts.runtime.audio.chunk import SAMPLE_RATE
from pcgtts.runtime.audio.io import to_mono_16k

log = logging.getLogger(__name__)

FORTUNE_DIR = Path("/usr/share/games/fortunes")
PLAIN = re.compile(r"^[A-Z][A-Za-z ,;:'\-]*[A-Za-z][.!?]$")  # plain English prose, no digits/quotes
MIN_WORDS, MAX_WORDS = 4, 25
SPLITS = ("train", "heldout_sentences", "heldout_speakers", "codec_only")


# festival voice -> (its festival voice, the Debian package that ships it)
FESTIVAL_VOICES = {
    "kal": ("kal_diphone", "festvox-kallpc16k"), "ked": ("ked_diphone", "festvox-kdlpc16k"),
    "slt_hts": ("cmu_us_slt_arctic_hts", "festvox-us-slt-hts"),
    # the voice bank's (not English: codec_only)
    "it_lp": ("lp_diphone", "festvox-italp16k"), "it_pc": ("pc_diphone", "festvox-itapc16k"),
    "cz_dita": ("czech_dita", "festvox-czech-dita"), "cz_krb": ("czech_krb", "festvox-czech-krb"),
    "cz_machac": ("czech_machac", "festvox-czech-machac"), "cz_ph": ("czech_ph", "festvox-czech-ph"),
    "ru_nsh": ("msu_ru_nsh_clunits", "festvox-ru"), "fi_lj": ("suo_fi_lj_diphone", "festvox-suopuhe-lj"),
    "fi_mv": ("hy_fi_mv_diphone", "festvox-suopuhe-mv"), "ca_ona": ("upc_ca_ona_hts", "festvox-ca-ona-hts"),
}
FESTIVAL_VOICE_DIR = Path("/usr/share/festival/voices")


@dataclass(frozen=True)
class Speaker:
    """One voice of the corpus: a source TTS voice, optionally transformed by sox (derived)."""

    name: str
    engine: str  # "hibari" | "flite" | "festival"
    voice: str  # engine's voice name (flite -voice, festival voice function, hibari voice)
    speed: float = 1.0  # hibari speed
    pitch_cents: int = 0  # sox pitch shift (derived speakers)
    tempo: float = 1.0  # sox tempo factor (derived speakers)
    codec_only: bool = False  # a voice-bank voice: another language's front end, the transcript is not what it says

    def __post_init__(self) -> None:
        if self.engine not in ("hibari", "flite", "festival"):
            raise ValueError(f"unknown engine {self.engine!r}")
        if self.engine == "festival" and self.voice not in FESTIVAL_VOICES:
            raise ValueError(f"unknown festival voice {self.voice!r}; known: {', '.join(FESTIVAL_VOICES)}")
        if not 0.5 <= self.speed <= 2.0 or not 0.5 <= self.tempo <= 2.0:
            raise ValueError(f"speaker {self.name}: speed/tempo must lie in [0.5, 2]")

    @property
    def derived(self) -> bool:
        return self.pitch_cents != 0 or self.tempo != 1.0

    @property
    def variant(self) -> str:
        parts = [f"speed{self.speed:g}"] if self.engine == "hibari" else []
        if self.pitch_cents:
            parts.append(f"pitch{self.pitch_cents:+d}")
        if self.tempo != 1.0:
            parts.append(f"tempo{self.tempo:g}")
        return "+".join(parts) or "original"



# 14 source speakers + 10 derived ones. The last three are held out of training (cloning tests).
DEFAULT_SPEAKERS = (
    Speaker("hibari_s090", "hibari", "heart", speed=0.9),
    Speaker("hibari_s100", "hibari", "heart", speed=1.0),
    Speaker("hibari_s110", "hibari", "heart", speed=1.1),
    Speaker("flite_slt", "flite", "slt"),
    Speaker("flite_awb", "flite", "awb"),
    Speaker("flite_rms", "flite", "rms"),
    Speaker("flite_kal16", "flite", "kal16"),
    Speaker("flite_kal", "flite", "kal"),
    Speaker("fest_kal", "festival", "kal"),
    Speaker("fest_slt_hts", "festival", "slt_hts"),
    Speaker("hibari_s100_p-300", "hibari", "heart", speed=1.0, pitch_cents=-300),
    Speaker("hibari_s100_p+250", "hibari", "heart", speed=1.0, pitch_cents=250),
    Speaker("hibari_s090_p-500", "hibari", "heart", speed=0.9, pitch_cents=-500),
    Speaker("flite_slt_p-250", "flite", "slt", pitch_cents=-250),
    Speaker("flite_awb_p+300", "flite", "awb", pitch_cents=300),
    Speaker("flite_rms_p+200_t1.1", "flite", "rms", pitch_cents=200, tempo=1.1),
    Speaker("flite_kal16_p-200", "flite", "kal16", pitch_cents=-200),
    Speaker("fest_kal_p+300", "festival", "kal", pitch_cents=300),
    Speaker("fest_slt_hts_p-300", "festival", "slt_hts", pitch_cents=-300),
    Speaker("hibari_s110_p+450_t0.9", "hibari", "heart", speed=1.1, pitch_cents=450, tempo=0.9),
    Speaker("flite_awb_p-300_t1.1", "flite", "awb", pitch_cents=-300, tempo=1.1),
    Speaker("fest_ked", "festival", "ked"),
    Speaker("flite_slt_p+350_t0.95", "flite", "slt", pitch_cents=350, tempo=0.95),
    Speaker("hibari_s100_p+120_t1.05", "hibari", "heart", speed=1.0, pitch_cents=120, tempo=1.05),
)
DEFAULT_HELDOUT_SPEAKERS = ("fest_ked", "flite_slt_p+350_t0.95", "hibari_s100_p+120_t1.05")

# `--voice-bank`: 10 more source voices and a pitch/tempo variant of each, for the codec alone (codec_only).
VOICE_BANK_SPEAKERS = tuple(
    Speaker(f"fest_{voice}{suffix}", "festival", voice, pitch_cents=cents, tempo=tempo, codec_only=True)
    for voice, variant in (("it_lp", (-250, 1.0)), ("it_pc", (250, 1.0)), ("cz_dita", (-300, 1.05)),
                           ("cz_krb", (200, 1.0)), ("cz_machac", (300, 0.95)), ("cz_ph", (-200, 1.1)),
                           ("ru_nsh", (300, 1.0)), ("fi_lj", (-300, 1.0)), ("fi_mv", (350, 0.9)),
                           ("ca_ona", (250, 1.05)))
    for suffix, cents, tempo in (("", 0, 1.0),
                                 (f"_p{variant[0]:+d}" + (f"_t{variant[1]:g}" if variant[1] != 1.0 else ""),
                                  variant[0], variant[1]))
)


@dataclass(frozen=True)
class CorpusConfig:
    out_dir: Path
    per_speaker: int = 260  # train/held-out-speaker sentences rendered by each speaker
    heldout_sentences: int = 24  # sentences kept out of training, rendered by every speaker
    markov_sentences: int = 0  # extra sentences from essential-generators' Markov model (0: lab-v1's pool)
    max_sentences: int | None = None  # cap on the sentence pool (tests)
    seed: int = 0
    speakers: tuple[Speaker, ...] = DEFAULT_SPEAKERS
    heldout_speakers: tuple[str, ...] = DEFAULT_HELDOUT_SPEAKERS
    peak: float = 0.9  # every utterance is peak-normalised to this level

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        if self.per_speaker < 1 or self.heldout_sentences < 0:
            raise ValueError("per_speaker must be >= 1 and heldout_sentences >= 0")
        names = [s.name for s in self.speakers]
        if len(set(names)) != len(names):
            raise ValueError("speaker names must be unique")
        unknown = set(self.heldout_speakers) - set(names)
        if unknown:
            raise ValueError(f"held-out speakers {sorted(unknown)} are not in the speaker list")
        bank = sorted(set(self.heldout_speakers) & {s.name for s in self.speakers if s.codec_only})
        if bank:
            raise ValueError(f"held-out speakers {bank} are codec_only voices (their transcripts are not what they say)")
        if not 0 < self.peak <= 1:
            raise ValueError("peak must lie in (0, 1]")


# ---------------------------------------------------------------- text

def fortune_sentences(root: Path = FORTUNE_DIR) -> list[str]:
    """Plain English sentences of 4-25 words from the fortune files Debian ships (sorted, unique)."""
    return list(_fortune_sentences(Path(root)))


@functools.lru_cache(maxsize=4)
def _fortune_sentences(root: Path) -> tuple[str, ...]:
    out: set[str] = set()
    if not root.is_dir():
        return ()
    for path in sorted(root.iterdir()):
        if path.suffix or not path.is_file() or path.name.startswith("."):
            continue  # skip .dat indexes and .u8 links' targets' duplicates
        try:
            raw = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for cookie in raw.split("\n%\n"):
            if "\t" in cookie or "--" in cookie or ">" in cookie:
                continue  # attributions, dialogues, code
            text = " ".join(cookie.split())
            for sent in re.split(r"(?<=[.!?])\s+", text):
                words = sent.split()
                if MIN_WORDS <= len(words) <= MAX_WORDS and PLAIN.match(sent):
                    out.add(sent)
    return tuple(sorted(out))


_NUMBERS = ("two", "three", "seven", "twelve", "fifteen", "twenty", "forty two", "ninety nine", "one hundred")
_TEMPLATES = (
    "The train leaves at {h} {m}, so please be on time.",
    "She counted {n} boats, {n2} cars and one old bicycle.",
    "Is it true that {n} people came to the meeting?",
    "Call me at {h} o'clock; I will be home by then.",
    "We need {n} apples, {n2} pears, and a loaf of bread!",
    "On day {n}, the weather changed again.",
    "Turn left after {n} blocks, then walk for {n2} minutes.",
    "Why did the {n} old clocks stop at {h} {m}?",
)
_HOURS = ("one", "two", "five", "eight", "ten", "eleven")
_MINUTES = ("fifteen", "thirty", "forty five", "oh five")


def template_sentences(seed: int, count: int = 160) -> list[str]:
    """Sentences with spelled-out numbers, times and varied punctuation from a small grammar."""
    rng = random.Random(seed)
    out: set[str] = set()
    for _ in range(count * 4):
        t = rng.choice(_TEMPLATES)
        out.add(t.format(n=rng.choice(_NUMBERS), n2=rng.choice(_NUMBERS), h=rng.choice(_HOURS),
                         m=rng.choice(_MINUTES)))
        if len(out) >= count:
            break
    return sorted(out)


@functools.lru_cache(maxsize=2)
def markov_sentences(seed: int, count: int) -> tuple[str, ...]:
    """`count` distinct plain sentences of 4-25 words from essential-generators' trigram model (seeded).

    The generator draws from the process-wide `random` module; its state is saved and restored.
    """
    from essential_generators import MarkovTextGenerator

    gen = MarkovTextGenerator()
    out: dict[str, None] = {}
    saved = random.getstate()
    random.seed(seed)
    try:
        for _ in range(count * 10):
            for sent in re.split(r"(?<=[.!?])\s+", " ".join(gen.gen_text(max_len=300).split())):
                if MIN_WORDS <= len(sent.split()) <= MAX_WORDS and PLAIN.match(sent):
                    out[sent] = None
            if len(out) >= count:
                break
    finally:
        random.setstate(saved)
    return tuple(list(out)[:count])


def sentence_pool(config: CorpusConfig) -> list[str]:
    """Deterministic, shuffled sentence pool: fortunes + templates (+ Markov sentences); the first
    `heldout_sentences` are held out."""
    pool = fortune_sentences() + template_sentences(config.seed)
    if config.markov_sentences:
        pool += list(markov_sentences(config.seed, config.markov_sentences))
    pool = sorted(set(pool))
    random.Random(config.seed).shuffle(pool)
    if config.max_sentences is not None:
        pool = pool[:config.max_sentences]
    if len(pool) <= config.heldout_sentences:
        raise ValueError(f"only {len(pool)} sentences available; need more than {config.heldout_sentences}")
    return pool


# ---------------------------------------------------------------- audio

class Renderer:
    """Renders text with one engine; keeps the hibari model loaded."""

    def __init__(self) -> None:
        self._hibari = None

    def _hibari_audio(self, speaker: Speaker, text: str, seed: int) -> np.ndarray:
        if self._hibari is None:
            from hibari import Hibari

            self._hibari = Hibari(threads=1)  # the default voice ships in the wheel; others download
        audio = self._hibari(text, speed=speaker.speed, seed=seed)
        return to_mono_16k(audio, self._hibari.sample_rate)

    @staticmethod
    def _read(path: str) -> np.ndarray:
        import soundfile as sf

        samples, rate = sf.read(path, dtype="float32", always_2d=True)
        return to_mono_16k(samples, rate)

    def render(self, speaker: Speaker, text: str, seed: int) -> np.ndarray:
        with tempfile.TemporaryDirectory(prefix="pcgtts-corpus-") as tmp:
            wav = os.path.join(tmp, "a.wav")
            if speaker.engine == "hibari":
                audio = self._hibari_audio(speaker, text, seed)
            elif speaker.engine == "flite":
                subprocess.run(["flite", "-voice", speaker.voice, "-t", text, "-o", wav], check=True,
                               capture_output=True, timeout=120)
                audio = self._read(wav)
            else:
                txt = os.path.join(tmp, "a.txt")
                Path(txt).write_text(text + "\n")
                subprocess.run(["text2wave", "-eval", f"(voice_{FESTIVAL_VOICES[speaker.voice][0]})", txt, "-o", wav],
                               check=True, capture_output=True, timeout=120)
                audio = self._read(wav)
            if speaker.derived:
                import soundfile as sf

                src, dst = os.path.join(tmp, "src.wav"), os.path.join(tmp, "dst.wav")
                sf.write(src, audio, SAMPLE_RATE, subtype="FLOAT")
                effects = []
                if speaker.pitch_cents:
                    effects += ["pitch", str(speaker.pitch_cents)]
                if speaker.tempo != 1.0:
                    effects += ["tempo", "-s", f"{speaker.tempo:g}"]
                subprocess.run(["sox", src, dst, *effects, "rate", str(SAMPLE_RATE)], check=True,
                               capture_output=True, timeout=120)
                audio = self._read(dst)
        return audio


def missing_tools(speakers) -> list[str]:
    """Engines/tools a speaker list needs that this machine lacks (as install hints)."""
    needs, voices = set(), set()
    for s in speakers:
        if s.engine == "flite":
            needs.add("flite")
        elif s.engine == "festival":
            needs.add("text2wave")
            voice_dir, package = FESTIVAL_VOICES[s.voice]
            if not any(FESTIVAL_VOICE_DIR.glob(f"*/{voice_dir}")):
                voices.add(package)
        else:
            needs.add("hibari")
        if s.derived:
            needs.add("sox")
    out = [f"apt-get install {' '.join(sorted(voices))}"] if voices and shutil.which("text2wave") else []
    for tool in sorted(needs):
        if tool == "hibari":
            try:
                import hibari  # noqa: F401
            except ImportError:
                out.append("pip install hibari-tts")
        elif shutil.which(tool) is None:
            out.append({"text2wave": "apt-get install festival festvox-kallpc16k festvox-kdlpc16k "
                                     "festvox-us-slt-hts"}.get(tool, f"apt-get install {tool}"))
    return out


# ---------------------------------------------------------------- plan + build

@dataclass(frozen=True)
class Utterance:
    id: str
    speaker: Speaker
    text: str
    split: str
    seed: int


def plan(config: CorpusConfig) -> list[Utterance]:
    """Every utterance of the corpus, in rendering order (round-robin over speakers)."""
    pool = sentence_pool(config)
    heldout, train = pool[:config.heldout_sentences], pool[config.heldout_sentences:]
    per_speaker: list[list[tuple[int, str]]] = []
    for spk in config.speakers:
        key = int(hashlib.sha256(f"{config.seed}:{spk.name}".encode()).hexdigest()[:8], 16)
        rng = random.Random(key)
        idx = rng.sample(range(len(train)), min(config.per_speaker, len(train)))
        items = [(config.heldout_sentences + i, "") for i in idx]
        # Held-out sentences are spread through the order so a partial corpus has some (a voice bank's
        # would be read by nobody).
        for j, h in enumerate(range(len(heldout)) if not spk.codec_only else ()):
            items.insert(min(len(items), (j * len(items)) // max(1, len(heldout))), (h, "h"))
        per_speaker.append(items)
    out: list[Utterance] = []
    for rank in range(max(len(x) for x in per_speaker)):
        for spk, items in zip(config.speakers, per_speaker):
            if rank >= len(items):
                continue
            sid, _ = items[rank]
            if spk.codec_only:
                split = "codec_only"
            elif spk.name in config.heldout_speakers:
                split = "heldout_speakers"
            elif sid < config.heldout_sentences:
                split = "heldout_sentences"
            else:
                split = "train"
            uid = f"{spk.name}-{sid:05d}"
            seed = int(hashlib.sha256(f"{config.seed}:{uid}".encode()).hexdigest()[:8], 16)
            out.append(Utterance(uid, spk, pool[sid], split, seed))
    return out


def _record(u: Utterance, rel: str, seconds: float) -> dict:
    return {"id": u.id, "speaker": u.speaker.name, "source": u.speaker.engine + ":" + u.speaker.voice,
            "variant": u.speaker.variant, "derived": u.speaker.derived, "text": u.text, "split": u.split,
            "seconds": round(seconds, 3), "path": rel}


def write_manifest(out_dir: Path, records: list[dict]) -> Path:
    path = out_dir / "manifest.jsonl"
    tmp = path.with_suffix(f".jsonl.{os.getpid()}.tmp")  # two builders (speaker subsets) may share a folder
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def read_manifest(path: str | Path) -> list[dict]:
    path = Path(path)
    if path.is_dir():
        path = path / "manifest.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"corpus manifest not found: {path} (run `pcgtts train corpus` first)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def build_corpus(config: CorpusConfig, progress=None, manifest_every: int = 50) -> dict:
    """Render (or pick up) every planned utterance; returns summary figures.

    progress: optional callable(done, total, hours) called after each utterance.
    """
    import soundfile as sf

    missing = missing_tools(config.speakers)
    if config.max_sentences is None and not fortune_sentences():  # else the pool is the templates alone
        missing.append(f"apt-get install fortunes-min fortunes (no fortune files in {FORTUNE_DIR})")
    if missing:
        raise RuntimeError("corpus sources missing: " + "; ".join(missing))
    utts = plan(config)
    out = config.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({
        "per_speaker": config.per_speaker, "heldout_sentences": config.heldout_sentences,
        "max_sentences": config.max_sentences, "markov_sentences": config.markov_sentences, "seed": config.seed,
        "speakers": [s.__dict__ for s in config.speakers], "heldout_speakers": list(config.heldout_speakers),
    }, indent=2))
    renderer = Renderer()
    records: list[dict] = []
    seconds_total, rendered, failed, t0 = 0.0, 0, 0, time.perf_counter()
    for n, u in enumerate(utts):
        rel = f"audio/{u.speaker.name}/{u.id}.flac"
        path = out / rel
        if path.is_file():
            seconds = sf.info(str(path)).frames / SAMPLE_RATE
        else:
            try:
                audio = renderer.render(u.speaker, u.text, u.seed)
            except (subprocess.SubprocessError, OSError, ValueError, sf.LibsndfileError) as err:  # e.g. an empty wav
                failed += 1
                log.warning("skipping %s: %s", u.id, err)
                continue
            peak = float(np.abs(audio).max()) if audio.size else 0.0
            if peak < 1e-3 or audio.size < SAMPLE_RATE // 2:
                failed += 1
                log.warning("skipping %s: silent or shorter than 0.5 s", u.id)
                continue
            audio = audio * (config.peak / peak)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.stem + ".tmp.flac")
            sf.write(str(tmp), audio, SAMPLE_RATE, subtype="PCM_16", format="FLAC")
            os.replace(tmp, path)
            seconds = audio.size / SAMPLE_RATE
            rendered += 1
        records.append(_record(u, rel, seconds))
        seconds_total += seconds
        if progress is not None:
            progress(n + 1, len(utts), seconds_total / 3600)
        if rendered and rendered % manifest_every == 0:
            write_manifest(out, records)
            log.info("%d/%d utterances, %.2f h, %.1f s wall", n + 1, len(utts), seconds_total / 3600,
                     time.perf_counter() - t0)
    manifest = write_manifest(out, records)
    summary = corpus_summary(records)
    summary.update(manifest=str(manifest), rendered=rendered, failed=failed,
                   wall_s=round(time.perf_counter() - t0, 1))
    return summary


def corpus_summary(records: list[dict]) -> dict:
    by_split = {s: round(sum(r["seconds"] for r in records if r["split"] == s) / 3600, 3) for s in SPLITS}
    return {"utterances": len(records), "hours": round(sum(r["seconds"] for r in records) / 3600, 3),
            "speakers": len({r["speaker"] for r in records}), "sentences": len({r["text"] for r in records}),
            "hours_by_split": by_split}


# ---------------------------------------------------------------- a compact form to send to a GPU machine

def pack_audio(corpus: str | Path, out: str | Path, max_bytes: int = 30 << 20,
               splits: tuple[str, ...] = ("train", "codec_only"), compression_level: float = 0.96) -> dict:
    """The corpus's audio as Opus (~17 kbps at the default level; STOI of Opus against the FLAC ~0.99) in one
    .npz, at most `max_bytes` of audio (its manifest adds ~300 bytes an utterance): small enough to copy with
    the repository to a GPU machine that trains the codec (the FLAC corpus is ~10x larger). Utterances are
    taken round-robin over the speakers of `splits`, each speaker's in id order, until the budget is spent,
    so a smaller budget keeps every voice."""
    import io

    import soundfile as sf

    corpus, out = Path(corpus), Path(out)
    by_speaker: dict[str, list[dict]] = {}
    for rec in sorted(read_manifest(corpus), key=lambda r: r["id"]):
        if rec["split"] in splits:
            by_speaker.setdefault(rec["speaker"], []).append(rec)
    if not by_speaker:
        raise ValueError(f"{corpus}: no {' or '.join(splits)} utterances to pack")
    arrays: dict[str, np.ndarray] = {}
    records: list[dict] = []
    size, full = 0, False
    for rank in range(max(len(v) for v in by_speaker.values())):
        for speaker in sorted(by_speaker):
            if rank >= len(by_speaker[speaker]) or full:
                continue
            rec = by_speaker[speaker][rank]
            audio, rate = sf.read(str(corpus / rec["path"]), dtype="float32")
            buf = io.BytesIO()
            sf.write(buf, audio, rate, format="OGG", subtype="OPUS", compression_level=compression_level)
            data = np.frombuffer(buf.getvalue(), np.uint8)
            if size + data.size > max_bytes:
                full = True
                continue
            arrays[f"u{len(records)}"] = data
            records.append(rec)
            size += data.size
    arrays["manifest"] = np.frombuffer(json.dumps(records).encode(), np.uint8)
    from pcgtts.train.progress import save_arrays  # here, not at the top: progress imports torch

    out.parent.mkdir(parents=True, exist_ok=True)
    save_arrays(out, arrays)
    return {"pack": str(out), "utterances": len(records), "speakers": len({r["speaker"] for r in records}),
            "hours": round(sum(r["seconds"] for r in records) / 3600, 3), "mib": round(out.stat().st_size / 2**20, 2)}


def unpack_audio(pack: str | Path, out_dir: str | Path) -> Path:
    """`pack_audio`'s file as a corpus folder (FLAC + manifest.jsonl, each record marked "packed": "opus")."""
    import io

    import soundfile as sf

    out_dir = Path(out_dir)
    with np.load(pack) as data:
        records = json.loads(data["manifest"].tobytes())
        for n, rec in enumerate(records):
            audio, rate = sf.read(io.BytesIO(data[f"u{n}"].tobytes()), dtype="float32")
            path = out_dir / rec["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            sf.write(str(path), np.clip(audio, -1, 1), rate, subtype="PCM_16", format="FLAC")
            rec["packed"] = "opus"
    return write_manifest(out_dir, records)


def default_config(out_dir: str | Path, **overrides) -> CorpusConfig:
    return CorpusConfig(out_dir=Path(out_dir), **overrides)


__all__ = ["CorpusConfig", "Speaker", "DEFAULT_SPEAKERS", "VOICE_BANK_SPEAKERS", "build_corpus", "plan", "read_manifest",
           "sentence_pool", "fortune_sentences", "pack_audio", "unpack_audio", "template_sentences", "missing_tools", "corpus_summary"]
