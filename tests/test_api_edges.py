"""The Python API's edges: arguments (per-call settings included) checked at `stream()` before any
work, a stream nobody reads stops costing CPU, a held stream does not lock its Synthesizer, and text
in a script the voice was not trained on is flagged."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from pcgtts import Synthesizer, Voice
from pcgtts.runtime.checks import BUILTIN_VOICE_SCRIPTS, check_scripts, voice_scripts
from pcgtts.runtime.text.script import foreign_script

LONG_TEXT = " ".join(f"Sentence number {i} goes on for a while, as long texts do." for i in range(40))


@pytest.fixture(scope="module")
def synth(tiny_synth):
    return tiny_synth


def synthesis_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name in ("pcgtts-synthesis", "pcgtts-codec")]


def assert_no_work_started(synth) -> None:
    assert not synth.stream_lock.locked() and not synthesis_threads()


# -- arguments -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, kind", [(None, "NoneType"), (b"hello", "bytes"), (42, "int")])
def test_text_that_is_not_a_str_is_a_type_error_naming_it(synth, text, kind):
    with pytest.raises(TypeError, match=f"text must be a str, got {kind}"):
        synth.stream(text)
    assert_no_work_started(synth)


def test_ref_text_without_ref_audio_is_refused_not_ignored(synth):
    with pytest.raises(ValueError, match="ref_text is the transcript of ref_audio: give ref_audio too"):
        synth.stream("Hello there.", ref_text="orphan transcript")


@pytest.mark.parametrize("kwargs, error, message", [
    ({"ref_audio": "x.wav", "ref_text": b"bytes"}, TypeError, "ref_text must be a str"),
    ({"ref_audio": 3}, TypeError, "ref_audio must be a path"),
    ({"voice": 3}, TypeError, "voice must be a Voice, a voice file path or a preset name"),
    ({"config": {"seed": 1}}, TypeError, "config must be a SynthesisConfig"),
])
def test_other_arguments_are_checked_by_type_before_any_work(synth, kwargs, error, message):
    with pytest.raises(error, match=message):
        synth.stream("Hello there.", **kwargs)
    assert_no_work_started(synth)


def test_empty_text_is_refused_before_the_reference_is_encoded(synth, tmp_path, monkeypatch):
    sf.write(tmp_path / "ref.wav", 0.3 * np.sin(np.arange(32000) / 5), 16000)

    def encode(*args):
        raise AssertionError("the reference was encoded before the text was checked")

    monkeypatch.setattr(synth, "voice_from_audio", encode)
    with pytest.raises(ValueError, match="text is empty"):
        synth.stream("   ", ref_audio=tmp_path / "ref.wav", ref_text="Hello there.")
    assert_no_work_started(synth)


def test_an_unknown_voice_is_a_clear_error(synth):
    """A string that names no file is a preset's name (this model has none); a missing Path is a file."""
    with pytest.raises(ValueError, match="'alloy' is neither a voice file nor a preset"):
        synth.stream("Hello there.", voice="alloy")
    with pytest.raises(FileNotFoundError, match="voice file not found: missing.voice"):
        synth.stream("Hello there.", voice=Path("missing.voice"))
    assert_no_work_started(synth)


def test_a_voice_made_for_a_larger_codebook_is_refused_naming_it(synth):
    foreign = Voice(np.array([600, 3], np.int64), "Hello there.")  # the tiny model has 512 speech tokens
    with pytest.raises(ValueError, match="codec token 600, beyond this model's 512 speech tokens"):
        synth.stream("Hello there.", voice=foreign)
    assert_no_work_started(synth)


# -- per-call settings: through the config dataclasses ------------------------------------------

RANGES = [
    ({"seed": 2**80}, r"seed must lie in \[0, 2\*\*63 - 1\]"),
    ({"seed": -1}, r"seed must lie in"),
    ({"temperature": 11.0}, r"temperature must lie in \[0, 10\]"),
    ({"top_p": 0.0}, r"top_p must lie in \(0, 1\]"),
    ({"draft_length": 17}, r"draft_length must lie in \[1, 16\]"),
    ({"max_new_tokens": 0}, r"max_new_tokens must lie in \[1, 60000\]"),
]


