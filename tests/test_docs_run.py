"""The documentation's Python and the example scripts run as written.

What runs:
- every ```python (or ```py) block of README.md, of docs/**/*.md and of the files the docs pages
  include (`--8<-- "FILE"`), in-process, each in a fresh namespace (a block must not rely on an
  earlier one: readers copy one block);
- every command line an example script's docstring shows (`python examples/NAME.py ...`), in-process
  through `runpy` with that command line as `sys.argv`.

One test per block, named by its file, the line of its fence and its first line
(`README.md:57: import soundfile as sf`), so a failure says which snippet broke.

Where it runs: a fresh working directory holding the files the documents may name:

    speaker.wav    about three seconds of real speech (flite's voice) saying SPEAKER_TEXT
    speaker.txt    SPEAKER_TEXT, "The quick brown fox jumps over the lazy dog."

Anything else a block reads it must make itself; what it writes stays in that directory. The built-in
voice is the `cloning_models` pair of tests/conftest.py (random weights, the released 65,536-code
speech vocabulary at tiny width) with the shipped voice's preset voice files, so a block runs in seconds through the same code as the real voice,
reference recordings included; its own settings (what a voice.json may set) cap a sentence at 60
tokens, since random weights never say the stop token. Audio playback needs no sound card: a block should write files; an
example that plays on the default device runs only where an output device exists.

Opting out: a block that cannot run here (it needs a GPU, a running server, a network peer) carries
`<!-- no-run: the reason -->` on the line just before its opening fence. A marker without a reason fails.
"""

from __future__ import annotations

import ast
import hashlib
import re
import runpy
import shlex
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
PYTHON_INFO = {"python", "py", "python3"}
OPENING = re.compile(r"^(?P<indent> {0,12})(?P<fence>`{3,}|~{3,})\s*\{?\.?(?P<lang>[\w+-]*)[^`]*$")
NO_RUN = re.compile(r"^\s*<!--\s*no-run\b(?P<rest>.*?)-->\s*$")  # the reason follows a colon
SNIPPET = re.compile(r'^\s*-{2}8<-{2}\s+"(?P<path>[^":]+)"\s*$')  # pymdownx.snippets, base_path "."
EXAMPLE_COMMAND = re.compile(r"^\s*python examples/(?P<name>[\w-]+\.py)(?P<args>.*)$")
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3")
# The stand-in voice's own settings (as a voice.json may hold): random weights never say the stop
# token, so each sentence would run to its budget; 60 tokens (1.2 s of audio) keep every block quick.
STAND_IN_VOICE_SETTINGS = {"max_new_tokens": 60}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # the opening fence's line, 1-based
    code: str
    skip_reason: str | None  # None: the block runs; "" : an opt-out that gives no reason

    @property
    def name(self) -> str:
        first = next((ln.strip() for ln in self.code.splitlines() if ln.strip()), "")
        where = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path.name
        return f"{where}:{self.line}: {first[:50]}"


def closes(line: str, fence: str) -> bool:
    """Whether `line` closes a block opened by `fence` (same character, at least as long, nothing after)."""
    stripped = line.strip()
    return stripped.startswith(fence) and set(stripped) == {fence[0]}


def opt_out_reason(rest: str) -> str:
    """The reason of a no-run marker ("" when it gives none, or not after a colon)."""
    return rest.strip()[1:].strip() if rest.strip().startswith(":") else ""


def python_blocks(path: Path) -> list[Block]:
    """The Python blocks of one Markdown file, each with its opt-out reason (None: it runs)."""
    blocks, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        opening = OPENING.match(lines[i])
        if not opening:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not closes(lines[end], opening["fence"]):
            end += 1
        if opening["lang"].lower() in PYTHON_INFO:
            indent = len(opening["indent"])
            code = "\n".join(ln[indent:] if ln.startswith(" " * indent) else ln.lstrip() for ln in lines[i + 1:end])
            marker = NO_RUN.match(lines[i - 1]) if i else None
            blocks.append(Block(path, i + 1, code + "\n", opt_out_reason(marker["rest"]) if marker else None))
        i = end + 1
    return blocks


