"""The Python API's edges: arguments checked at `stream()` before any work, a stream nobody reads
stops costing CPU, a held stream does not lock its Synthesizer, and text in a script the voice was
not trained on is flagged."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from pcgtts import Synthesizer
from pcgtts.runtime.text.script import foreign_script

LONG_TEXT = " ".join(f"Sentence number {i} goes on for a while, as long texts do." for i in range(40))


@pytest.fixture(scope="module")
def synth(tiny_synth):
    return tiny_synth


def synthesis_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name in ("pcgtts-synthesis", "pcgtts-codec")]


@pytest.mark.parametrize("text, kind", [(None, "NoneType"), (b"hello", "bytes"), (42, "int")])
def test_text_that_is_not_a_str_is_a_type_error_naming_it(synth, text, kind):
    with pytest.raises(TypeError, match=f"text must be a str, got {kind}"):
        synth.stream(text)
    assert not synth._lock.locked() and not synthesis_threads()


def test_ref_text_without_ref_audio_is_refused_not_ignored(synth):
    with pytest.raises(ValueError, match="ref_text is the transcript of ref_audio: give ref_audio too"):
        synth.stream("Hello there.", ref_text="orphan transcript")


@pytest.mark.parametrize("kwargs, error, message", [
    ({"ref_audio": "x.wav", "ref_text": b"bytes"}, TypeError, "ref_text must be a str"),
    ({"ref_audio": 3}, TypeError, "ref_audio must be a path"),
    ({"voice": 3}, TypeError, "voice must be a Voice or a voice file path"),
    ({"config": {"seed": 1}}, TypeError, "config must be a SynthesisConfig"),
])
def test_other_arguments_are_checked_by_type_before_any_work(synth, kwargs, error, message):
    with pytest.raises(error, match=message):
        synth.stream("Hello there.", **kwargs)
    assert not synth._lock.locked()


@pytest.mark.parametrize("settings, message", [
    ({"seed": 2**80}, r"seed must lie in \[0, 2\*\*63 - 1\]"),
    ({"seed": -1}, r"seed must lie in"),
    ({"temperature": 11.0}, r"temperature must lie in \[0, 10\]"),
    ({"top_p": 0.0}, r"top_p must lie in \(0, 1\]"),
    ({"draft_length": 17}, r"draft_length must lie in \[1, 16\]"),
    ({"max_new_tokens": 0}, r"max_new_tokens must lie in \[1, 60000\]"),
    ({"seed": "7"}, r"seed must be an integer"),
])
def test_numbers_out_of_range_are_refused_by_the_settings_before_models_load(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        Synthesizer.from_pretrained(target=tmp_path / "no-such-model", **settings)


def test_a_stream_nobody_reads_stops_costing_cpu(synth):
    stream = synth.stream(LONG_TEXT)
    next(stream)  # the caller keeps the stream and stops reading
    time.sleep(1.0)  # the worker fills its run-ahead (a few seconds of audio) and waits
    queued = stream._job.queued
    before = time.process_time()
    time.sleep(2.0)
    used = time.process_time() - before
    assert used < 0.3, f"{used:.2f} CPU-seconds in 2 s while nobody read the stream"
    assert 0 < queued <= round(synth.config.run_ahead_s * 16000) + 16000  # bounded by the run-ahead (+ a chunk)
    stream.close()


def test_a_held_stream_does_not_keep_the_synthesizer_from_the_next_one(synth):
    held = synth.stream(LONG_TEXT)
    next(held)
    started = time.monotonic()
    assert len(synth.synthesize("The next caller is served.")) > 0
    assert time.monotonic() - started < 10  # served at once, not after the abandon timeout
    with pytest.raises(RuntimeError, match="cancelled: another stream was started"):
        next(held)


@pytest.mark.parametrize("text, script", [
    ("你好，今天天气很好。我们去公园吧。", "Cjk"),
    ("مرحبا بك في هذا المكان الجميل", "Arabic"),
    ("Hello there, a plain English sentence.", None),
    ("Hello there — café, naïve, Zürich.", None),
    ("The word 東京 is rare in English text.", None),
])
def test_text_mostly_in_another_script_is_detected(text, script):
    assert foreign_script(text) == script


def test_text_mostly_in_another_script_is_a_one_line_warning(synth, caplog):
    with caplog.at_level(logging.WARNING, logger="pcgtts.runtime.synthesizer"):
        synth.stream("مرحبا بك في هذا المكان الجميل").close()
    warnings = [r.getMessage() for r in caplog.records if "script" in r.getMessage()]
    assert len(warnings) == 1 and "Arabic script" in warnings[0] and "\n" not in warnings[0]
