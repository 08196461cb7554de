"""What `pcgtts` shows on the command line: WARNING and up by default (then the progress bars and the
result table), INFO with -v, and none of the exporter's libraries' own output while models are prepared.

The commands run as real subprocesses (the logging a user sees is set up by the entry point, once per
process) on the tiny models; the first-run preparation runs in a fresh cache."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

CLI = "import sys; from pcgtts.cli import main; sys.exit(main())"
# The CLI with the demo as the built-in voice, its models given as JSON in the first argument (as
# tests/conftest.py's builtin_is_the_demo does in-process): the first run's preparation at tiny size.
CLI_ON_DEMO = ("import json, sys; from pathlib import Path; import pcgtts.builtin as builtin, pcgtts.tools.demo as demo; "
               "builtin.VOICE_DIR = Path('/nonexistent/pcgtts-voice'); paths = json.loads(sys.argv.pop(1)); "
               "demo.ensure_demo = lambda: {name: Path(path) for name, path in paths.items()}; "
               "from pcgtts.cli import main; sys.exit(main())")
# What the exporter's libraries say when their output escapes: log lines of theirs, Python warnings,
# torch's own log format ("W1128 22:02:50.69 ...").
THIRD_PARTY = re.compile(r"torchvision|onnx_ir|onnxscript|Attribute type|Warning|^[WIE]\d{4} ", re.MULTILINE)
LOG_LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR) (\S+): .*$", re.MULTILINE)


def run(code: str, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-c", code, *map(str, argv)], capture_output=True, text=True,
                            timeout=600, env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def log_lines(stderr: str, level: str) -> list[str]:
    return [match.group(0) for match in LOG_LINE.finditer(stderr) if match.group(1) == level]


def speak_flags(models: dict, groups: Path, out: Path) -> list[str]:
    return ["--target", models["target"], "--draft", models["draft"], "--codec", models["codec"],
            "--groups", groups, "--out", out]


@pytest.mark.slow  # an end-to-end run in subprocesses: the slow step of CI
def test_speak_shows_no_info_lines_by_default_and_shows_them_with_verbose(tiny_models, tiny_groups_file, tmp_path):
    flags = speak_flags(tiny_models, tiny_groups_file, tmp_path / "speech.wav")
    quiet = run(CLI, "speak", "Hello world.", *flags)
    assert not log_lines(quiet.stderr, "INFO") and not log_lines(quiet.stderr, "DEBUG"), quiet.stderr
    assert not THIRD_PARTY.search(quiet.stderr), quiet.stderr
    assert "real_time_factor" in quiet.stderr  # the result table
    assert json.loads(quiet.stdout.splitlines()[-1])["audio_s"] > 0 and (tmp_path / "speech.wav").is_file()

    verbose = run(CLI, "speak", "Hello world.", *flags, "-v")  # the flag may follow the command's own
    info = log_lines(verbose.stderr, "INFO")
    assert any("pcgtts.runtime.decode.calibrate" in line for line in info), verbose.stderr
    assert all(" pcgtts." in line for line in info), info  # -v: pcgtts's INFO, not every library's


def test_log_level_flags_before_or_after_the_command_and_one_at_a_time(capsys):
    from pcgtts.cli import log_level, parse_args

    assert log_level(parse_args(["speak", "hi"])) == logging.WARNING
    assert log_level(parse_args(["-v", "speak", "hi"])) == logging.INFO
    assert log_level(parse_args(["speak", "hi", "-vv"])) == logging.DEBUG
    assert log_level(parse_args(["speak", "hi", "--log-level", "error"])) == logging.ERROR
    assert log_level(parse_args(["--debug", "speak", "hi"])) == logging.DEBUG
    assert log_level(parse_args(["serve"])) == logging.INFO  # its INFO lines say where it serves
    for argv in (["-v", "speak", "hi", "--log-level", "INFO"], ["speak", "hi", "--debug", "-v"],
                 ["speak", "hi", "--no-such-flag"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert "error:" in capsys.readouterr().err


def _demo_voice(tiny_models, tiny_groups_file, folder: Path) -> dict:
    """The tiny models copied where the built-in voice's exports are made (beside its target)."""
    voice = {name: shutil.copytree(tiny_models[name], folder / name) for name in ("target", "draft")}
    return {**voice, "codec": tiny_models["codec"], "groups": tiny_groups_file}


@pytest.mark.slow  # ~30 s of exports; the fast suite keeps the held-back unit tests below
def test_first_run_preparation_shows_no_output_of_other_libraries(tiny_models, tiny_groups_file, tmp_path):
    """The built-in voice's first use exports its target, draft and codec for onnxruntime: by default
    stderr says so in pcgtts's own lines only (no torch.onnx / onnx_ir / Python warnings, no count of
    hidden ones, since all of them are known to be harmless, and no claim that the export went unchecked
    while its check runs); -v shows what was held back."""
    from pcgtts.builtin import ONNX_FOLDER

    voice = _demo_voice(tiny_models, tiny_groups_file, tmp_path / "voice")
    paths = json.dumps({name: str(path) for name, path in voice.items()})
    env = {"PCGTTS_CACHE": str(tmp_path / "cache")}
    first = run(CLI_ON_DEMO, paths, "speak", "Hello world.", "--out", tmp_path / "a.wav", env=env)
    exports = tmp_path / "voice" / ONNX_FOLDER
    assert all((exports / name).is_dir() for name in ("target", "draft", "codec")), first.stderr
    assert not THIRD_PARTY.search(first.stderr), first.stderr
    assert "without a numeric check" not in first.stderr and "hidden" not in first.stderr, first.stderr
    assert all(match.group(2).startswith("pcgtts.") for match in LOG_LINE.finditer(first.stderr)), first.stderr
    assert not log_lines(first.stderr, "INFO")

    shutil.rmtree(exports / "codec")  # made again, now with -v
    again = run(CLI_ON_DEMO, paths, "-v", "speak", "Hello world.", "--out", tmp_path / "b.wav", env=env)
    held = [line for line in log_lines(again.stderr, "INFO") if "from another library" in line]
    assert held and all(line.startswith("INFO pcgtts.export.noise: ") for line in held), again.stderr
    assert "Skipping torchvision" in again.stderr


