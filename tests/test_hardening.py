"""Nothing crashes, nothing is lost, nothing is silently ignored: abandoned streams, long
sentences, atomic outputs, and one-line CLI errors for bad input (validated before models load)."""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import soundfile as sf

from helpers import wait_until


def workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name in ("pcgtts-synthesis", "pcgtts-codec")]


def test_a_dropped_stream_frees_its_worker_and_the_lock(tiny_synth):
    for chunk in tiny_synth.stream("A stream that is dropped after its first chunk."):
        break  # the loop's stream object is the last reference: dropping it closes the stream
    gc.collect()
    assert wait_until(lambda: not workers()), "the worker thread outlived its stream"
    assert wait_until(lambda: not tiny_synth.stream_lock.locked())
    assert len(tiny_synth.synthesize("Usable again.")) > 0


def test_a_kept_but_unread_stream_is_abandoned_in_bounded_time(tiny_synth):
    config = replace(tiny_synth.config, run_ahead_s=0.01, abandon_after_s=0.3)
    kept = tiny_synth.stream("A stream kept by the caller but never read again after the first chunk.",
                             config=config)
    next(kept)
    assert wait_until(lambda: not workers(), 5.0), "an unread stream kept its worker"
    assert wait_until(lambda: not tiny_synth.stream_lock.locked(), 1.0), "an unread stream kept the lock"
    assert kept.stats.cancelled
    other = tiny_synth.synthesize("Another caller gets the synthesizer.")
    assert len(other) > 0
    with pytest.raises(RuntimeError, match="abandoned"):
        for _ in kept:
            pass


def test_with_block_and_close_free_everything(tiny_synth):
    with tiny_synth.stream("Closed by the with block.") as stream:
        next(stream)
    assert not workers() and not tiny_synth.stream_lock.locked() and stream.stats.cancelled
    stream.close()  # idempotent


def test_long_sentences_are_split_to_fit_the_cache_and_cuts_are_reported(tiny_synth, caplog):
    """max_length 256: one 40-word sentence cannot fit prompt + budget, so it is split; every
    piece runs to its budget (random weights never stop), and each cut is on the chunks and logged."""
    text = " ".join(["word"] * 40) + "."
    config = replace(tiny_synth.config, tokens_per_char=2.0)
    prompts, budgets, _ = tiny_synth._fit([text], None, config)
    assert len(prompts) >= 2
    capacity = tiny_synth.target.max_length - config.decode.draft_length - 2
    assert all(len(p) + b <= capacity for p, b in zip(prompts, budgets))
    stream = tiny_synth.stream(text, config=config)
    chunks = list(stream)
    assert stream.stats.truncated == len(prompts) and chunks[-1].truncated_sentences == len(prompts)
    assert all(s.finish == "max_tokens" for s in stream.stats.sentences)  # the budget, never the cache
    assert "without the stop token" in caplog.text


def test_a_prompt_that_cannot_fit_is_refused_before_work(tiny_synth):
    from pcgtts import Voice

    voice = Voice(codes=np.zeros(400, np.int64), text="A very long reference.")
    with pytest.raises(ValueError, match="leaves no room in the KV cache"):
        tiny_synth.stream("Hello.", voice=voice)
    assert not tiny_synth.stream_lock.locked()


def test_the_codec_thread_gives_the_same_chunks_as_decoding_in_line(tiny_synth):
    """Codec windows decoded on their own thread (the default) are the chunks the worker's own
    thread makes: same samples, same boundaries, same order."""
    text = "The codec decodes beside the language model, chunk by chunk."
    threaded = list(tiny_synth.stream(text))
    in_line = list(tiny_synth.stream(text, config=replace(tiny_synth.config,
                                                          stream=replace(tiny_synth.config.stream, codec_thread=False))))
    assert len(threaded) == len(in_line) > 3
    for a, b in zip(threaded, in_line):
        assert (a.token_start, a.token_end, a.is_last) == (b.token_start, b.token_end, b.is_last)
        assert np.array_equal(a.samples, b.samples)


