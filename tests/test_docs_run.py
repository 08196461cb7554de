"""The documentation's Python and the example scripts run as written.

Every ```python block of README.md and of docs/**/*.md, and every script in examples/, runs here on
the tiny test models standing in for the built-in voice (random weights, the same plumbing), in a
fresh working directory that holds the files the documents may name:

    speaker.wav    a few seconds of real speech (flite), whose transcript is SPEAKER_TEXT below

Blocks run in-process, each in a fresh namespace; example scripts through `runpy` with their
documented command line. A block that cannot run here (it needs a GPU, a server or a network peer)
opts out with `<!-- no-run: the reason -->` on the line before its fence; an opt-out without a reason
fails. One test per block, named by its file and line, so a failure says which snippet broke.
"""

from __future__ import annotations

import re
import runpy
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]
SPEAKER_TEXT = "The quick brown fox jumps over the lazy dog."
FENCE = re.compile(r"^```(\w*)\s*$")
NO_RUN = re.compile(r"^<!--\s*no-run:(.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # where the fence opens, 1-based
    code: str
    skip_reason: str | None  # None: the block runs

    @property
    def name(self) -> str:
        first = next((ln.strip() for ln in self.code.splitlines() if ln.strip()), "")
        return f"{self.path.relative_to(ROOT)}:{self.line}: {first[:40]}"


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of one Markdown file, with the opt-out reason of each (None: it runs)."""
    blocks, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start, end = i, i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if match.group(1) == "python":
            opt_out = NO_RUN.match(lines[start - 1].strip()) if start else None
            blocks.append(Block(path, start + 1, "\n".join(lines[start + 1:end]) + "\n",
                                opt_out.group(1).strip() if opt_out else None))
        i = end + 1
    return blocks


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


ALL_BLOCKS = [block for path in documents() if path.is_file() for block in python_blocks(path)]


@pytest.fixture
def tiny_builtin(monkeypatch, tiny_models, tiny_groups_file):
    """The built-in voice is the tiny pair: the fast suite's stand-in, the same code paths in seconds. Its
    1,024 speech tokens cannot hold a reference's codes, so what encodes `speaker.wav` runs on the demo
    (the conftest default, 65,536 tokens) in the slow suite."""
    from pcgtts.runtime.config import ModelPaths

    tiny = ModelPaths(**{k: str(v) for k, v in tiny_models.items()}, groups=str(tiny_groups_file))
    monkeypatch.setattr("pcgtts.builtin.builtin_models", lambda: tiny)


def encodes_a_reference(code_or_argv) -> bool:
    return "speaker.wav" in str(code_or_argv)


def on_models(value, encodes: bool):
    """A test parameter, marked slow when it encodes a reference (the demo models, not the tiny pair)."""
    return pytest.param(value, marks=pytest.mark.slow) if encodes else value


@pytest.fixture
def workdir(tmp_path, monkeypatch, request):
    """A working directory with `speaker.wav` in it, as the documents assume."""
    if "slow" not in request.keywords:
        request.getfixturevalue("tiny_builtin")
    if shutil.which("flite") is None:
        pytest.skip("flite is not installed (apt-get install flite)")
    subprocess.run(["flite", "-t", SPEAKER_TEXT, "-o", str(tmp_path / "speaker.wav")], check=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_python_blocks_are_found_in_the_documents():
    assert ALL_BLOCKS, "no ```python block in README.md or docs/"


@pytest.mark.parametrize("block", [on_models(b, encodes_a_reference(b.code)) for b in ALL_BLOCKS],
                         ids=lambda b: b.name)
def test_a_python_block_of_the_documents_runs_as_written(block, workdir):
    if block.skip_reason is not None:
        assert block.skip_reason, f"{block.name}: a no-run opt-out must say why"
        pytest.skip(block.skip_reason)
    exec(compile(block.code, block.name, "exec"), {"__name__": "__main__"})


def run_example(name: str, *argv: str, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [f"examples/{name}", *argv])
    runpy.run_path(str(ROOT / "examples" / name), run_name="__main__")


EXAMPLE_RUNS = {
    "save_wav.py": ["A short sentence to save.", "out.wav"],
    "clone_voice.py": ["speaker.wav", SPEAKER_TEXT, "Text in that voice.", "clone_out.wav"],
    "stream_to_speaker.py": ["Hello there.", "--audio-device", "null"],
}


def test_every_example_has_a_run():
    assert sorted(p.name for p in (ROOT / "examples").glob("*.py")) == sorted(EXAMPLE_RUNS)


@pytest.mark.parametrize("name", [on_models(n, encodes_a_reference(EXAMPLE_RUNS[n])) for n in sorted(EXAMPLE_RUNS)])
def test_an_example_runs_as_its_docstring_says(name, workdir, monkeypatch, capsys):
    run_example(name, *EXAMPLE_RUNS[name], monkeypatch=monkeypatch)
    out = capsys.readouterr().out
    assert out.strip(), f"{name} printed nothing"
    for written in [a for a in EXAMPLE_RUNS[name] if a.endswith(".wav") and a != "speaker.wav"]:
        assert sf.info(str(workdir / written)).duration > 0


@pytest.mark.parametrize("name", ["save_wav.py", "clone_voice.py"])
def test_an_example_given_too_few_arguments_says_its_usage_in_one_line(name, workdir, monkeypatch):
    with pytest.raises(SystemExit) as stop:
        run_example(name, "only one", monkeypatch=monkeypatch)
    message = str(stop.value.code)
    assert message.startswith("usage: python examples/") and "\n" not in message


@pytest.mark.slow
def test_the_clone_example_keys_its_voice_by_the_reference_not_by_the_output(workdir, monkeypatch, capsys):
    data, rate = sf.read("speaker.wav")
    sf.write("other.wav", np.concatenate([np.zeros(rate // 2), data[::-1]]), rate)  # another recording
    run_example("clone_voice.py", "speaker.wav", SPEAKER_TEXT, "Once.", "clone_out.wav", monkeypatch=monkeypatch)
    run_example("clone_voice.py", "other.wav", "Another reference.", "Twice.", "clone_out.wav", monkeypatch=monkeypatch)
    voices = sorted(workdir.glob("clone_out.*.voice"))
    assert len(voices) == 2, voices  # one per reference: the second run did not reuse the first voice
    run_example("clone_voice.py", "speaker.wav", SPEAKER_TEXT, "Again.", "clone_out.wav", monkeypatch=monkeypatch)
    assert sorted(workdir.glob("clone_out.*.voice")) == voices  # the same reference reuses its voice
    assert "in the voice of speaker.wav" in capsys.readouterr().out