@pytest.mark.slow  # two exports: the slow step of CI
def test_an_unchecked_export_says_so_when_loaded_not_while_it_is_made(tiny_lms, tmp_path, caplog):
    """The staged graph an export reads back (to quantize it, or to check it) is not reported unchecked;
    an export made without a check is, wherever it is loaded."""
    from pcgtts.export.onnx_lm import export_lm
    from pcgtts.runtime.lm.onnxruntime import OrtLM

    caplog.set_level(logging.WARNING)
    export_lm(tiny_lms["draft"], tmp_path / "draft", check=False, quantize="int8")
    assert "without a numeric check" not in caplog.text, caplog.text
    OrtLM.load(tmp_path / "draft")
    assert f"{tmp_path / 'draft'} was exported without a numeric check" in caplog.text


@pytest.mark.slow
@pytest.mark.shipped_voice
def test_the_shipped_voice_first_run_shows_no_output_of_other_libraries(tmp_path):
    """The real built-in voice in a fresh cache: expanded (transformers writes its checkpoints, a group
    table is built) and exported for onnxruntime, with pcgtts's own lines and bars only."""
    from pcgtts.builtin import VOICE_DIR

    if not (VOICE_DIR / "voice.json").is_file():
        pytest.skip("no trained voice is committed in pcgtts/voice")
    first = run(CLI, "speak", "Hello world.", "--out", tmp_path / "a.wav", env={"PCGTTS_CACHE": str(tmp_path)})
    assert not THIRD_PARTY.search(first.stderr) and "Writing model shards" not in first.stderr, first.stderr
    assert "without a numeric check" not in first.stderr and "hidden" not in first.stderr, first.stderr
    assert all(match.group(2).startswith("pcgtts.") for match in LOG_LINE.finditer(first.stderr)), first.stderr
    assert "real_time_factor" in first.stderr and (tmp_path / "a.wav").is_file()


# -- export/noise.py: what is held back and how it is reported -------------------------------------------

def _noisy_library_work(lines: int = 1) -> None:
    """What an exporter's library does: logs warnings (torch's style: its own handler), warns, prints."""
    for _ in range(lines):
        logging.getLogger("onnx_ir._convenience").warning("Attribute type is ambiguous because it is an empty "
                                                          "sequence. Defaulted to INTS")
    logging.getLogger("torch.onnx._internal.exporter").warning("something new went wrong")
    logging.getLogger("onnxscript.optimizer").info("rewrote node 17")  # chatter: not even recorded
    warnings.warn("a deprecated call", FutureWarning, stacklevel=1)
    print("[torch.onnx] progress chatter")


def test_held_back_output_is_one_warning_by_default_and_each_line_at_info(capfd, caplog):
    from pcgtts.export.noise import held_back

    caplog.set_level(logging.WARNING)
    with held_back("export"):
        _noisy_library_work(lines=3)
    out, err = capfd.readouterr()
    assert "chatter" not in out and "went wrong" not in err and "Attribute" not in err
    summary = [r.getMessage() for r in caplog.records]
    # three unknown lines counted (the warning, the Python warning, the print); onnx_ir's is known harmless
    assert summary == ["export: 3 warnings from other libraries hidden (shown at log level INFO: pcgtts -v)"]

    caplog.clear()
    caplog.set_level(logging.INFO)
    with held_back("export"):
        _noisy_library_work(lines=3)
    shown = [r.getMessage() for r in caplog.records if r.name == "pcgtts.export.noise"]
    assert not any("hidden" in line for line in shown)
    assert any("went wrong" in line for line in shown) and any("progress chatter" in line for line in shown)
    assert any("Attribute type is ambiguous" in line and "(3 times)" in line for line in shown)
    assert not any("rewrote node" in line for line in shown)


def test_held_back_work_inside_held_back_work_is_reported_once(caplog):
    from pcgtts.export.noise import held_back

    torch_onnx = logging.getLogger("torch.onnx")
    handlers, propagate = list(torch_onnx.handlers), torch_onnx.propagate
    caplog.set_level(logging.WARNING)
    with held_back("preparation"):
        for _ in range(2):
            with held_back("export"):
                _noisy_library_work()
    # each inner block's two lines (onnx_ir's is harmless) and print; the Python warning once per place
    assert [r.getMessage() for r in caplog.records] == [
        "preparation: 5 warnings from other libraries hidden (shown at log level INFO: pcgtts -v)"]
    assert torch_onnx.handlers == handlers and torch_onnx.propagate == propagate  # given back unchanged