def test_a_codec_error_reaches_the_reader_and_frees_everything(tiny_synth, monkeypatch):
    """An exception on the codec thread is raised to the reader; both threads end and the lock is freed."""
    calls = []
    original = tiny_synth.codec.decode

    def failing(codes):
        calls.append(len(codes))
        if len(calls) == 3:
            raise RuntimeError("codec broke on its third window")
        return original(codes)

    monkeypatch.setattr(tiny_synth.codec, "decode", failing)
    with pytest.raises(RuntimeError, match="third window"):
        for _ in tiny_synth.stream("A long enough sentence to need several codec windows, and then some more."):
            pass
    assert wait_until(lambda: not workers()) and wait_until(lambda: not tiny_synth.stream_lock.locked())
    monkeypatch.undo()
    assert len(tiny_synth.synthesize("Usable again.")) > 0


def test_codec_thread_stops_when_a_chunk_is_refused():
    from pcgtts.runtime.audio.streaming import CodecThread, WindowDecoder
    from pcgtts.runtime.config import StreamConfig

    taken = []
    window = WindowDecoder(lambda codes: np.zeros(320 * len(codes), np.float32), StreamConfig(codec_lookahead=0,
                                                                                               crossfade_samples=0))
    codec = CodecThread(window, lambda samples, last: taken.append(len(samples)) or len(taken) < 2)
    for _ in range(20):
        if not codec.push([1] * 10):
            break
        time.sleep(0.01)
    else:
        pytest.fail("push kept accepting tokens after the consumer refused a chunk")
    codec.close()
    codec.close()  # idempotent
    assert len(taken) == 2 and not codec._thread.is_alive()


# -- the CLI: one-line errors, before any model is loaded or made -------------------------------



def run_cli(argv, capsys) -> tuple[int, str]:
    from pcgtts.cli import main

    try:
        code = main(argv)
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    err = capsys.readouterr().err.strip()
    return code, err


def small_table(path):
    from pcgtts.groups.table import GroupTable

    offsets, members = np.array([0, 2, 3]), np.array([0, 1, 2])
    return GroupTable.from_groups_csr(offsets, members, 3, theta=0.4).save(path)


@pytest.mark.parametrize("argv, message", [
    (["speak", "   "], "text is empty"),
    (["speak", "hi", "--ref-text", "words"], "--ref-text is the transcript of --ref-audio"),
    (["speak", "hi", "--compute-device", "cuda", "--out", "{tmp}/a.wav"], "no usable CUDA"),
    (["speak", "hi", "--out", "{tmp}"], "is a directory"),
    (["speak", "hi", "--out", "/proc/pcgtts-test.wav"], "cannot write"),
    (["speak", "hi", "--out", "{tmp}/a.wav", "--draft", "{tmp}"], "draft given without a target"),
    (["speak", "hi", "--out", "{tmp}/a.wav", "--voice", "{tmp}/pickled.npy"], "holds pickled objects"),
    (["speak", "hi", "--out", "{tmp}/a.wav", "--voice", "{tmp}/bare.npy"], "bare numpy array"),
    (["speak", "hi", "--out", "{tmp}/a.wav", "--ref-audio", "{tmp}/fake.mp3", "--ref-text", "t"],
     "not a readable audio file"),
    (["speak", "hi", "--out", "{tmp}/a.wav", "--config", "{tmp}/bad.toml"], "unknown setting 'polcy'"),
    (["eval", "--mode", "cloning"], "--mode cloning needs --corpus"),
    (["eval", "--mode", "cloning", "--corpus", "{tmp}"], "corpus manifest not found"),
    (["eval", "--corpus", "{tmp}"], "--corpus and --oracle are for --mode cloning"),
    (["eval", "--mode", "cloning", "--corpus", "{tmp}", "--oracle", "--target", "{tmp}"], "it takes no LM"),
    (["bench", "--speed", "0"], "must be > 0"),
    (["bench", "--runs", "0"], "must be > 0"),
    (["bench", "--json", "/proc/pcgtts.json"], "cannot write"),
    (["groups", "info", "{tmp}/corrupt.pcg"], "corrupt.pcg: group table checksum mismatch"),
    (["groups", "build", "--target", "{tmp}", "--out", "/proc/g.pcg"], "cannot write"),
    (["voice", "add", "{tmp}/ref.wav", "--text", "words", "--out", "/proc/v.voice"], "cannot write"),
    (["models", "demo", "--out", "/proc/pcgtts-demo"], "cannot write"),
    (["export", "onnx", "--model", "{tmp}/missing", "--out", "{tmp}/x"], "directory not found"),
])
def test_bad_input_is_one_clear_line_before_models_load(argv, message, tmp_path, capsys, no_models):
    np.save(tmp_path / "pickled.npy", np.array([{"codes": 1}], dtype=object), allow_pickle=True)
    np.save(tmp_path / "bare.npy", np.arange(10))
    (tmp_path / "fake.mp3").write_bytes(b"ID3" + bytes(200))
    (tmp_path / "bad.toml").write_text('polcy = "sd"\n')
    sf.write(tmp_path / "ref.wav", 0.3 * np.sin(np.arange(32000) / 5), 16000)
    table = small_table(tmp_path / "corrupt.pcg")
    data = bytearray(table.read_bytes())
    data[40] ^= 0x01  # one header byte
    table.write_bytes(bytes(data))
    code, err = run_cli([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert code == 2, err
    assert message in err and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if "error" in line]) == 1, err


