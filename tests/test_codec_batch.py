"""The codec batcher (runtime/audio/codec_batch.py): streams that share an LM batch have their codec
windows decoded together, each stream's audio and chunk boundaries as alone."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pcgtts.runtime.audio.codec import Codec, SpeechCodec
from pcgtts.runtime.audio.codec_batch import CodecBatcher, LaneClosed, decode_batch
from pcgtts.runtime.config import BATCH_MIN_SPEED, StreamConfig, SynthesisConfig
from pcgtts.runtime.synthesizer import Synthesizer

from helpers import wait_until

TEXTS = ["Hello there, a first stream.", "A second one, somewhat longer than that.", "Third."]


@pytest.fixture(scope="module")
def codec(demo_codec_dir):
    return Codec.from_pretrained(demo_codec_dir)


class Toy:
    """A codec without `decode_batch` (the protocol's default loops): sample i of token t is t + i / 320;
    a window holding `bad` fails; `gate`, when set, holds each decode until it opens."""

    def __init__(self, bad: int = -1):
        self.bad, self.gate, self.calls = bad, None, []

    def decode(self, codes):
        codes = np.asarray(codes)
        self.calls.append(len(codes))
        if self.gate is not None:
            self.gate.wait(10)
        if (codes == self.bad).any():
            raise ValueError("a bad window")
        return (codes[:, None] + np.arange(320)[None] / 320).astype(np.float32).reshape(-1)


def test_decode_batch_equals_decoding_each_window(codec):
    codes = np.random.default_rng(0).integers(0, 65536, (3, 83))
    together = codec.decode_batch(codes)
    assert together.shape == (3, 83 * 320) and together.dtype == np.float32
    for row, audio in zip(codes, together):
        alone = codec.decode(row)
        assert alone.shape == audio.shape and np.abs(alone - audio).max() < 1e-4
    with pytest.raises(ValueError, match=r"\[0, 65536\)"):
        codec.decode_batch(np.array([[1, 2], [3, 65536]]))
    toy = Toy()  # the protocol's default, and the helper for a codec without one, loop over `decode`
    assert np.array_equal(SpeechCodec.decode_batch(toy, codes), decode_batch(toy, codes))
    assert np.array_equal(decode_batch(toy, codes)[1], toy.decode(codes[1]))


def on_threads(work, count: int) -> list:
    """work(i) for i < count, each on a thread of its own, at once -> their results, in order."""
    out = [None] * count

    def run(i):
        out[i] = work(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return out


def run_lanes(batcher, codec, windows):
    """Decode `windows` at once, one lane (stream) and one thread each -> audio or the error, each."""

    def decode(i):
        try:
            return batcher.lane().decode(codec, windows[i])
        except Exception as err:
            return err

    return on_threads(decode, len(windows))


def test_windows_due_together_decode_in_one_call_and_a_bad_one_fails_its_stream_only():
    toy, batcher = Toy(bad=7), CodecBatcher()
    batcher.lane()  # another stream is open: windows go through the batcher's thread
    toy.gate = threading.Event()
    busy = threading.Thread(target=batcher.lane().decode, args=(toy, [1, 2]))
    busy.start()  # holds the batcher, so the next windows are all due at its next round
    while not toy.calls:
        time.sleep(0.01)
    windows = [np.arange(10) + 20 * i + 10 for i in range(3)] + [np.array([3, 7, 9] + [0] * 7), np.arange(5) + 100]
    threading.Timer(0.3, toy.gate.set).start()
    out = run_lanes(batcher, toy, windows)
    busy.join(10)
    for i in (0, 1, 2, 4):
        assert np.array_equal(out[i], toy.decode(windows[i]))
    assert isinstance(out[3], ValueError)  # only the stream whose window is bad fails
    assert 4 in batcher.batch_sizes  # the four 10-token windows went in one group; the 5-token one alone


def test_the_shortest_windows_due_decode_first():
    """A stream's first windows are the short ones a listener waits for: in a round they go first."""
    toy, batcher = Toy(), CodecBatcher()
    batcher.lane()
    toy.gate = threading.Event()
    busy = threading.Thread(target=batcher.lane().decode, args=(toy, [1, 2]))
    busy.start()
    while not toy.calls:
        time.sleep(0.01)
    windows = [np.arange(40), np.arange(12), np.arange(40) + 1, np.arange(7)]
    threading.Timer(0.3, toy.gate.set).start()
    run_lanes(batcher, toy, windows)
    busy.join(10)
    assert toy.calls[1:] == [7, 12, 40, 40]  # (the protocol's loop decodes a group window by window)


def test_the_only_open_lane_decodes_its_windows_itself():
    toy, batcher = Toy(), CodecBatcher()
    lane = batcher.lane()
    assert np.array_equal(lane.decode(toy, [4, 5]), toy.decode([4, 5]))
    assert batcher._thread is None and not batcher.batch_sizes and lane.seconds > 0  # no hand-off, timed
    other = batcher.lane()
    lane.decode(toy, [6])
    assert list(batcher.batch_sizes) == [1]  # with a second stream open, through the batcher
    other.close()
    other.close()  # idempotent: counted once
    assert batcher.lanes == 1


def test_a_closed_lane_leaves_the_batcher_at_once():
    toy, batcher = Toy(), CodecBatcher()
    toy.gate = threading.Event()
    lanes = [batcher.lane(), batcher.lane()]
    errors = []

    def decode(lane, codes):
        try:
            lane.decode(toy, codes)
        except LaneClosed as err:
            errors.append(err)

    threads = [threading.Thread(target=decode, args=(lane, [1, 2, 3])) for lane in lanes]
    for thread in threads:
        thread.start()
    time.sleep(0.2)  # the first window decodes (held at the gate), the second waits for the next round
    started = time.monotonic()
    for lane in lanes:
        lane.close()
    for thread in threads:
        thread.join(5)
    assert time.monotonic() - started < 1.0 and len(errors) == 2  # neither waited for the decode
    with pytest.raises(LaneClosed):
        lanes[0].decode(toy, [4])
    toy.gate.set()


def load(models, max_batch):
    # the batch's chunk schedule on both, so that a lone Synthesizer's chunks end where a batched one's do
    config = SynthesisConfig(seed=0, min_tokens=40, tokens_per_char=1.5, stream=StreamConfig(min_speed=BATCH_MIN_SPEED))
    return Synthesizer.from_pretrained(models["target"], models["draft"], models["codec"], policy="ar",
                                       max_length=512, max_batch=max_batch, config=config)


def read_chunks(streams):
    """Read the streams on a thread each -> their chunks, in order."""
    return on_threads(lambda i: list(streams[i]), len(streams))


def assert_same_chunks(alone, together):
    assert [(c.token_start, c.token_end, len(c.samples), c.is_last) for c in alone] == \
           [(c.token_start, c.token_end, len(c.samples), c.is_last) for c in together]
    for a, b in zip(alone, together):
        assert np.abs(a.samples - b.samples).max(initial=0.0) < 1e-4


class Slow:
    """A codec that takes 50 ms a decode call: windows due meanwhile wait for the batcher's next round."""

    def __init__(self, codec):
        self.codec = codec

    def decode(self, codes):
        time.sleep(0.05)
        return self.codec.decode(codes)

    def decode_batch(self, codes):
        time.sleep(0.05)
        return self.codec.decode_batch(codes)


def test_batched_streams_decode_their_windows_together_each_as_alone(tiny_models):
    lone, batched = load(tiny_models, 1), load(tiny_models, 3)
    assert lone.codec_batcher is None
    batched.codec = Slow(batched.codec)
    alone = [list(lone.stream(text, seed=i)) for i, text in enumerate(TEXTS)]
    together = read_chunks([batched.stream(text, seed=i) for i, text in enumerate(TEXTS)])
    for a, b in zip(alone, together):
        assert len(a) > 2
        assert_same_chunks(a, b)
    assert max(batched.codec_batcher.batch_sizes) > 1  # windows of several streams in one decode

    streams = [batched.stream(text, seed=i) for i, text in enumerate(TEXTS)]
    firsts = [next(stream) for stream in streams]
    streams[1].close()  # its reader left: the others go on, undisturbed
    rest = read_chunks([streams[0], streams[2]])
    assert streams[1].stats.cancelled and wait_until(lambda: batched.batch.seated == 0)
    assert_same_chunks(alone[0], [firsts[0]] + rest[0])
    assert_same_chunks(alone[2], [firsts[2]] + rest[1])
