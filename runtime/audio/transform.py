"""Voice transforms: a preset voice made from the model's own voice by moving its formants and pitch.

A `VoiceTransform` (formant ratio f, pitch ratio p) changes who seems to speak while keeping what
is said: the pitch contour is moved by p / f with PSOLA at the same duration (Praat's overlap-add
resynthesis, through parselmouth), then the audio is resampled by 1 / f and played at the original
rate (soxr), which multiplies every frequency by f. The result speaks with formants x f (f < 1: a
longer vocal tract, a larger speaker), pitch x p (its melody kept) and tempo x f. Both steps are
deterministic, so a seeded utterance repeats. A preset made this way inherits the voice's
intelligibility instead of being a second voice the model learnt less well.

`StreamingTransform` applies one to audio that arrives in chunks, as a stream's does: each chunk is
resynthesised together with the `CONTEXT_S` seconds of input before it, and the output is held back
by `LOOKAHEAD_S` of input so that its last `CROSSFADE_S` can be cross-faded with the next
computation (which sees that audio with its left context). Input sample i is heard at output sample
i / f; `flush()` returns the rest, so the output has round(n / f) samples for n of input.

    t = StreamingTransform(VoiceTransform(formant=0.9, pitch=0.8), sample_rate=16000)
    for chunk in chunks:
        out = t.process(chunk)       # float32, possibly empty
    tail = t.flush()
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

PITCH_FLOOR_HZ, PITCH_CEILING_HZ = 75.0, 600.0  # the pitch analysis' range (Praat's defaults for speech)
CONTEXT_S = 0.25  # input before a chunk resynthesised with it (the pitch analysis needs ~40 ms)
LOOKAHEAD_S = 0.04  # output held back, so a chunk's end is computed again with what follows it
CROSSFADE_S = 0.02  # of the held-back output, cross-faded into the next computation
RATIO_RANGE = (0.5, 2.0)


@dataclass(frozen=True)
class VoiceTransform:
    formant: float = 1.0  # formant frequencies x this (vocal-tract length ÷ this)
    pitch: float = 1.0  # pitch contour x this

    def __post_init__(self) -> None:
        for name in ("formant", "pitch"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not RATIO_RANGE[0] <= value <= RATIO_RANGE[1]:
                raise ValueError(f"voice transform {name} ratio {value!r}: a number in "
                                 f"[{RATIO_RANGE[0]}, {RATIO_RANGE[1]}]")

    @property
    def identity(self) -> bool:
        return self.formant == 1.0 and self.pitch == 1.0

    @property
    def rate(self) -> float:
        """Output samples per input sample (the tempo changes by the formant ratio)."""
        return 1.0 / self.formant

    def output_length(self, samples: int) -> int:
        return round(samples * self.rate)

    @classmethod
    def from_dict(cls, meta: dict) -> "VoiceTransform":
        unknown = set(meta) - {"formant", "pitch"}
        if unknown:
            raise ValueError(f"voice transform: unknown field(s) {sorted(unknown)}; known: formant, pitch")
        return cls(**meta)

    def to_dict(self) -> dict:
        return {"formant": self.formant, "pitch": self.pitch}

    def apply(self, samples: np.ndarray, sample_rate: int) -> np.ndarray:
        """`samples` resynthesised with this transform: float32, `output_length(len(samples))` samples."""
        samples = np.asarray(samples, dtype=np.float64)
        out = samples
        if self.pitch != self.formant and samples.size >= int(0.05 * sample_rate):  # shorter: not analysed
            import parselmouth
            from parselmouth.praat import call

            sound = parselmouth.Sound(samples, sampling_frequency=sample_rate)
            with warnings.catch_warnings():  # "no voiced segments" in a silent stretch: it is kept as it is
                warnings.simplefilter("ignore", parselmouth.PraatWarning)
                manipulation = call(sound, "To Manipulation", 0.01, PITCH_FLOOR_HZ, PITCH_CEILING_HZ)
                tier = call(manipulation, "Extract pitch tier")
                call(tier, "Multiply frequencies", sound.xmin, sound.xmax, self.pitch / self.formant)
                call([tier, manipulation], "Replace pitch tier")
                out = call(manipulation, "Get resynthesis (overlap-add)").values[0]
            out = _fit(out, samples.size)
        if self.formant != 1.0:
            import soxr

            out = _fit(soxr.resample(out, sample_rate, sample_rate / self.formant, quality="HQ"),
                       self.output_length(samples.size))
        return out.astype(np.float32)


def _fit(samples: np.ndarray, size: int) -> np.ndarray:
    """`samples` cut or padded with zeros to `size`."""
    return samples[:size] if samples.size >= size else np.concatenate([samples, np.zeros(size - samples.size)])


class StreamingTransform:
    """A `VoiceTransform` over audio arriving in chunks (see the module's docstring)."""

    def __init__(self, transform: VoiceTransform, sample_rate: int):
        self.transform, self.sample_rate = transform, sample_rate
        self.context = int(CONTEXT_S * sample_rate)
        self.lookahead = int(LOOKAHEAD_S * sample_rate)
        self.fade = int(CROSSFADE_S * sample_rate)
        self._input = np.zeros(0, np.float32)  # input from `_start` on
        self._start = 0  # absolute index of _input[0]
        self._done = 0  # absolute index up to which output was returned
        self._tail = np.zeros(0, np.float32)  # the last computation's output from _done on (to fade out)

    def process(self, chunk: np.ndarray) -> np.ndarray:
        """The transformed audio ready after `chunk` (up to its last `LOOKAHEAD_S`)."""
        chunk = np.asarray(chunk, dtype=np.float32).reshape(-1)
        self._input = np.concatenate([self._input, chunk])
        end = self._start + self._input.size - self.lookahead
        return self._emit(end) if end > self._done else np.zeros(0, np.float32)

    @property
    def consumed(self) -> int:
        """Input samples whose output has been returned."""
        return self._done

    def flush(self) -> np.ndarray:
        """The rest of the transformed audio, at the end of the stream."""
        end = self._start + self._input.size
        return self._emit(end, final=True) if end > self._done else np.zeros(0, np.float32)

    def _emit(self, end: int, final: bool = False) -> np.ndarray:
        out_at = self.transform.output_length  # input index -> output index
        if self.transform.identity:
            out = self._input[self._done - self._start:end - self._start].copy()
        else:
            y = self.transform.apply(self._input, self.sample_rate)  # the window [_start, _start + len) of input
            origin = out_at(self._start)
            out = y[out_at(self._done) - origin:out_at(end) - origin].copy()
            n = min(self._tail.size, out.size)
            if n:
                ramp = np.linspace(0.0, 1.0, n + 2, dtype=np.float32)[1:-1]
                out[:n] = self._tail[:n] * (1.0 - ramp) + out[:n] * ramp
            self._tail = np.zeros(0, np.float32) if final else y[out_at(end) - origin:out_at(end) - origin + self.fade]
        self._done = end
        keep_from = max(self._done - self.context, self._start)
        self._input = self._input[keep_from - self._start:]
        self._start = keep_from
        return out


__all__ = ["VoiceTransform", "StreamingTransform", "CONTEXT_S", "LOOKAHEAD_S", "CROSSFADE_S"]
