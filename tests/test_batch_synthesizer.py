"""Several `stream()` calls at once on one Synthesizer (`max_batch`): plain streams decode together
in a batch over one model copy, each as it would alone."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pcgtts.runtime.config import BATCH_MIN_SPEED, DeviceConfig, StreamConfig, SynthesisConfig
from pcgtts import BatchFull
from pcgtts.runtime.lm.batched import check_batch_backend
from pcgtts.runtime.synthesizer import Synthesizer

from helpers import wait_until

TEXTS = ["Hello there, a first stream.", "A second one, somewhat longer than that.", "Third."]


def load(models, max_batch):
    # the batch's chunk schedule on both, so that a lone Synthesizer's chunks end where a batched one's do
    config = SynthesisConfig(seed=0, min_tokens=20, tokens_per_char=1.0, stream=StreamConfig(min_speed=BATCH_MIN_SPEED))
    return Synthesizer.from_pretrained(models["target"], models["draft"], models["codec"], policy="ar",
                                       max_length=512, max_batch=max_batch, config=config)


@pytest.fixture(scope="module")
def lone(tiny_models):
    return load(tiny_models, 1)


@pytest.fixture(scope="module")
def batched(tiny_models):
    return load(tiny_models, 3)


def same_audio(a, b) -> bool:
    """Equal lengths and samples up to float rounding: a batched stream's codec windows are decoded
    beside the other streams' (runtime/audio/codec_batch.py)."""
    return len(a) == len(b) and float(np.abs(a - b).max(initial=0.0)) < 1e-4


def read_all(streams):
    """Read the streams on a thread each -> their audio, in order."""
    out = [None] * len(streams)

    def read(i):
        out[i] = np.concatenate([chunk.samples for chunk in streams[i]])

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(streams))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_concurrent_streams_on_one_synthesizer_each_sound_as_alone(lone, batched, temperature):
    """Three streams at once on one Synthesizer (one model copy) each give the audio the same call
    gives alone on a Synthesizer that streams one at a time (greedy, and seeded: a stream's draws come
    from its own generator)."""
    alone = [lone.synthesize(text, seed=i, temperature=temperature) for i, text in enumerate(TEXTS)]
    streams = [batched.stream(text, seed=i, temperature=temperature) for i, text in enumerate(TEXTS)]
    assert batched.batch.seated == 3
    together = read_all(streams)
    for a, b in zip(alone, together):
        assert same_audio(a, b)
    assert max(batched.batch.occupancy) > 1  # they did share steps
    assert batched.batch.seated == 0  # every slot is free again


def test_a_full_batch_refuses_the_next_stream_at_once(batched):
    streams = [batched.stream(text) for text in TEXTS]
    started = time.monotonic()
    with pytest.raises(BatchFull, match="all 3 batch slots"):
        batched.stream("One too many.")
    assert time.monotonic() - started < 1.0
    for stream in streams:
        stream.close()
    assert batched.batch.seated == 0
    batched.synthesize("A slot is free again.")


def test_a_closed_stream_frees_its_slot_and_the_others_finish_undisturbed(lone, batched):
    alone = [lone.synthesize(text, seed=i) for i, text in enumerate(TEXTS)]
    streams = [batched.stream(text, seed=i) for i, text in enumerate(TEXTS)]
    firsts = [next(stream).samples for stream in streams]
    streams[1].close()  # its reader left (a client disconnecting)
    assert wait_until(lambda: batched.batch.seated == 2)  # free once the step under way ends
    rest = read_all([streams[0], streams[2]])
    assert same_audio(np.concatenate([firsts[0], rest[0]]), alone[0])
    assert same_audio(np.concatenate([firsts[2], rest[1]]), alone[2])
    assert streams[1].stats.cancelled


def test_an_overlong_prompt_is_refused_before_taking_a_slot(batched):
    with pytest.raises(ValueError, match="leaves no room in the KV cache"):
        batched.stream("Far too much to fit.", min_tokens=600)
    assert batched.batch.seated == 0


def test_speculative_streams_batch_beside_plain_ones(lone, batched):
    """With a torch draft, its policies at a fixed draft length decode in the batch too (each stream its
    own loop over its slots, ragged acceptance), beside a plain stream, each as alone."""
    calls = [dict(seed=0), dict(seed=1, policy="sd", adaptive_draft=False),
             dict(seed=2, policy="ssd", adaptive_draft=False, draft_length=2)]
    alone = [lone.synthesize(text, **call) for text, call in zip(TEXTS, calls)]
    streams = [batched.stream(text, **call) for text, call in zip(TEXTS, calls)]
    assert batched.batch.seated == 3
    for a, b in zip(alone, read_all(streams)):
        assert same_audio(a, b)
    assert max(batched.batch.gate.sizes) > 1


def test_an_adaptive_draft_length_batches_beside_plain_streams(tiny_models, lone):
    """An adaptive draft length decodes in the batch too, planned with the batch's shared passes: its own
    loop when speculating pays at the batch's size, else the batch's plain steps (greedy: the same codes
    either way, those of plain decoding alone)."""
    synth = load(tiny_models, 2)
    plain = synth.stream(TEXTS[0], seed=0)
    adaptive = synth.stream(TEXTS[1], seed=1, policy="sd", adaptive_draft=True, temperature=0.0)
    assert synth.batch.seated == 2
    got = read_all([plain, adaptive])
    assert same_audio(got[0], lone.synthesize(TEXTS[0], seed=0))
    assert same_audio(got[1], lone.synthesize(TEXTS[1], seed=1, policy="ar", temperature=0.0))
    assert not adaptive.stats.cancelled
    assert synth.batch.seated == 0


def test_batching_needs_the_torch_backend():
    with pytest.raises(ValueError, match="torch backend"):
        DeviceConfig(backend="onnxruntime", max_batch=2)
    with pytest.raises(ValueError, match="max_batch must be an integer"):
        DeviceConfig(max_batch=0)
    check_batch_backend("auto", None)  # a checkpoint (or none named yet) runs on torch


def test_batching_refuses_an_export_before_loading(tmp_path):
    export = tmp_path / "target"
    export.mkdir()
    (export / "pcgtts-lm.json").write_text('{"kind": "onnx"}')
    with pytest.raises(ValueError, match="loads on onnxruntime"):
        check_batch_backend("auto", export)
