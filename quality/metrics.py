"""Per-utterance quality metrics: the judges of `pcgtts eval`.

Data flow: a waveform (float32 mono 16 kHz, what `Synthesizer.synthesize` returns) and the text
it should say go in; numbers come out.

    normalize_text   case, punctuation, numbers -> words ("3rd" -> "third", "42" -> "forty two")
    error_rates      WER and CER (jiwer) of a hypothesis against a reference, both normalised
    Recognizer       PocketSphinx, its bundled US-English model, 16 kHz     (loaded once, lazily)
    SpeakerEncoder   resemblyzer's bundled encoder; cosine of utterance embeddings = Sim-O
    stoi, mcd        intrusive measures where a reference waveform exists (codec resynthesis, swaps)

The judges are heavy to load (about a second each), so `recognizer()` and `speaker_encoder()`
build them on first use and keep them for the process.
"""

from __future__ import annotations

import functools
import logging
import re
import threading

import numpy as np

from pcgtts.runtime.audio.chunk import SAMPLE_RATE
from pcgtts.runtime.text.numbers import spell_numbers

log = logging.getLogger(__name__)

# -- text normalisation --------------------------------------------------------------------

def normalize_text(text: str) -> str:
    """Text as an ASR transcript would read it: numbers spelled out, lower case, no punctuation
    (apostrophes inside words kept), hyphens and slashes as spaces, single spaces."""
    out = spell_numbers(text.replace("\u2019", "'").replace("&", " and ")).lower()
    out = re.sub(r"[-/\u2013\u2014]", " ", out)
    out = re.sub(r"[^a-z0-9' ]+", " ", out)
    out = re.sub(r"(?<![a-z])'|'(?![a-z])", " ", out)  # quotes, not apostrophes
    return " ".join(out.split())


def error_rates(reference: str, hypothesis: str) -> tuple[float, float]:
    """(WER, CER) of `hypothesis` against `reference`, both normalised first. An empty hypothesis
    scores 1.0 (every word deleted); an empty reference is an error."""
    import jiwer

    ref, hyp = normalize_text(reference), normalize_text(hypothesis)
    if not ref:
        raise ValueError(f"reference text {reference!r} is empty after normalisation")
    if not hyp:
        return 1.0, 1.0
    return float(jiwer.wer(ref, hyp)), float(jiwer.cer(ref, hyp))


# -- judges --------------------------------------------------------------------------------

def _as_16k(samples: np.ndarray) -> np.ndarray:
    audio = np.asarray(samples, dtype=np.float32)
    if audio.ndim != 1:
        raise ValueError(f"expected mono samples [N], got shape {audio.shape}")
    if not np.isfinite(audio).all():
        raise ValueError("audio contains NaN or infinite samples")
    return audio


class Recognizer:
    """PocketSphinx with the US-English acoustic model, dictionary and LM bundled in its wheel."""

    name = "pocketsphinx-en-us"

    def __init__(self):
        from pocketsphinx import Decoder

        self._decoder = Decoder(samprate=SAMPLE_RATE, loglevel="FATAL")
        self._cmn = self._decoder.get_cmn()  # the cepstral means every utterance starts from
        self._lock = threading.Lock()  # one decoder, one utterance at a time

    def transcribe(self, samples: np.ndarray) -> str:
        """float32 mono 16 kHz -> lower-case words ("" for silence or noise it cannot read)."""
        audio = _as_16k(samples)
        peak = float(np.abs(audio).max()) if audio.size else 0.0
        if audio.size < SAMPLE_RATE // 10 or peak == 0.0:
            return ""
        # Peak-normalise: pocketsphinx's front end is level dependent and TTS output levels vary.
        pcm = (np.clip(audio / peak * 0.9, -1.0, 1.0) * 32767).astype(np.int16).tobytes()
        with self._lock:
            # The front end's noise estimate and cepstral means carry over from the last utterance,
            # so that on hard audio the same samples read differently after other audio: reset both.
            self._decoder.reinit_feat()
            self._decoder.set_cmn(self._cmn)
            self._decoder.start_utt()
            self._decoder.process_raw(pcm, full_utt=True)
            self._decoder.end_utt()
            hyp = self._decoder.hyp()
        return hyp.hypstr.strip() if hyp is not None else ""


