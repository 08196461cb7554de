"""Voice transforms: pitch and formants move by their ratios, the stream's length and timing follow the
tempo, chunking does not change what is heard, and the same input always gives the same output.

The test signal is a synthetic vowel: a 140 Hz glottal pulse train (a slow vibrato) through two
resonances at 700 and 1,200 Hz, so its pitch and first formant are known.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.signal import lfilter

from pcgtts.runtime.audio.transform import LOOKAHEAD_S, StreamingTransform, VoiceTransform

SR = 16000


def _vowel(seconds: float = 2.0, f0: float = 140.0) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    phase = np.cumsum(f0 * (1 + 0.03 * np.sin(2 * np.pi * 3 * t)) / SR)
    pulses = np.diff(np.floor(phase), prepend=0.0)
    x = pulses
    for freq, bw in ((700.0, 80.0), (1200.0, 100.0)):  # two-pole resonators
        r = np.exp(-np.pi * bw / SR)
        x = lfilter([1.0], [1.0, -2 * r * np.cos(2 * np.pi * freq / SR), r * r], x)
    return (0.3 * x / np.abs(x).max()).astype(np.float32)


def _pitch(samples: np.ndarray) -> float:
    import parselmouth

    f = parselmouth.Sound(samples.astype(np.float64), SR).to_pitch_ac(pitch_floor=60, pitch_ceiling=500)
    values = f.selected_array["frequency"]
    return float(np.median(values[values > 0]))


def _first_formant(samples: np.ndarray) -> float:
    import parselmouth
    from parselmouth.praat import call

    formants = parselmouth.Sound(samples.astype(np.float64), SR).to_formant_burg(max_number_of_formants=4,
                                                                                 maximum_formant=4000)
    return float(call(formants, "Get quantile", 1, 0, 0, "Hertz", 0.5))


def _streamed(transform: VoiceTransform, samples: np.ndarray, sizes) -> np.ndarray:
    stream, parts, at = StreamingTransform(transform, SR), [], 0
    for size in sizes:
        parts.append(stream.process(samples[at:at + size]))
        at += size
    assert at == samples.size
    return np.concatenate(parts + [stream.flush()])


def test_pitch_and_formants_move_by_their_ratios_at_the_tempo_of_the_formant_ratio():
    x = _vowel()
    for formant, pitch in ((1.0, 0.8), (0.88, 0.7), (0.9, 1.0)):
        y = VoiceTransform(formant, pitch).apply(x, SR)
        assert y.dtype == np.float32 and y.size == round(x.size / formant)
        assert _pitch(y) == pytest.approx(pitch * _pitch(x), rel=0.03)
        assert _first_formant(y) == pytest.approx(formant * _first_formant(x), rel=0.06)


def test_the_same_input_gives_the_same_output():
    x = _vowel(1.0)
    t = VoiceTransform(0.9, 0.75)
    assert np.array_equal(t.apply(x, SR), t.apply(x, SR))
    assert np.array_equal(_streamed(t, x, [1600] * 10), _streamed(t, x, [1600] * 10))


def test_a_stream_in_any_chunking_is_heard_alike_and_as_long_as_the_whole():
    x = _vowel()
    t = VoiceTransform(0.9, 0.8)
    whole = t.apply(x, SR)
    for sizes in ([3200] * 10, [320, 5000, 7000, 19680], [32000]):
        y = _streamed(t, x, sizes)
        assert y.size == whole.size
        assert _pitch(y) == pytest.approx(_pitch(whole), rel=0.02)
        # no gap or burst at a chunk's seam: the level of every 20 ms frame stays near the whole's
        frames = lambda a: np.sqrt(np.mean(a[:a.size // 320 * 320].reshape(-1, 320) ** 2, axis=1))  # noqa: E731
        assert np.all(np.abs(frames(y)[2:-2] - frames(whole)[2:-2]) < 0.35 * frames(whole)[2:-2].max())


def test_output_waits_for_the_lookahead_then_the_rest_comes_at_flush():
    t = StreamingTransform(VoiceTransform(1.0, 0.8), SR)
    assert t.process(np.zeros(int(LOOKAHEAD_S * SR) - 1, np.float32)).size == 0
    first = t.process(_vowel(0.5))
    assert first.size == int(0.5 * SR) - 1 and t.consumed == first.size
    assert t.flush().size == int(LOOKAHEAD_S * SR)


def test_no_change_passes_the_samples_through_untouched():
    x = _vowel(0.5)
    assert np.array_equal(_streamed(VoiceTransform(), x, [700] * 11 + [300]), x)


@pytest.mark.parametrize("bad, message", [({"formant": 0.2}, "formant ratio 0.2"), ({"pitch": "low"}, "pitch ratio"),
                                          ({"speed": 1.1}, "unknown field")])
def test_ratios_out_of_range_and_unknown_fields_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        VoiceTransform.from_dict(bad)
