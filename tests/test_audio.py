"""Reference audio: any rate / channel count works; unusable input raises a clear error, never hangs."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf

from pcgtts.runtime.audio.io import load_audio
from pcgtts.runtime.audio.voice import Voice


def tone(seconds: float, rate: int, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * 330 * t)
    return np.stack([x] * channels, 1) if channels > 1 else x


@pytest.mark.parametrize("rate, channels", [(8000, 2), (44100, 1), (48000, 6), (16000, 1), (22050, 2)])
def test_any_rate_and_channel_count(tmp_path, rate, channels):
    path = tmp_path / "ref.flac"
    sf.write(path, tone(1.5, rate, channels), rate)
    audio = load_audio(path)
    assert audio.dtype == np.float32 and abs(len(audio) - 24000) <= 2
    # The 330 Hz tone survives resampling and down-mixing.
    spectrum = np.abs(np.fft.rfft(audio))
    assert abs(np.argmax(spectrum) * 16000 / len(audio) - 330) < 2


@pytest.mark.parametrize("make, error, match", [
    (lambda p: sf.write(p, tone(0.2, 16000), 16000), ValueError, "0.20 s"),
    (lambda p: sf.write(p, np.zeros(32000), 16000), ValueError, "silent"),
    (lambda p: sf.write(p, np.full(32000, np.nan), 16000, subtype="FLOAT"), ValueError, "NaN"),
    (lambda p: p.write_text("this is not audio"), ValueError, "not a readable audio file"),
    (lambda p: sf.write(p, tone(40, 8000), 8000), ValueError, "at most 30"),
    (lambda p: None, FileNotFoundError, "not found"),
])
def test_unusable_reference_audio(tmp_path, make, error, match):
    path = tmp_path / "ref.wav"
    make(path)
    with pytest.raises(error, match=match):
        load_audio(path)


def test_voice_round_trip_and_corrupt_file(tmp_path, demo_codec_dir):
    from pcgtts.runtime.audio.codec import Codec

    path = tmp_path / "ref.wav"
    sf.write(path, tone(1.0, 24000), 24000)
    voice = Voice.from_audio(path, "Hello there.", Codec.from_pretrained(demo_codec_dir, decode_only=False))
    assert len(voice.codes) == 16000 // 320 + 1
    loaded = Voice.load(voice.save(tmp_path / "me.voice"))
    assert np.array_equal(loaded.codes, voice.codes) and loaded.text == voice.text and loaded.source == voice.source
    (tmp_path / "bad.voice").write_bytes(b"garbage" * 10)
    with pytest.raises(ValueError, match="not a pcgtts voice file"):
        Voice.load(tmp_path / "bad.voice")
    with pytest.raises(ValueError, match="empty"):
        Voice(voice.codes, "   ")