def documents() -> list[Path]:
    """README.md, the docs pages and the files those pages include, each once."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    included = [ROOT / m["path"] for page in pages[1:] for line in page.read_text().splitlines()
                if (m := SNIPPET.match(line))]
    return [path for path in dict.fromkeys(pages + included) if path.is_file()]


def run_block(block: Block) -> None:
    """Run a block as a reader would paste it into a fresh interpreter."""
    exec(compile(block.code, block.name, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})


ALL_BLOCKS = [block for path in documents() for block in python_blocks(path)]


# --- the working directory the documents assume ----------------------------------------------------

@pytest.fixture(scope="session")
def speaker_recording(tmp_path_factory) -> Path:
    """speaker.wav: flite saying SPEAKER_TEXT (real speech, about three seconds)."""
    if shutil.which("flite") is None:
        pytest.skip("flite is not installed (apt-get install flite; .ci/run installs it)")
    path = tmp_path_factory.mktemp("speaker") / "speaker.wav"
    subprocess.run(["flite", "-t", SPEAKER_TEXT, "-o", str(path)], check=True)
    return path


@pytest.fixture(scope="session")
def stand_in_tokenizer(cloning_models):
    """The stand-in voice's tokenizer, read once: 65,536 added speech tokens take transformers seconds
    to load, and every block loads the voice afresh."""
    from pcgtts.runtime.lm.checkpoint import load_tokenizer

    return load_tokenizer(cloning_models["target"])


@pytest.fixture
def workdir(tmp_path, monkeypatch, speaker_recording, cloning_models, stand_in_tokenizer):
    """A fresh working directory holding speaker.wav and speaker.txt; the built-in voice is `cloning_models`
    (tests/conftest.py has it be the demo; here the demo is that small pair)."""
    from pcgtts.runtime.lm import torch_lm

    stand_in = {Path(cloning_models[name]).resolve() for name in ("target", "draft")}
    read = torch_lm.load_tokenizer
    monkeypatch.setattr(torch_lm, "load_tokenizer",
                        lambda folder: stand_in_tokenizer if Path(folder).resolve() in stand_in else read(folder))
    presets = ROOT / "pcgtts" / "voice" / "voices"  # the shipped presets' files: codes the stand-in can read
    stand_in_models = {**cloning_models, **({"presets": str(presets)} if (presets / "voices.json").is_file() else {})}
    monkeypatch.setattr("pcgtts.tools.demo.ensure_demo", lambda *args, **kwargs: dict(stand_in_models))
    monkeypatch.setattr("pcgtts.builtin.voice_settings", lambda *args: dict(STAND_IN_VOICE_SETTINGS))
    shutil.copy(speaker_recording, tmp_path / "speaker.wav")
    (tmp_path / "speaker.txt").write_text(SPEAKER_TEXT + "\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --- the documents' blocks ------------------------------------------------------------------------

def test_python_blocks_are_found_in_the_documents():
    assert ALL_BLOCKS, "no ```python block in README.md or docs/"
    assert any(block.path.name == "README.md" for block in ALL_BLOCKS), "README.md has no ```python block"


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=lambda block: block.name)
def test_a_python_block_of_the_documents_runs_as_written(block, workdir):
    if block.skip_reason is not None:
        assert block.skip_reason, f"{block.name}: an opt-out says why the block cannot run: <!-- no-run: the reason -->"
        pytest.skip(block.skip_reason)
    run_block(block)


def write_markdown(tmp_path, text: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(text)
    return path


def test_a_block_that_calls_an_undefined_name_fails(tmp_path):
    """The defect these tests exist for: a snippet that uses a name it never defines or imports."""
    page = write_markdown(tmp_path, "Play it:\n\n```python\nfor chunk in [1, 2]:\n    play(chunk)\n```\n")
    (block,) = python_blocks(page)
    with pytest.raises(NameError, match="'play' is not defined"):
        run_block(block)


def test_an_opt_out_needs_a_reason_and_sits_right_before_the_fence(tmp_path):
    page = write_markdown(tmp_path, "\n".join([
        "<!-- no-run: needs a running pcgtts serve -->", "```python", "a = 1", "```",
        "<!-- no-run: -->", "```python", "b = 1", "```",
        "<!-- no-run -->", "```python", "c = 1", "```",
        "<!-- no-run because it says so -->", "```python", "e = 1", "```",
        "<!-- no-run: too far from its fence -->", "", "```python", "d = 1", "```", ""]))
    reasons = [block.skip_reason for block in python_blocks(page)]
    assert reasons == ["needs a running pcgtts serve", "", "", "", None]  # "" fails the test above


def test_blocks_are_read_from_every_fence_form_the_docs_site_renders(tmp_path):
    """Longer fences, tildes, attributes after the language, blocks indented in a list, other languages."""
    page = write_markdown(tmp_path, "\n".join([
        "````python", "a = 1", "```", "still a", "````",
        '~~~py title="x.py"', "b = 1", "~~~",
        "1. A step:", "", "    ```python", "    c = 1", "        indented", "    ```",
        "```bash", "echo not python", "```",
        "```python", "d = 1", "```", ""]))
    codes = [block.code for block in python_blocks(page)]
    assert codes == ["a = 1\n```\nstill a\n", "b = 1\n", "c = 1\n    indented\n", "d = 1\n"]


def test_the_documents_include_the_files_docs_pages_pull_in():
    includes = {ROOT / m["path"] for page in (ROOT / "docs").rglob("*.md") for line in page.read_text().splitlines()
                if (m := SNIPPET.match(line))}
    assert includes <= set(documents())


# --- the example scripts --------------------------------------------------------------------------

EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
PLAY_ON_THE_DEFAULT_DEVICE = {"stream_to_speaker.py"}  # unless given --audio-device


def documented_commands(name: str) -> list[list[str]]:
    """The command lines (argv after the script) that an example's docstring shows."""
    doc = ast.get_docstring(ast.parse((ROOT / "examples" / name).read_text())) or ""
    return [shlex.split(m["args"]) for line in doc.splitlines()
            if (m := EXAMPLE_COMMAND.match(line)) and m["name"] == name]


