"""X-codec2 through transformers on the tiny released-format checkpoint; streaming decode."""

from __future__ import annotations

import numpy as np
import pytest

from pcgtts.runtime.audio.codec import Codec
from pcgtts.runtime.audio.streaming import WindowDecoder
from pcgtts.runtime.config import StreamConfig

# Streamed-vs-one-shot SNR of the default StreamConfig on the demo codec, measured by
# benchmarks/bench_streaming.py (~12 dB on random weights, whose decoder attends globally);
# the test bound leaves margin for other token sequences.
MIN_SNR_DB = 8.0


@pytest.fixture(scope="module")
def codecs(demo_codec_dir):
    return Codec.from_pretrained(demo_codec_dir), Codec.from_pretrained(demo_codec_dir, decode_only=False)


def snr_db(ref: np.ndarray, out: np.ndarray) -> float:
    return float(10 * np.log10((ref**2).sum() / max(((out - ref) ** 2).sum(), 1e-20)))


def test_decode_only_matches_full_model_without_the_encoders(codecs):
    decode_only, full = codecs
    assert decode_only.num_parameters() < full.num_parameters() / 3
    codes = np.random.default_rng(0).integers(0, 65536, 60)
    audio = decode_only.decode(codes)
    assert audio.dtype == np.float32 and audio.shape == (60 * 320,) and np.isfinite(audio).all()
    assert np.array_equal(audio, full.decode(codes))
    assert 1e-3 < np.abs(audio).max() <= 2.0