class SpeakerEncoder:
    """resemblyzer's GE2E speaker encoder (weights ship in its wheel)."""

    name = "resemblyzer-ge2e"

    def __init__(self):
        from resemblyzer import VoiceEncoder

        self._encoder = VoiceEncoder("cpu", verbose=False)

    def embed(self, samples: np.ndarray) -> np.ndarray | None:
        """A unit-norm utterance embedding [256], or None when the voice-activity detector finds
        no speech to embed (e.g. silence)."""
        from resemblyzer import preprocess_wav

        audio = _as_16k(samples)
        if audio.size == 0 or not np.abs(audio).max() > 0:
            return None
        wav = preprocess_wav(audio, source_sr=SAMPLE_RATE)
        if wav.size < SAMPLE_RATE // 4:
            return None
        emb = self._encoder.embed_utterance(wav)
        return emb / max(float(np.linalg.norm(emb)), 1e-12)

    def similarity(self, a: np.ndarray, b: np.ndarray) -> float | None:
        ea, eb = self.embed(a), self.embed(b)
        return cosine(ea, eb)


def cosine(a: np.ndarray | None, b: np.ndarray | None) -> float | None:
    if a is None or b is None:
        return None
    return float(np.dot(a, b) / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12))


@functools.lru_cache(maxsize=1)
def recognizer() -> Recognizer:
    log.info("loading the ASR judge (pocketsphinx en-US)")
    return Recognizer()


@functools.lru_cache(maxsize=1)
def speaker_encoder() -> SpeakerEncoder:
    log.info("loading the speaker-similarity judge (resemblyzer)")
    return SpeakerEncoder()


# -- intrusive measures (a reference waveform exists) --------------------------------------

def _pair(reference: np.ndarray, degraded: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ref, deg = _as_16k(reference), _as_16k(degraded)
    n = min(len(ref), len(deg))
    if n < SAMPLE_RATE // 4:
        raise ValueError(f"need at least 0.25 s of both signals, got {len(ref)} and {len(deg)} samples")
    return ref[:n].astype(np.float64), deg[:n].astype(np.float64)


def stoi(reference: np.ndarray, degraded: np.ndarray) -> float:
    """Short-time objective intelligibility (0..1, higher is better) of time-aligned signals
    (the shorter length is used)."""
    from pystoi import stoi as _stoi

    ref, deg = _pair(reference, degraded)
    return float(_stoi(ref, deg, SAMPLE_RATE, extended=False))


MEL_BANDS = 40


def mel_cepstrum(samples: np.ndarray, order: int = 24) -> np.ndarray:
    """Mel-cepstral coefficients c1..c_order per 10 ms frame [frames, order] (c0, energy, dropped).

    The cepstrum of the natural-log mel *amplitude* spectrum, c_n = (1/N) sum_k ln S_k cos(pi n (k + 1/2) / N)
    over N = 40 HTK mel bands: the units the MCD formula's 10 / ln 10 factor assumes (a cepstral
    difference of 1 is a log-amplitude ripple of 1 neper). librosa's MFCC is not in these units (it
    is a scaled DCT of a clipped dB power spectrum, about 78x larger), which made earlier MCD figures
    read in the hundreds."""
    import librosa
    from scipy.fft import dct

    mel = librosa.feature.melspectrogram(y=np.asarray(samples, np.float32), sr=SAMPLE_RATE, n_fft=512, hop_length=160,
                                         win_length=400, n_mels=MEL_BANDS, htk=True, power=1.0)
    log_mel = np.log(np.maximum(mel, 1e-5))  # [bands, frames]
    cepstrum = dct(log_mel, type=2, axis=0) / (2 * MEL_BANDS)  # scipy's DCT-II carries a factor 2
    return cepstrum[1:order + 1].T


def mcd(reference: np.ndarray, degraded: np.ndarray, align: bool = True) -> float:
    """Mel-cepstral distortion in dB, (10 / ln 10) * sqrt(2 * sum_d (c_d - c'_d)^2) averaged over
    frames; frames are matched by DTW when `align` (different durations), else index by index."""
    ref, deg = _as_16k(reference), _as_16k(degraded)
    a, b = mel_cepstrum(ref), mel_cepstrum(deg)
    if align:
        import librosa

        _, path = librosa.sequence.dtw(X=a.T, Y=b.T, metric="euclidean")
        a, b = a[path[::-1, 0]], b[path[::-1, 1]]
    else:
        n = min(len(a), len(b))
        a, b = a[:n], b[:n]
    dist = np.sqrt(2.0 * np.sum((a - b) ** 2, axis=1))
    return float(10.0 / np.log(10.0) * dist.mean())


__all__ = ["normalize_text", "error_rates", "Recognizer",
           "SpeakerEncoder", "recognizer", "speaker_encoder", "cosine", "stoi", "mcd", "mel_cepstrum"]