def needs_a_sound_device(name: str, argv: list[str]) -> bool:
    return name in PLAY_ON_THE_DEFAULT_DEVICE and "--audio-device" not in argv


def has_an_output_device() -> bool:
    from pcgtts.runtime.audio.playback import list_output_devices

    try:
        return bool(list_output_devices())
    except (OSError, ImportError):  # no PortAudio
        return False


def run_example(name: str, *argv: str, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [f"examples/{name}", *argv])
    runpy.run_path(str(ROOT / "examples" / name), run_name="__main__")


DOCUMENTED_RUNS = [pytest.param(name, argv, id=f"{name}: {shlex.join(argv)[:60]}")
                   for name in EXAMPLES for argv in documented_commands(name)]


def test_every_example_shows_its_command_line():
    undocumented = [name for name in EXAMPLES if not documented_commands(name)]
    assert not undocumented, f"no `python examples/NAME.py ...` line in the docstring of {undocumented}"


@pytest.mark.parametrize("name, argv", DOCUMENTED_RUNS)
def test_an_example_runs_as_its_docstring_says(name, argv, workdir, monkeypatch, capsys):
    if needs_a_sound_device(name, argv) and not has_an_output_device():
        pytest.skip("plays on the default sound device, and this machine has none")
    outputs = [arg for arg in argv if arg.endswith(AUDIO_SUFFIXES) and not (workdir / arg).exists()]
    run_example(name, *argv, monkeypatch=monkeypatch)
    assert capsys.readouterr().out.strip(), f"{name} printed nothing"
    for output in outputs:
        assert sf.info(str(workdir / output)).duration > 0, output


BAD_ARGUMENTS = [
    ("save_wav.py", ["only one"], "usage: python examples/save_wav.py"),
    ("save_wav.py", ["", "out.wav"], "error: text is empty"),
    ("save_wav.py", ["Hello.", "out.xyz"], "cannot write a .xyz file"),
    ("save_wav.py", ["Hello.", "no/such/folder/out.wav"], "does not exist"),
    ("clone_voice.py", ["speaker.wav"], "usage: python examples/clone_voice.py"),
    ("clone_voice.py", ["missing.wav", SPEAKER_TEXT, "Hello.", "out.wav"], "not found"),
    ("clone_voice.py", ["speaker.txt", SPEAKER_TEXT, "Hello.", "out.wav"], "not a readable audio file"),
    ("clone_voice.py", ["speaker.wav", " ", "Hello.", "out.wav"], "error: text is empty"),
    ("clone_voice.py", ["speaker.wav", SPEAKER_TEXT, "Hello.", "out.xyz"], "cannot write a .xyz file"),
    ("stream_to_speaker.py", [], "the following arguments are required: text"),
    ("stream_to_speaker.py", ["?!", "--audio-device", "null"], "no pronounceable characters"),
    ("stream_to_speaker.py", ["Hello.", "--audio-device", "no-such-device-here"], "no audio output device"),
]