def test_encode_gives_one_code_per_hop(codecs):
    _, full = codecs
    tone = (0.3 * np.sin(2 * np.pi * 220 * np.arange(16000) / 16000)).astype(np.float32)
    codes = full.encode(tone)
    assert codes.shape == (16000 // 320 + 1,) and codes.min() >= 0 and codes.max() < 65536
    with pytest.raises(ValueError, match="decode-only"):
        codecs[0].encode(tone)


def test_not_a_codec_directory(tmp_path, tiny_lm_factory):
    with pytest.raises(FileNotFoundError):
        Codec.from_pretrained(tmp_path / "missing")
    with pytest.raises(ValueError, match="not an X-codec2"):
        Codec.from_pretrained(tiny_lm_factory())


@pytest.mark.parametrize("config", [
    StreamConfig(),
    StreamConfig(first_chunk_tokens=1, chunk_tokens=1, left_context_tokens=0, codec_lookahead=0,
                 first_chunk_lookahead=0, crossfade_samples=0),
    StreamConfig(first_chunk_tokens=5, chunk_tokens=40, left_context_tokens=10, codec_lookahead=3, crossfade_samples=320),
])
@pytest.mark.parametrize("burst", [1, 17])
def test_stream_covers_every_sample_once(codecs, config, burst):
    decode_only, _ = codecs
    codes = np.random.default_rng(1).integers(0, 65536, 73)
    window = WindowDecoder(decode_only.decode, config)
    chunks = [c for i in range(0, len(codes), burst) for c in window.push(codes[i:i + burst])]
    chunks.append(window.flush())
    assert sum(len(c) for c in chunks) == 320 * len(codes)
    assert all(len(c) % 320 == 0 for c in chunks)
    assert len(chunks[0]) == 320 * min(config.first_chunk_tokens, len(codes))
    if config == StreamConfig(first_chunk_tokens=1, chunk_tokens=1, left_context_tokens=0, codec_lookahead=0,
                              first_chunk_lookahead=0, crossfade_samples=0):
        # No context, no fade: each chunk is exactly that token decoded alone.
        assert np.array_equal(chunks[5], decode_only.decode(codes[5:6]))


def test_chunks_start_small_and_double_up_to_the_chunk_size(codecs):
    decode_only, _ = codecs
    codes = np.random.default_rng(2).integers(0, 65536, 140)
    window = WindowDecoder(decode_only.decode, StreamConfig(first_chunk_tokens=5, chunk_tokens=25))
    sizes = [len(c) // 320 for i in range(len(codes)) for c in window.push(codes[i:i + 1])]
    assert sizes == [5, 10, 20, 25, 25, 25]  # 110 tokens out; the next chunk needs 135 + 8 lookahead
    big_first = WindowDecoder(decode_only.decode, StreamConfig(first_chunk_tokens=30, chunk_tokens=25))
    assert [len(c) // 320 for c in big_first.push(codes)] == [30, 25, 25, 25, 25]


@pytest.mark.parametrize("speed", [1.25, 1.5, 2.0, 3.0])
def test_a_stream_at_the_minimum_speed_never_runs_a_player_dry(speed):
    """Tokens made at `speed` x real time (50 a second x speed), a chunk out the moment it is due, a
    player starting at the first chunk: every later chunk arrives before the audio out has played.
    Without the bound (min_speed 0, what a stream alone uses: `StreamConfig.for_stream`) the second
    chunk comes late below 3.2x real time."""
    from pcgtts.runtime.audio.streaming import ChunkSchedule

    def late_chunks(config):
        schedule, late = ChunkSchedule(config), 0
        start = schedule.due / (50 * speed)  # when the first chunk is due (seconds)
        while schedule.done < 500:
            due_at = schedule.due / (50 * speed)
            late += due_at - start > schedule.done / 50 + 1e-9  # the audio out, played since `start`
            schedule.emitted(schedule.done + schedule.size)
        return late

    assert late_chunks(StreamConfig(min_speed=speed)) == 0
    assert late_chunks(StreamConfig(min_speed=0)) > 0  # doubling alone outruns a stream this slow
    sizes, schedule = [], ChunkSchedule(StreamConfig(min_speed=speed))
    while schedule.done < 300:
        sizes.append(schedule.size)
        schedule.emitted(schedule.done + schedule.size)
    assert sizes[0] == 5 and 25 in sizes[:12] and sizes[-1] == 25  # full-size chunks within ~2.5 s of audio


def test_a_batched_stream_sizes_its_chunks_for_the_batch_speed_and_a_lone_one_doubles():
    from pcgtts.runtime.config import BATCH_MIN_SPEED

    assert StreamConfig().for_stream(batched=True).min_speed == BATCH_MIN_SPEED
    assert StreamConfig().for_stream(batched=False).min_speed == 0
    assert StreamConfig(min_speed=2.5).for_stream(batched=False).min_speed == 2.5  # a setting given stays
    with pytest.raises(ValueError, match="min_speed"):
        StreamConfig(min_speed=0.9)


@pytest.mark.parametrize("config", [StreamConfig(), StreamConfig(first_chunk_tokens=1, chunk_tokens=3, codec_lookahead=0,
                                                                 first_chunk_lookahead=4, crossfade_samples=0)])
def test_the_codec_thread_is_handed_tokens_once_a_chunk_is_due(codecs, config):
    # The LM's thread keeps tokens until the window's next chunk is due (`ChunkSchedule`): the codec's
    # thread wakes once a chunk, not once a token, and emits the chunks an in-line window emits, in order.
    from pcgtts.runtime.audio.streaming import CodecThread

    decode_only, _ = codecs
    codes = np.random.default_rng(3).integers(0, 65536, 140)
    inline = WindowDecoder(decode_only.decode, config)
    expected = [c for t in codes for c in inline.push([t])] + [inline.flush()]
    window = WindowDecoder(decode_only.decode, config)
    handed, got = [], []
    push = window.push
    window.push = lambda tokens: handed.append(len(tokens)) or push(tokens)
    codec = CodecThread(window, lambda samples, last: got.append(samples) or True)
    for t in codes:
        assert codec.push([int(t)])
    assert codec.finish()
    assert len(got) == len(expected) and all(np.array_equal(a, b) for a, b in zip(got, expected))
    assert sum(handed) == len(codes) and len(handed) <= len(expected), handed


@pytest.mark.parametrize("length, context", [(140, 0), (77, 30), (15, 0)])
def test_the_last_window_is_decoded_on_the_finishing_thread(codecs, length, context):
    # finish() decodes the last window on the LM's thread (the codec's may still be busy with the chunk
    # before it); the codec's thread only joins it on: the same chunks as an in-line window, bit for
    # bit, a voice prompt's codes as left context included. 15 tokens: the chunks due (5 + 2, then 10 + 8)
    # leave 10 tokens to flush.
    import threading

    from pcgtts.runtime.audio.streaming import CodecThread

    decode_only, _ = codecs
    rng = np.random.default_rng(4 + length)
    codes, ctx = rng.integers(0, 65536, length), rng.integers(0, 65536, context) if context else None
    inline = WindowDecoder(decode_only.decode, StreamConfig(), context=ctx)
    expected = [c for t in codes for c in inline.push([t])] + [inline.flush()]
    calls = []

    def decode(window_codes):
        calls.append(threading.current_thread() is threading.main_thread())
        return decode_only.decode(window_codes)

    got = []
    window = WindowDecoder(decode, StreamConfig(), context=ctx)
    codec = CodecThread(window, lambda samples, last: got.append(samples) or True)
    for t in codes:
        assert codec.push([int(t)])
    assert codec.finish()
    assert len(got) == len(expected) and all(np.array_equal(a, b) for a, b in zip(got, expected))
    assert len(calls) == len(expected) and calls.count(True) == 1  # the last window, possibly decoded first


def test_streamed_audio_matches_one_shot_decode(codecs):
    decode_only, _ = codecs
    for seed in range(2):
        codes = np.random.default_rng(10 + seed).integers(0, 65536, 120)
        window = WindowDecoder(decode_only.decode)
        out = np.concatenate([*(c for i in range(0, 120, 5) for c in window.push(codes[i:i + 5])), window.flush()])
        ref = decode_only.decode(codes)
        assert snr_db(ref, out) > MIN_SNR_DB
        # Without left context the seams are far worse: the bound above is not vacuous.
        bare = WindowDecoder(decode_only.decode, StreamConfig(left_context_tokens=0, codec_lookahead=0,
                                                               first_chunk_lookahead=0, crossfade_samples=0))
        naive = np.concatenate([*(c for i in range(0, 120, 5) for c in bare.push(codes[i:i + 5])), bare.flush()])
        assert snr_db(ref, naive) < snr_db(ref, out) - 3


def test_voice_prompt_codes_serve_as_left_context(codecs):
    decode_only, _ = codecs
    codes = np.random.default_rng(3).integers(0, 65536, 120)
    context, new = codes[:60], codes[60:]
    window = WindowDecoder(decode_only.decode, StreamConfig(), context=context)
    out = np.concatenate([*window.push(new), window.flush()])
    assert len(out) == 320 * len(new)
    ref = decode_only.decode(codes)[60 * 320:]
    without = WindowDecoder(decode_only.decode, StreamConfig())
    plain = np.concatenate([*without.push(new), without.flush()])
    assert snr_db(ref, out) > snr_db(ref, plain)


def test_the_first_chunk_waits_for_its_own_lookahead_and_later_chunks_for_the_codec_lookahead(codecs):
    decode_only, _ = codecs
    codes = np.random.default_rng(4).integers(0, 65536, 60)
    chunks = {}
    for first_lookahead in (2, 8):
        config = StreamConfig(first_chunk_tokens=5, chunk_tokens=10, codec_lookahead=8,
                              first_chunk_lookahead=first_lookahead)
        window = WindowDecoder(decode_only.decode, config)
        ready = [i + 1 for i in range(len(codes)) for _ in window.push(codes[i:i + 1])]  # tokens seen per chunk
        assert ready[:3] == [5 + first_lookahead, 15 + 8, 25 + 8]
        chunks[first_lookahead] = WindowDecoder(decode_only.decode, config).push(codes)
    short, long = chunks[2], chunks[8]
    assert [len(x) for x in short] == [len(x) for x in long]
    assert not np.array_equal(short[0], long[0])  # the first window differs ...
    # ... and only the second chunk's cross-fade (640 samples) blends in that window's tail.
    assert all(np.array_equal(x[640:], y[640:]) for x, y in zip(short[1:], long[1:]))
    assert all(np.array_equal(x, y) for x, y in zip(short[2:], long[2:]))


@pytest.mark.parametrize("kwargs", [{"first_chunk_tokens": 0}, {"codec_lookahead": -1},
                                    {"codec_lookahead": 1, "crossfade_samples": 640},
                                    {"first_chunk_lookahead": -1},
                                    {"first_chunk_lookahead": 1, "crossfade_samples": 640}])
def test_bad_stream_config(kwargs):
    with pytest.raises(ValueError):
        StreamConfig(**kwargs)
