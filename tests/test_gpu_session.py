"""benchmarks/gpu_session.sh's options: the inputs folder (--inputs / PCGTTS_GPU_INPUTS), the results
folder and the budgets, with bad ones refused in one line before anything is installed. `python3` is a
stub here that records its calls and fails, so nothing is ever installed or run."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "gpu_session.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def run(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    calls = tmp_path / "calls.log"
    for name in ("python3", "nvidia-smi"):
        (stubs / name).write_text(f'#!/bin/sh\necho "{name} $*" >> "{calls}"\nexit 1\n')
        (stubs / name).chmod(0o755)
    environ = {k: v for k, v in os.environ.items()
               if k not in ("OUT", "MINUTES", "RESULT_FILES", "PART_MIB", "PCGTTS_GPU_INPUTS")}
    environ.update(PATH=f"{stubs}{os.pathsep}{environ['PATH']}", CODEC_WORK=str(tmp_path / "codec-work"), **env)
    done = subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=environ, capture_output=True, text=True,
                          timeout=60)
    return done, calls.read_text().splitlines() if calls.exists() else []


def test_help_names_the_options_and_runs_nothing(tmp_path):
    done, calls = run(tmp_path, "--help")
    assert done.returncode == 0 and calls == []
    for option in ("--inputs DIR", "PCGTTS_GPU_INPUTS", "--out DIR", "--minutes N", "--result-files N", "--part-mib N"):
        assert option in done.stdout
    assert not (tmp_path / "gpu_out").exists()


@pytest.mark.parametrize("args, env, message", [
    (["--inputs", "{tmp}/in", "--out", "{tmp}/out", "eagle"], {}, "reads {tmp}/in/eagle_sentences.txt"),
    (["--out", "{tmp}/out", "codec"], {"PCGTTS_GPU_INPUTS": "{tmp}/env"}, "reads {tmp}/env/audio.npz"),
    (["--inputs", "{tmp}/in", "--out", "{tmp}/out", "codec"], {"PCGTTS_GPU_INPUTS": "{tmp}/env"},
     "reads {tmp}/in/audio.npz"),  # the flag wins over the variable
    (["--out", "{tmp}/out", "bogus"], {}, "unknown step 'bogus'"),
    (["--out", "{tmp}/out", "--minutes", "soon", "codec"], {}, "--minutes (MINUTES) must be a number"),
    (["--out", "{tmp}/out", "--part-mib", "0", "tests"], {}, "--part-mib (PART_MIB) must be a positive"),
    (["--out", "{tmp}/out", "--inputs"], {}, "--inputs needs a value"),
])
def test_bad_options_and_missing_inputs_are_one_line_errors_before_any_install(tmp_path, args, env, message):
    fill = {"tmp": str(tmp_path)}
    done, calls = run(tmp_path, *(a.format(**fill) for a in args), **{k: v.format(**fill) for k, v in env.items()})
    assert done.returncode == 2, done.stderr
    assert message.format(**fill) in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert calls == [] and not (tmp_path / "out").exists()


def test_the_inputs_folders_files_and_wheels_are_used(tmp_path):
    inputs = tmp_path / "in"
    (inputs / "wheels").mkdir(parents=True)
    (inputs / "eagle_sentences.txt").write_text("Hello there.\n")
    (inputs / "wheels" / "extra-1.0-py3-none-any.whl").write_bytes(b"")
    done, calls = run(tmp_path, "--inputs", str(inputs), "--out", str(tmp_path / "out"), "eagle")
    assert done.returncode == 1  # the stub python3 fails the install: the checks let it start
    assert calls[0].startswith("python3 -m pip install") and calls[0].endswith(f"{inputs}/wheels/extra-1.0-py3-none-any.whl")
    assert (tmp_path / "out").is_dir()