def test_a_failed_write_leaves_the_old_file_and_ctrl_c_keeps_a_valid_partial(tmp_path):
    from pcgtts import AudioChunk
    from pcgtts.runtime.audio.playback import FileSink

    out = tmp_path / "speech.wav"
    sf.write(out, np.full(1600, 0.5, np.float32), 16000)
    chunk = AudioChunk(np.zeros(320, np.float32), 16000, 0, 1, 0.0)
    with pytest.raises(RuntimeError):
        with FileSink(out) as sink:
            sink.write(chunk)
            raise RuntimeError("synthesis failed half-way")
    audio, _ = sf.read(out)
    assert len(audio) == 1600 and sorted(p.name for p in tmp_path.iterdir()) == ["speech.wav"]
    with pytest.raises(KeyboardInterrupt):
        with FileSink(out) as sink:
            sink.write(chunk)
            raise KeyboardInterrupt
    # the user stopped it: what was made is kept beside the output, as a valid WAV; the output is untouched
    assert len(sf.read(out)[0]) == 1600 and len(sf.read(tmp_path / "speech.partial.wav")[0]) == 320
    assert sink.kept == tmp_path / "speech.partial.wav"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["speech.partial.wav", "speech.wav"]


def test_an_unknown_audio_device_is_named_with_the_choices(capsys, no_models):
    code, err = run_cli(["speak", "hi", "--audio-device", "no-such-card-xyz"], capsys)
    assert code == 2 and "Traceback" not in err
    # with PortAudio: the device list; without it: how to get it (both one line, before models load)
    assert "no audio output device 'no-such-card-xyz'" in err or "PortAudio" in err, err


def test_atomic_outputs_get_ordinary_permissions(tmp_path):
    """mkstemp's private 0600 must not leak into the user's file; an existing file keeps its mode."""
    import os
    import stat

    from pcgtts.runtime.files import atomic_output, default_mode

    fresh = tmp_path / "fresh.json"
    with atomic_output(fresh) as tmp:
        tmp.write_text("{}")
    assert stat.S_IMODE(fresh.stat().st_mode) == default_mode()
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    os.chmod(kept, 0o640)
    with atomic_output(kept) as tmp:
        tmp.write_text("new")
    assert stat.S_IMODE(kept.stat().st_mode) == 0o640 and kept.read_text() == "new"
