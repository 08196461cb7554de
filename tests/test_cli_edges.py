"""The command line's edges: numbers out of range, output formats, interruption, device messages.

Bad input is one line before any model loads; `--out` writes the format its suffix names; Ctrl-C
or SIGTERM stops cleanly (exit 130 / 143, one line, no traceback even while the process exits),
keeps what was made as `F.partial.wav` and leaves the existing `F.wav` and nothing else.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import soundfile as sf

from pcgtts.cli import main
from pcgtts.runtime.audio.chunk import SAMPLE_RATE, AudioChunk
from pcgtts.runtime.audio.io import writable_suffixes
from pcgtts.runtime.audio.playback import FileSink, NullSink

LOG_RECORD = re.compile(r"^(DEBUG|INFO|WARNING|ERROR) \S+: ")  # the CLI's log lines, not its own messages


def run_cli(argv, capsys) -> tuple[int, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    return code, capsys.readouterr().err.strip()


def model_flags(models, policy: str = "sd") -> list[str]:
    draft = ["--draft", str(models["draft"])] if policy != "ar" else []
    return ["--target", str(models["target"]), *draft, "--codec", str(models["codec"]), "--policy", policy]


# -- numbers out of range: one line, naming the flag, before any model loads ----------------------

HUGE = str(2**80)


@pytest.mark.parametrize("argv, flag, message", [
    (["speak", "hi", "--seed", HUGE], "--seed", "[0, 2**63 - 1]"),
    (["speak", "hi", "--seed", "-1"], "--seed", "[0, 2**63 - 1]"),
    (["speak", "hi", "--temperature", "10.5"], "--temperature", "[0, 10]"),
    (["speak", "hi", "--temperature", "nan"], "--temperature", "[0, 10]"),
    (["speak", "hi", "--top-p", "0"], "--top-p", "(0, 1]"),
    (["speak", "hi", "--top-p", "1.5"], "--top-p", "(0, 1]"),
    (["speak", "hi", "--max-tokens", "60001"], "--max-tokens", "[1, 60000]"),
    (["speak", "hi", "--max-tokens", "0"], "--max-tokens", "[1, 60000]"),
    (["speak", "hi", "--draft-length", "17"], "--draft-length", "[1, 16]"),
    (["speak", "hi", "--draft-length", "0"], "--draft-length", "[1, 16]"),
    (["speak", "hi", "--seed", "twelve"], "--seed", "invalid int value"),
    (["speak", "hi", "--threads", HUGE], "--threads", "CPU cores"),
    (["speak", "hi", "--threads", str((os.cpu_count() or 1) + 1)], "--threads", "CPU cores"),
    (["train", "draft", "distill", "--target", "t", "--draft", "d", "--out", "o",
      "--threads", "0"], "--threads", "CPU cores"),
    (["bench", "--seed", HUGE], "--seed", "[0, 2**63 - 1]"),
    (["bench", "--temperature", "-0.5"], "--temperature", "[0, 10]"),
    (["bench", "--max-tokens", "60001"], "--max-tokens", "[1, 60000]"),
    (["bench", "--draft-length", "3,17"], "--draft-length", "[1, 16]"),
    (["train", "draft", "distill", "--target", "t", "--draft", "d", "--out", "o",
      "--seed", HUGE], "--seed", "[0, 2**63 - 1]"),
    (["train", "draft", "distill", "--target", "t", "--draft", "d", "--out", "o",
      "--temperature", "11"], "--temperature",
     "[0, 10]"),
    (["models", "demo", "--out", "o", "--seed", HUGE], "--seed", "[0, 2**63 - 1]"),
    (["export", "tensorrt", "--onnx", "x", "--out", "y", "--draft-length", "17"], "--draft-length", "[1, 16]"),
    (["export", "onnx", "--model", "x", "--out", "y", "--max-length", "8"], "--max-length", ">= 64"),
])
def test_out_of_range_numbers_are_one_line_naming_the_flag_before_models_load(argv, flag, message, capsys,
                                                                               no_models):
    code, err = run_cli(argv, capsys)
    assert code == 2, err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and f"argument {flag}" in errors[0] and message in errors[0], err
    assert "Traceback" not in err and "Overflow" not in err, err


def test_the_range_ends_are_accepted():
    from pcgtts.cli import flags

    assert flags.seed(str(2**63 - 1)) == 2**63 - 1 and flags.seed("0") == 0
    assert flags.temperature("0") == 0.0 and flags.temperature("10") == 10.0
    assert flags.top_p("1") == 1.0 and flags.draft_length("16") == 16 and flags.max_tokens("60000") == 60000


def test_top_p_reaches_the_synthesis_settings(tmp_path, capsys, monkeypatch):
    from pcgtts.runtime import synthesizer
    from pcgtts.runtime.config import ModelPaths

    seen = {}
    # the settings are the point: the built-in voice's place stands in for making its demo models
    folder = str(tmp_path)
    monkeypatch.setattr("pcgtts.builtin.builtin_models", lambda: ModelPaths(target=folder, draft=folder, codec=folder))

    def record(cls, models, device, synthesis, **kwargs):
        seen["sampling"] = synthesis.decode.sampling
        raise RuntimeError("stopped after the settings were read")

    monkeypatch.setattr(synthesizer.Synthesizer, "load", classmethod(record))
    code, err = run_cli(["speak", "hi", "--top-p", "0.9", "--temperature", "0.5", "--out", tmp_path / "a.wav"], capsys)
    assert code == 2 and "stopped after the settings were read" in err, err
    assert seen["sampling"].top_p == 0.9 and seen["sampling"].temperature == 0.5


@pytest.mark.parametrize("flags, flag", [
    (["--policy", "ar", "--draft", "{tmp}"], "--draft"),
    (["--policy", "mtp-sd", "--draft", "{tmp}"], "--draft"),
    (["--policy", "sd", "--draft", "{tmp}", "--groups", "{tmp}/g.pcg"], "--groups"),
    (["--policy", "sd", "--draft", "{tmp}", "--heads", "{tmp}/h"], "--heads"),
    (["--policy", "mtp-sd", "--transitions", "{tmp}/t.pct"], "--transitions"),
    (["--policy", "pcg", "--draft", "{tmp}", "--eagle", "{tmp}/e"], "--eagle"),
    (["--policy", "ar", "--draft-length", "4"], "--draft-length"),
    (["--policy", "draft", "--draft", "{tmp}", "--no-adaptive-draft"], "--adaptive-draft"),
])
def test_a_flag_the_policy_would_ignore_is_refused_before_models_load(flags, flag, tmp_path, capsys, no_models):
    argv = ["speak", "hi", "--target", tmp_path, *[f.replace("{tmp}", str(tmp_path)) for f in flags],
            "--out", tmp_path / "a.wav"]
    code, err = run_cli(argv, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith(f"pcgtts: error: {flag}"), err
    assert "is not used by policy" in err, err


# -- --out writes the format its name says -------------------------------------------------------

FORMATS = {".wav": "WAV", ".flac": "FLAC", ".ogg": "OGG", ".mp3": "MP3"}


def suffix_param(suffix: str):
    mark = pytest.mark.skipif(suffix not in writable_suffixes(),
                              reason=f"this libsndfile cannot write {suffix}")
    return pytest.param(suffix, marks=mark, id=suffix)


def tone_chunks(seconds: float = 0.6, per_chunk: float = 0.2):
    n = int(per_chunk * SAMPLE_RATE)
    count = round(seconds / per_chunk)
    for i in range(count):
        t = np.arange(i * n, (i + 1) * n) / SAMPLE_RATE
        yield AudioChunk((0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), SAMPLE_RATE, i, i + 1, 0.0,
                         i == count - 1)


@pytest.mark.parametrize("suffix", [suffix_param(s) for s in FORMATS])
def test_the_file_sink_writes_the_format_its_suffix_names(suffix, tmp_path):
    path = tmp_path / f"speech{suffix.upper() if suffix == '.wav' else suffix}"
    with FileSink(path) as sink:
        for chunk in tone_chunks():
            sink.write(chunk)
    info = sf.info(str(path))
    assert info.format == FORMATS[suffix] and info.samplerate == SAMPLE_RATE and info.channels == 1
    assert abs(info.duration - 0.6) < 0.1  # lossy encoders may pad a frame
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_speak_out_mp3_writes_mp3(tiny_models, tmp_path, capsys):
    if ".mp3" not in writable_suffixes():
        pytest.skip("this libsndfile cannot write MP3")
    out = tmp_path / "hello.mp3"
    code, err = run_cli(["speak", "Hello there.", *model_flags(tiny_models, "ar"), "--max-tokens", "40",
                         "--out", out], capsys)
    assert code == 0, err
    assert sf.info(str(out)).format == "MP3" and sf.info(str(out)).duration > 0.3


@pytest.mark.parametrize("name", ["speech.aac", "speech.txt", "speech"])
def test_an_output_suffix_without_a_format_is_refused_before_models_load(name, tmp_path, capsys, no_models):
    out = tmp_path / name
    out.write_bytes(b"kept")
    code, err = run_cli(["speak", "hi", "--out", out], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "cannot write" in err and ".wav, .flac, .ogg" in err, err
    assert out.read_bytes() == b"kept" and [p.name for p in tmp_path.iterdir()] == [name]


# -- interruption: Ctrl-C and SIGTERM ------------------------------------------------------------

CLI = [sys.executable, "-c", "import sys; from pcgtts.cli import main; sys.exit(main())"]  # `pcgtts`, as installed
LONG_TEXT = " ".join(["This sentence is one of many that make a long text to read aloud."] * 30)


def temporary_output(folder):
    return [p for p in folder.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]


@pytest.mark.parametrize("signum, repeat", [
    pytest.param(signal.SIGINT, False, id="ctrl-c", marks=pytest.mark.slow),
    pytest.param(signal.SIGTERM, False, id="sigterm", marks=pytest.mark.slow),  # a whole CLI run and its signal
    pytest.param(signal.SIGINT, True, id="ctrl-c-held-down", marks=pytest.mark.slow),  # signals every 20 ms until the process is gone
])
def test_an_interrupted_speak_keeps_the_output_and_the_partial_and_exits_cleanly(tiny_models, tmp_path, signum,
                                                                                  repeat):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "speech.wav"
    sf.write(out, np.full(800, 0.25, np.float32), SAMPLE_RATE, subtype="PCM_16")
    before = out.read_bytes()
    process = subprocess.Popen([*CLI, "speak", LONG_TEXT, *model_flags(tiny_models),
                                "--seed", "1", "--out", str(out)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(p.stat().st_size > 64_000 for p in temporary_output(out_dir)):  # ~2 s of audio made
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no audio was written within 120 s"
            time.sleep(0.02)
        process.send_signal(signum)
        while repeat and process.poll() is None:
            time.sleep(0.02)
            try:
                process.send_signal(signum)
            except ProcessLookupError:
                break
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 128 + signum, err
    assert not any(word in err for word in ("Traceback", "Exception ignored", "KeyboardInterrupt")), err
    lines = [line for line in err.splitlines() if line.strip() and not LOG_RECORD.match(line)]
    assert len(lines) == 1 and lines[0].startswith("pcgtts: interrupted; kept the"), err
    assert "speech.partial.wav" in lines[0] and "speech.wav is as it was" in lines[0], err
    assert out.read_bytes() == before
    partial = out_dir / "speech.partial.wav"
    info = sf.info(str(partial))
    assert info.format == "WAV" and info.duration >= 1.5, info
    assert len(sf.read(str(partial))[0]) == info.frames
    assert sorted(p.name for p in out_dir.iterdir()) == ["speech.partial.wav", "speech.wav"]


def test_a_signal_raises_once_and_later_ones_are_ignored():
    from pcgtts.cli.interrupt import Interrupted, stop_on_signals

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(Interrupted) as stopped:
            with stop_on_signals():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1.0)  # the handler raises here
        assert stopped.value.exit_code == 143 and isinstance(stopped.value, KeyboardInterrupt)
        os.kill(os.getpid(), signal.SIGINT)  # during the shutdown that follows: ignored
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert all(signal.getsignal(s) is signal.SIG_IGN for s in saved)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def test_a_block_without_a_signal_puts_the_handlers_back():
    from pcgtts.cli.interrupt import stop_on_signals

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with stop_on_signals():
        assert signal.getsignal(signal.SIGTERM) is not saved[signal.SIGTERM]
    assert {s: signal.getsignal(s) for s in saved} == saved


def test_a_signal_ignored_by_the_caller_stays_ignored():
    """A shell starts a background job with SIGINT ignored: Ctrl-C at the terminal is not for it."""
    from pcgtts.cli.interrupt import stop_on_signals

    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with stop_on_signals():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, saved)


def test_an_interrupted_sink_stops_at_once_without_playing_out_its_buffer():
    sink = NullSink(realtime=True, prebuffer_seconds=0.0)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with sink:
            for chunk in tone_chunks(seconds=4.0, per_chunk=0.5):
                sink.write(chunk)
            raise KeyboardInterrupt
    assert time.monotonic() - started < 1.0


def test_an_interruption_before_any_audio_keeps_no_partial(tmp_path):
    out = tmp_path / "speech.flac"
    with pytest.raises(KeyboardInterrupt):
        with FileSink(out) as sink:
            raise KeyboardInterrupt
    assert sink.kept is None and list(tmp_path.iterdir()) == []


def test_an_interrupted_flac_keeps_a_flac_partial(tmp_path):
    out = tmp_path / "speech.flac"
    with pytest.raises(KeyboardInterrupt):
        with FileSink(out) as sink:
            for chunk in tone_chunks():
                sink.write(chunk)
            raise KeyboardInterrupt
    assert sink.kept == tmp_path / "speech.partial.flac" and sf.info(str(sink.kept)).format == "FLAC"
    assert [p.name for p in tmp_path.iterdir()] == ["speech.partial.flac"]


# -- messages name the flags that exist -----------------------------------------------------------

@pytest.mark.parametrize("error", [OSError("PortAudio library not found"), ImportError("no sounddevice")])
def test_playback_errors_name_the_audio_device_flag(error, monkeypatch, capsys):
    import builtins

    from pcgtts.runtime.audio import playback

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "sounddevice":
            raise error
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(RuntimeError) as raised:
        playback.list_output_devices()
    message = str(raised.value)
    assert "--audio-device null" in message and "--device null" not in message.replace("--audio-device", "")
    with pytest.raises(SystemExit):
        main(["speak", "--help"])
    assert "--audio-device" in capsys.readouterr().out


def test_no_message_suggests_the_deprecated_device_flag():
    from pathlib import Path

    import pcgtts.cli
    import pcgtts.runtime.audio

    folders = [Path(pcgtts.cli.__file__).parent, Path(pcgtts.runtime.audio.__file__).parent]
    for path in (p for folder in folders for p in folder.glob("*.py")):
        text = path.read_text()
        assert not re.search(r"(?<![\w-])--device null", text), path


@pytest.mark.slow  # an end-to-end run in subprocesses: the slow step of CI
def test_a_reader_that_stops_reading_ends_speak_quietly_with_its_file_written(tiny_models, tmp_path):
    out = tmp_path / "speech.wav"
    read, write = os.pipe()
    os.close(read)  # nobody reads standard output: the JSON line meets a broken pipe
    try:
        process = subprocess.run([*CLI, "speak", "Hello there.", *model_flags(tiny_models), "--seed", "1",
                                  "--out", str(out)], stdout=write, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write)
    assert process.returncode == 141, process.stderr
    assert "Broken pipe" not in process.stderr and "Traceback" not in process.stderr, process.stderr
    assert sf.info(str(out)).duration > 0


# -- --voice -------------------------------------------------------------------------------------

def test_speak_voice_default_is_the_models_own_voice(tiny_models, tmp_path, capsys):
    out = tmp_path / "default.wav"
    code, err = run_cli(["speak", "Hello there.", *model_flags(tiny_models, "ar"), "--max-tokens", "30",
                         "--voice", "default", "--out", out], capsys)
    assert code == 0, err
    assert sf.info(str(out)).duration > 0.3


@pytest.mark.parametrize("voice, message", [
    ("", "an empty voice name"),
    ("{tmp}", "{tmp} is a directory"),
    ("{tmp}/me.wav", "{tmp}/me.wav is an audio file: use --ref-audio and --ref-text"),
    ("{tmp}/me.flac", "{tmp}/me.flac is an audio file: use --ref-audio and --ref-text"),
])
def test_a_voice_that_is_empty_a_folder_or_a_recording_is_one_line_before_models_load(voice, message, tmp_path,
                                                                                      capsys, no_models):
    tone = 0.3 * np.sin(np.arange(16000) / 5)
    sf.write(tmp_path / "me.wav", tone, SAMPLE_RATE)
    sf.write(tmp_path / "me.flac", tone, SAMPLE_RATE)
    code, err = run_cli(["speak", "hi", "--voice", voice.format(tmp=tmp_path)], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert message.format(tmp=tmp_path) in err, err


# -- where the text comes from -------------------------------------------------------------------

def test_python_dash_m_pcgtts_cli_runs_the_command():
    result = subprocess.run([sys.executable, "-m", "pcgtts.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: pcgtts") and "speak" in result.stdout


@pytest.mark.parametrize("source", ["stdin", "file"])
def test_speak_reads_its_text_from_standard_input_or_a_file(source, tiny_models, tmp_path, capsys, monkeypatch):
    import io

    text = "Hello there."
    if source == "stdin":
        monkeypatch.setattr(sys, "stdin", io.StringIO(text))
        given = ["-"]
    else:
        (tmp_path / "text.txt").write_text(text, encoding="utf-8")
        given = ["--text-file", tmp_path / "text.txt"]
    out = tmp_path / "out.wav"
    code, err = run_cli(["speak", *given, *model_flags(tiny_models, "ar"), "--max-tokens", "30", "--out", out], capsys)
    assert code == 0, err
    assert sf.info(str(out)).duration > 0.3


@pytest.mark.parametrize("argv, message", [
    (["speak"], "give the text to speak as an argument"),
    (["speak", "hi", "--text-file", "{tmp}/text.txt"], "give the text to speak as an argument"),
    (["speak", "--text-file", "{tmp}/missing.txt"], "--text-file {tmp}/missing.txt: file not found"),
    (["speak", "--text-file", "{tmp}/latin1.txt"], "--text-file {tmp}/latin1.txt: not UTF-8 text"),
    (["speak", "--text-file", "{tmp}"], "--text-file {tmp} is a directory"),
])
def test_speak_without_one_readable_text_is_one_line_before_models_load(argv, message, tmp_path, capsys, no_models):
    (tmp_path / "text.txt").write_text("Hello.")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    code, err = run_cli([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert message.replace("{tmp}", str(tmp_path)) in err, err


def test_the_report_of_a_plain_decode_says_so_instead_of_an_acceptance_of_zero(tiny_models, tmp_path, capsys):
    code = main(["speak", "Hello there.", *model_flags(tiny_models, "ar"), "--max-tokens", "30",
                 "--out", str(tmp_path / "plain.wav")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert report["acceptance_rate"] is None and report["tokens"] > 0
    row = next(line for line in captured.err.splitlines() if "acceptance_rate" in line)
    assert "plain decoding" in row and "0.000" not in row


# -- a config file's bad values: the file and the setting named ----------------------------------

@pytest.mark.parametrize("toml, message", [
    ('[decode]\ndraft_length = "x"\n', "[decode] draft_length: expected an integer, got 'x'"),
    ('threads = "x"\n', "[device] threads: expected an integer, got 'x'"),
    ('max_length = "x"\n', "[device] max_length: expected an integer, got 'x'"),
    ("compute_device = 5\n", "[device] compute_device: expected a string, got 5"),
    ('[stream]\nchunk_tokens = "x"\n', "[stream] chunk_tokens: expected an integer, got 'x'"),
    ("compile = 1\n", "[device] compile: expected true or false, got 1"),
    ("[decode]\ndraft_length = 40\n", "[decode] draft_length must lie in [1, 16], got 40"),
])
def test_a_bad_config_value_names_the_file_and_the_setting_before_models_load(toml, message, tmp_path, capsys,
                                                                             no_models):
    (tmp_path / "pcgtts.toml").write_text(toml)
    code, err = run_cli(["speak", "hi", "--config", tmp_path / "pcgtts.toml", "--out", tmp_path / "a.wav"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"{tmp_path / 'pcgtts.toml'}: {message}" in err, err


def test_a_config_value_a_flag_overrides_is_not_blamed(tmp_path):
    from pcgtts.runtime.config import resolve_settings

    (tmp_path / "pcgtts.toml").write_text("[decode]\ndraft_length = 4\n")
    with pytest.raises(ValueError, match="^draft_length must lie in") as refused:
        resolve_settings({"draft_length": 40}, tmp_path / "pcgtts.toml")
    assert "pcgtts.toml" not in str(refused.value)


# -- --out naming a device or a FIFO: written into, never replaced -------------------------------

def test_a_fifo_out_is_written_into_not_replaced(tmp_path):
    import io
    import stat
    import threading

    fifo = tmp_path / "speech.wav"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    with FileSink(fifo) as sink:
        for chunk in tone_chunks():
            sink.write(chunk)
    reader.join(10)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and [p.name for p in tmp_path.iterdir()] == ["speech.wav"]
    audio, rate = sf.read(io.BytesIO(received[0]))
    assert rate == SAMPLE_RATE and abs(len(audio) / rate - 0.6) < 0.05


def test_speak_out_dev_null_writes_into_it(tiny_models, tmp_path, capsys):
    import stat

    before = os.stat("/dev/null")
    code, err = run_cli(["speak", "Hello there.", *model_flags(tiny_models, "ar"), "--max-tokens", "30",
                         "--out", "/dev/null"], capsys)
    assert code == 0, err
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
    assert not [p for p in os.listdir("/dev") if p.startswith(".null.")]


# -- what a newcomer sees ------------------------------------------------------------------------

def test_loading_the_codec_with_its_encoder_shows_no_progress_bar(demo_codec_dir, capfd):
    from transformers.utils import logging as hf_logging

    from pcgtts.runtime.audio.codec import Codec

    capfd.readouterr()
    Codec.from_pretrained(demo_codec_dir, decode_only=False)
    captured = capfd.readouterr()
    assert "Loading weights" not in captured.err and "it/s" not in captured.err, captured.err
    assert hf_logging.is_progress_bar_enabled()  # put back for whoever loads next