@pytest.mark.parametrize("name, argv, says", [pytest.param(*case, id=f"{case[0]}: {shlex.join(case[1])[:50]}")
                                              for case in BAD_ARGUMENTS])
def test_an_example_refuses_bad_arguments_in_one_line_before_loading_models(name, argv, says, workdir, no_models,
                                                                             monkeypatch, capsys):
    with pytest.raises(SystemExit) as stop:
        run_example(name, *argv, monkeypatch=monkeypatch)
    code = stop.value.code
    message = code if isinstance(code, str) else capsys.readouterr().err.strip().splitlines()[-1]  # argparse's
    assert code != 0 and code is not None
    assert says in message and "\n" not in message, message
    assert message.startswith(("usage: ", "error: ", f"examples/{name}: error: ")), message
    assert not list(workdir.glob("out*")), "an output was written"


def test_the_stream_example_names_a_missing_model_folder_in_one_line(workdir, monkeypatch, capsys):
    """Model folders are checked by `Synthesizer.from_pretrained` before it loads anything."""
    with pytest.raises(SystemExit) as stop:
        run_example("stream_to_speaker.py", "Hello.", "--target", "no-such-model", "--codec", "no-such-codec",
                    "--audio-device", "null", monkeypatch=monkeypatch)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and last.startswith("examples/stream_to_speaker.py: error: ")
    assert "model directory not found: no-such-" in last, last


def samples_hash(path: str) -> str:
    """What `Voice.source` records of the recording it was encoded from."""
    from pcgtts.runtime.audio.io import load_audio

    return hashlib.sha256(load_audio(path).tobytes()).hexdigest()


def kept_voices(folder: Path) -> set[tuple[str, str]]:
    """(recording's hash, transcript) of every voice file in `folder`."""
    from pcgtts import Voice

    return {(voice.source, voice.text) for voice in map(Voice.load, folder.glob("*.voice"))}


@pytest.mark.slow  # two encodings and three syntheses
def test_the_clone_example_keys_its_voice_by_the_reference_not_by_the_output(workdir, monkeypatch, capsys):
    from pcgtts import Voice

    data, rate = sf.read("speaker.wav")
    sf.write("other.wav", np.concatenate([np.zeros(rate // 2), data[::-1]]), rate)  # another recording
    speaker, other = samples_hash("speaker.wav"), samples_hash("other.wav")
    run_example("clone_voice.py", "speaker.wav", SPEAKER_TEXT, "Once.", "out.wav", monkeypatch=monkeypatch)
    assert kept_voices(workdir) == {(speaker, SPEAKER_TEXT)}
    run_example("clone_voice.py", "other.wav", "Another reference.", "Twice.", "out.wav", monkeypatch=monkeypatch)
    # the same output name, another reference: its own voice, not the first one reused
    assert kept_voices(workdir) == {(speaker, SPEAKER_TEXT), (other, "Another reference.")}
    assert "conditioned on other.wav" in capsys.readouterr().out
    run_example("clone_voice.py", "other.wav", "Said differently.", "Thrice.", "out.wav", monkeypatch=monkeypatch)
    assert (other, "Said differently.") in kept_voices(workdir)  # the transcript is part of the key

    def encode_again(*args, **kwargs):
        raise AssertionError("the reference was encoded again")

    monkeypatch.setattr(Voice, "from_audio", classmethod(encode_again))
    run_example("clone_voice.py", "speaker.wav", SPEAKER_TEXT, "Again.", "out.wav", monkeypatch=monkeypatch)
    assert len(list(workdir.glob("*.voice"))) == 3  # the same reference and transcript reuse their voice