@pytest.mark.parametrize("settings, message", RANGES + [({"seed": "7"}, r"seed must be an integer")])
def test_numbers_out_of_range_are_refused_by_the_settings_before_models_load(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        Synthesizer.from_pretrained(target=tmp_path / "no-such-model", **settings)


@pytest.mark.parametrize("settings, message", RANGES + [({"policy": "fast"}, r"policy must be one of")])
def test_per_call_settings_out_of_range_are_refused_by_the_config_before_any_work(synth, settings, message):
    with pytest.raises(ValueError, match=message):
        synth.stream("Hello there.", **settings)
    assert_no_work_started(synth)


@pytest.mark.parametrize("settings, message", [
    ({"seed": "7"}, "seed must be int, got str"),
    ({"temperature": "hot"}, "temperature must be float, got str"),
    ({"draft_length": 2.5}, "draft_length must be int, got float"),
    ({"spell_numbers": 1}, "spell_numbers must be bool, got int"),
    ({"max_new_tokens": True}, "max_new_tokens must be int, got bool"),
])
def test_a_per_call_setting_of_the_wrong_type_is_a_type_error_naming_it(synth, settings, message):
    with pytest.raises(TypeError, match=message):
        synth.stream("Hello there.", **settings)
    assert_no_work_started(synth)


def test_an_unknown_keyword_is_a_type_error_naming_it(synth):
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'; the per-call settings are"):
        synth.stream("Hello there.", temprature=0.5)


def test_a_setting_fixed_at_load_is_refused_per_call(synth):
    with pytest.raises(ValueError, match="max_length is fixed when the models load: give it to "
                                         "Synthesizer.from_pretrained"):
        synth.synthesize("Hello there.", max_length=512)
    assert_no_work_started(synth)


def test_per_call_settings_apply_to_that_call_only(synth):
    text = "A seeded call."
    by_name = synth.synthesize(text, seed=3, temperature=0.9)
    config = replace(synth.config, seed=3,
                     decode=replace(synth.config.decode,
                                    sampling=replace(synth.config.decode.sampling, temperature=0.9)))
    assert np.array_equal(by_name, synth.synthesize(text, config=config))
    assert not np.array_equal(by_name, synth.synthesize(text, seed=4, temperature=0.9))
    assert synth.config.seed == 0 and synth.config.decode.sampling.temperature != 0.9


# -- a stream nobody reads ------------------------------------------------------------------

def wait_until_idle(limit_s: float = 10.0) -> None:
    """Wait until this process uses next to no CPU for a quarter second (the worker filled its
    run-ahead and waits), or `limit_s` passed."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = time.process_time()
        time.sleep(0.25)
        if time.process_time() - before < 0.02:
            return


def test_a_stream_nobody_reads_stops_costing_cpu(synth):
    stream = synth.stream(LONG_TEXT)
    next(stream)  # the caller keeps the stream and stops reading
    wait_until_idle()
    before = time.process_time()
    time.sleep(2.0)
    used = time.process_time() - before
    assert used < 0.3, f"{used:.2f} CPU-seconds in 2 s while nobody read the stream"
    assert 0 < ready_audio_s(stream) <= synth.config.run_ahead_s + 0.5  # the run-ahead (+ a chunk) was made
    stream.close()


def ready_audio_s(stream) -> float:
    """Seconds of audio the stream had made by now and not handed out: its chunks ready before now."""
    now, seconds = time.perf_counter(), 0.0
    for chunk in stream:
        if chunk.ready_time > now:
            break
        seconds += chunk.duration
    return seconds


def test_a_held_stream_does_not_keep_the_synthesizer_from_the_next_one(synth):
    held = synth.stream(LONG_TEXT)
    next(held)
    started = time.monotonic()
    assert len(synth.synthesize("The next caller is served.")) > 0
    assert time.monotonic() - started < 10  # served at once, not after the abandon timeout
    assert held.stats.cancelled
    with pytest.raises(RuntimeError, match="cancelled: another stream was started"):
        next(held)


def test_a_second_stream_while_another_thread_reads_the_first_is_refused_in_one_line(synth, monkeypatch):
    gate = threading.Event()
    decode = synth.codec.decode

    def held_decode(*args, **kwargs):  # the reader waits inside next() until the gate opens
        gate.wait(10)
        return decode(*args, **kwargs)

    monkeypatch.setattr(synth.codec, "decode", held_decode)
    stream = synth.stream("A reader on another thread waits for this audio.")
    chunks = []
    reader = threading.Thread(target=lambda: chunks.extend(stream))
    reader.start()
    try:
        deadline = time.monotonic() + 5
        while not stream._job.reading and time.monotonic() < deadline:
            time.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="already streaming to a reader") as refused:
            synth.stream("A second caller.")
        assert time.monotonic() - started < 1 and "\n" not in str(refused.value)
    finally:
        gate.set()
        reader.join(30)
    assert chunks and not stream.stats.cancelled  # the stream being read was left alone


def read_one_chunk_on_a_thread(stream) -> threading.Thread:
    """A consumer on another thread that reads one chunk, then holds the stream (a player between reads)."""
    reader = threading.Thread(target=lambda: next(stream))
    reader.start()
    reader.join(30)
    return reader


def test_a_stream_another_thread_reads_between_chunks_is_not_cancelled_by_a_second(synth):
    stream = synth.stream(LONG_TEXT)
    read_one_chunk_on_a_thread(stream)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="already streaming to a reader") as refused:
        synth.stream("A second caller.")
    assert time.monotonic() - started < 1 and "\n" not in str(refused.value)
    assert not stream.stats.cancelled and len(next(stream).samples) > 0  # its reader reads on
    stream.close()


def test_a_stream_another_thread_stopped_reading_is_cancelled_after_the_run_ahead(synth):
    stream = synth.stream(LONG_TEXT, run_ahead_s=0.5)
    read_one_chunk_on_a_thread(stream)
    time.sleep(0.7)  # longer than its run-ahead: a player would have read again by now
    assert len(synth.synthesize("The next caller is served.")) > 0
    assert stream.stats.cancelled
    with pytest.raises(RuntimeError, match="cancelled: another stream was started"):
        next(stream)


# -- scripts ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, script", [
    ("你好，今天天气很好。我们去公园吧。", "CJK"),
    ("مرحبا بك في هذا المكان الجميل", "Arabic"),
    ("Привет, как у тебя дела сегодня?", "Cyrillic"),
    ("Hello there, a plain English sentence.", None),
    ("Hello there — café, naïve, Zürich.", None),
    ("Ｆｕｌｌｗｉｄｔｈ Ｌａｔｉｎ letters.", None),
    ("The word 東京 is rare in English text.", None),
    ("1234 -- !!", None),
])
def test_text_mostly_in_another_script_is_detected(text, script):
    assert foreign_script(text) == script


def test_a_script_the_voice_reads_is_not_foreign():
    assert foreign_script("你好，今天天气很好。", reads=("Latin", "CJK")) is None


def test_text_mostly_in_another_script_is_a_one_line_warning(synth, caplog, monkeypatch):
    monkeypatch.setattr(synth, "scripts", BUILTIN_VOICE_SCRIPTS)  # as the built-in voice's
    with caplog.at_level(logging.WARNING, logger="pcgtts.runtime.synthesizer"):
        synth.stream("مرحبا بك في هذا المكان الجميل").close()
        synth.stream("A plain English sentence.").close()
    warnings = [r.getMessage() for r in caplog.records if "script" in r.getMessage()]
    assert len(warnings) == 1 and "Arabic script" in warnings[0] and "\n" not in warnings[0]


def test_a_checkpoint_of_unknown_training_gets_no_script_warning(synth, caplog):
    assert synth.scripts is None  # a named checkpoint (LLaSA's own read Chinese too)
    with caplog.at_level(logging.WARNING, logger="pcgtts.runtime.synthesizer"):
        synth.stream("你好，今天天气很好。").close()
    assert not [r for r in caplog.records if "script" in r.getMessage()]


def test_the_builtin_voice_reads_latin_script_and_a_named_checkpoint_is_not_assumed(tmp_path):
    assert voice_scripts(None) == ("Latin",) and voice_scripts(tmp_path) is None


def test_from_pretrained_gives_the_builtin_voice_its_scripts(monkeypatch):
    import pcgtts.builtin

    loaded = {}
    monkeypatch.setattr(pcgtts.builtin, "with_builtin_models", lambda settings: settings)
    monkeypatch.setattr(Synthesizer, "load", classmethod(lambda cls, *args, **kwargs: loaded.update(kwargs)))
    Synthesizer.from_pretrained()
    assert loaded["scripts"] == BUILTIN_VOICE_SCRIPTS
    Synthesizer.from_pretrained(target="some/checkpoint")
    assert loaded["scripts"] is None


@pytest.mark.parametrize("scripts", ["Latin", (), ("Latin", 3), 5])
def test_scripts_must_be_a_tuple_of_names(scripts):
    with pytest.raises(TypeError, match="scripts must be a tuple of script names"):
        check_scripts(scripts)


@pytest.mark.parametrize("argv, scripts", [(["speak", "Hello."], BUILTIN_VOICE_SCRIPTS),
                                            (["speak", "Hello.", "--target", "some/checkpoint"], None)])
def test_the_command_line_gives_the_builtin_voice_its_scripts(monkeypatch, argv, scripts):
    import pcgtts.builtin
    from pcgtts.cli import build_parser
    from pcgtts.cli.commands import load_synthesizer

    loaded = {}
    monkeypatch.setattr(pcgtts.builtin, "with_builtin_models", lambda settings: settings)
    monkeypatch.setattr(Synthesizer, "load", classmethod(lambda cls, *args, **kwargs: loaded.update(kwargs)))
    load_synthesizer(build_parser().parse_args(argv))
    assert loaded["scripts"] == scripts


# -- voices named by a string --------------------------------------------------------------------

def test_the_voice_default_is_the_models_own_voice(synth):
    assert np.array_equal(synth.synthesize("Hello there.", voice="default", seed=3, max_new_tokens=30),
                          synth.synthesize("Hello there.", seed=3, max_new_tokens=30))


def test_a_voice_that_is_empty_a_folder_or_a_recording_is_refused_in_words(synth, tmp_path):
    sf.write(tmp_path / "me.wav", 0.3 * np.sin(np.arange(16000) / 5), 16000)
    (tmp_path / "me-without-suffix").write_bytes((tmp_path / "me.wav").read_bytes())
    with pytest.raises(ValueError, match="^an empty voice name"):
        synth.stream("Hello there.", voice="")
    with pytest.raises(ValueError, match=f"^{tmp_path} is a directory"):
        synth.stream("Hello there.", voice=str(tmp_path))
    for recording in ("me.wav", "me-without-suffix"):
        for voice in (str(tmp_path / recording), tmp_path / recording):
            with pytest.raises(ValueError, match=r"is an audio file: give the recording as ref_audio=.*voice_from_audio"):
                synth.stream("Hello there.", voice=voice)
    assert_no_work_started(synth)
