"""Playback through PortAudio on a device with a real clock (JACK's dummy driver in CI).

Without an output device the PortAudio tests are skipped with the reason, unless
PCGTTS_EXPECT_AUDIO_DEVICE is set (as .ci/run does), where a missing device is a failure.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import soundfile as sf

from pcgtts.runtime.audio import playback
from pcgtts.runtime.audio.chunk import SAMPLE_RATE, AudioChunk
from pcgtts.runtime.audio.playback import FileSink, NullSink, SoundDeviceSink, open_sink


def has_output_device() -> bool:
    try:
        return bool(playback.list_output_devices())
    except RuntimeError:
        return False


needs_device = pytest.mark.skipif(
    not has_output_device() and not os.environ.get("PCGTTS_EXPECT_AUDIO_DEVICE"),
    reason="no PortAudio output device (run .ci/audio-device.sh to start a JACK dummy device)")


def chunks(total_seconds: float, chunk_seconds: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = int(chunk_seconds * SAMPLE_RATE)
    count = int(total_seconds / chunk_seconds)
    for i in range(count):
        yield AudioChunk(rng.uniform(-0.5, 0.5, n).astype(np.float32), SAMPLE_RATE, i, i + 1, time.perf_counter(),
                         i == count - 1)


@needs_device
def test_every_sample_is_played_in_order():
    sink = SoundDeviceSink(prebuffer_seconds=0.1)
    sink.tap = []
    written = []
    with sink:
        for chunk in chunks(0.6, 0.05):
            written.append(chunk.samples)
            sink.write(chunk)
    stats = sink.stats()
    assert stats.samples_played == stats.samples_written
    assert stats.underruns == 0 and stats.first_audio_at is not None
    played = np.concatenate(sink.tap)
    if sink.rate == SAMPLE_RATE:
        start = np.flatnonzero(played)[0]
        assert np.array_equal(played[start:start + sum(map(len, written))], np.concatenate(written))
    else:  # resampled to the device rate: same duration, same energy
        expected = sum(map(len, written)) * sink.rate / SAMPLE_RATE
        assert abs(stats.samples_played - expected) < sink.rate * 0.01


@needs_device
def test_slow_producer_underruns_are_counted_not_fatal():
    sink = SoundDeviceSink(prebuffer_seconds=0.05)
    with sink:
        for chunk in chunks(0.5, 0.05):
            sink.write(chunk)
            time.sleep(0.1)  # produce at half real-time speed
    stats = sink.stats()
    assert stats.underruns > 0 and stats.underrun_seconds > 0.1
    assert stats.samples_played == stats.samples_written


@needs_device
def test_closing_early_stops_cleanly():
    before = threading.active_count()
    sink = SoundDeviceSink(prebuffer_seconds=0.1)
    sink.start()
    sink.write(next(chunks(1.0, 0.1)))
    sink.close()
    sink.close()  # idempotent
    assert threading.active_count() <= before + 1


def test_missing_device_and_missing_portaudio_give_clear_errors(monkeypatch):
    if has_output_device():
        with pytest.raises(RuntimeError, match="no playback device"):
            SoundDeviceSink("no-such-device-xyz").start()

    def broken():
        raise OSError("PortAudio library not found")

    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "sounddevice":
            broken()
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(RuntimeError, match="--out"):
        SoundDeviceSink().start()


def test_null_sink_realtime_clock_counts_underruns():
    fast = NullSink(realtime=True, prebuffer_seconds=0.05)
    with fast:
        for chunk in chunks(0.3, 0.05):
            fast.write(chunk)
    assert fast.stats().underruns == 0 and fast.stats().samples_played == fast.stats().samples_written
    slow = NullSink(realtime=True, prebuffer_seconds=0.0)
    with slow:
        for chunk in chunks(0.3, 0.05):
            slow.write(chunk)
            time.sleep(0.08)
    assert slow.stats().underruns > 0 and slow.stats().samples_played == slow.stats().samples_written


def test_file_sink_writes_every_sample(tmp_path):
    path = tmp_path / "out.wav"
    written = []
    with FileSink(path) as sink:
        for chunk in chunks(0.3, 0.1):
            written.append(chunk.samples)
            sink.write(chunk)
    audio, rate = sf.read(path, dtype="float32")
    assert rate == SAMPLE_RATE and len(audio) == sum(map(len, written))
    np.testing.assert_allclose(audio, np.concatenate(written), atol=1 / 32768)


def test_open_sink_mapping(tmp_path):
    assert isinstance(open_sink(out_path=tmp_path / "x.wav"), FileSink)
    assert isinstance(open_sink("null"), NullSink)
    assert isinstance(open_sink(None), SoundDeviceSink)
