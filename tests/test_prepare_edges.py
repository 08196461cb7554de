"""`pcgtts prepare` and `pcgtts groups build` at their edges: a checkpoint whose config.json does not
describe its weights, a damaged weight file or the wrong folder as the codec are refused in one line
before any work; one preparation of a folder at a time; SIGTERM stops a preparation as Ctrl-C does;
a complete prepared folder loads without a write; `--out` errors name the user's own path."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _prepare_args(target, codec, out) -> list[str]:
    return ["prepare", "--checkpoint", str(target), "--codec", str(codec), "--out", str(out), "--no-onnx",
            "--group-size", "8", "--draft-layers", "2"]


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a preparation gets as far as running its stages."""
    import pcgtts.tools.prepare as prepare

    def refuse(*args, **kwargs):
        raise AssertionError("the preparation started before the bad input was reported")

    monkeypatch.setattr(prepare, "run_stages", refuse)


def _one_line_error(capsys, argv: list[str]) -> str:
    from pcgtts.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("pcgtts: error: "), err
    return err


def _with_config(source: Path, folder: Path, **changes) -> Path:
    """A copy of checkpoint `source` whose config.json has `changes`."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


def _truncated(source: Path, folder: Path) -> Path:
    shutil.copytree(source, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return weights


def test_a_config_that_does_not_describe_the_stored_weights_is_refused_before_any_work(tiny_models, tmp_path,
                                                                                        capsys, no_work):
    target, codec, out = Path(tiny_models["target"]), tiny_models["codec"], tmp_path / "out"
    config = json.loads((target / "config.json").read_text())
    vocab, hidden, layers = config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]
    cases = [({"vocab_size": vocab + 100}, rf"embed_tokens.weight is stored as \[{vocab}, {hidden}\].*vocab_size"),
             ({"hidden_size": hidden * 2}, rf"is stored as \[{vocab}, {hidden}\].*\[{vocab}, {hidden * 2}\]"),
             ({"num_hidden_layers": layers + 2}, rf"num_hidden_layers is {layers + 2}, but the checkpoint stores "
                                                 rf"{layers} layers"),
             ({"intermediate_size": 96}, r"gate_proj.weight is stored as .*intermediate_size")]
    for i, (changes, message) in enumerate(cases):
        bad = _with_config(target, tmp_path / f"bad{i}", **changes)
        err = _one_line_error(capsys, _prepare_args(bad, codec, out))
        assert str(bad) in err and re.search(message, err), (changes, err)
    assert not out.exists()


def test_speak_refuses_a_misdescribed_or_damaged_checkpoint_before_its_weights_load(tiny_models, tmp_path,
                                                                                     monkeypatch):
    from pcgtts.runtime.config import DecodeConfig, DeviceConfig, ModelPaths
    from pcgtts.runtime.loading import check_models
    from pcgtts.runtime.lm import checkpoint

    monkeypatch.setattr(checkpoint, "read_state_dict", lambda *a: pytest.fail("weights were read"))
    target = Path(tiny_models["target"])
    bad = _with_config(target, tmp_path / "bad", vocab_size=json.loads((target / "config.json").read_text())
                       ["vocab_size"] + 7)
    for model, message in ((bad, "config.json does not match the stored weights"),
                           (_truncated(target, tmp_path / "damaged").parent, r"cannot read .*model\.safetensors")):
        with pytest.raises(ValueError, match=message):
            check_models(ModelPaths(target=str(model), codec=str(tiny_models["codec"])), DecodeConfig(policy="ar"),
                         DeviceConfig(backend="torch"))


def test_the_wrong_folder_as_the_codec_is_named_for_what_it_is(tiny_models, tmp_path, capsys, no_work):
    target, out = tiny_models["target"], tmp_path / "out"
    exported = shutil.copytree(tiny_models["codec"], tmp_path / "exported-codec")
    (exported / "pcgtts-codec.json").write_text("{}")  # what `pcgtts export codec` writes beside its graph
    no_decoder = shutil.copytree(tiny_models["codec"], tmp_path / "no-decoder")
    from safetensors.torch import load_file, save_file

    weights = load_file(str(no_decoder / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("acoustic_decoder.")},
              str(no_decoder / "model.safetensors"))
    cases = [(target, r"--codec .*: not an X-codec2 folder \(a LLaSA LM checkpoint, not its codec"),
             (tiny_models["draft"], r"not an X-codec2 folder \(a LLaSA LM checkpoint"),
             (exported, r"an exported codec decoder, not an X-codec2 checkpoint"),
             (no_decoder, r"no acoustic_decoder\.\* weights"),
             (_truncated(tiny_models["codec"], tmp_path / "damaged-codec").parent,
              r"cannot read .*damaged-codec/model\.safetensors")]
    for codec, message in cases:
        err = _one_line_error(capsys, _prepare_args(target, codec, out))
        assert re.search(message, err), (codec, err)
    assert not out.exists()


def test_a_damaged_weight_file_is_one_line_naming_it_in_prepare_and_groups_build(tiny_models, tmp_path, capsys,
                                                                                  no_work, monkeypatch):
    import pcgtts.export.group_table as group_table

    monkeypatch.setattr(group_table, "build_groups_for_model", lambda *a, **k: pytest.fail("the build started"))
    weights = _truncated(tiny_models["target"], tmp_path / "damaged")
    message = f"pcgtts: error: cannot read {weights}: "
    assert _one_line_error(capsys, _prepare_args(weights.parent, tiny_models["codec"], tmp_path / "out")).startswith(
        message)
    assert _one_line_error(capsys, ["groups", "build", "--target", str(weights.parent), "--out",
                                    str(tmp_path / "g.pcg")]).startswith(message)
    assert not (tmp_path / "out").exists() and not (tmp_path / "g.pcg").exists()


# A preparation whose draft stage waits, in a process of its own, for the test to stop it.
STOPPED_IN_ITS_DRAFT_STAGE = """
import sys, time
from pathlib import Path
import pcgtts.train.subset_draft as draft

def wait(*args, **kwargs):
    Path(sys.argv[1]).touch()
    time.sleep(60)

draft.make_layer_subset_draft = wait
from pcgtts.cli import main
raise SystemExit(main(sys.argv[2:]))
"""


@pytest.mark.slow  # whole preparations: seconds
def test_a_folder_being_prepared_is_refused_at_once_and_sigterm_stops_it_as_ctrl_c_does(tiny_models, tmp_path,
                                                                                         capsys):
    from pcgtts.cli import main

    out, ready = tmp_path / "out", tmp_path / "in-draft-stage"
    argv = _prepare_args(tiny_models["target"], tiny_models["codec"], out)
    run = subprocess.Popen([sys.executable, "-c", STOPPED_IN_ITS_DRAFT_STAGE, str(ready), *argv],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), run.communicate(timeout=10)
        start = time.perf_counter()  # a second preparation of the same folder: refused at once
        err = _one_line_error(capsys, argv)
        assert time.perf_counter() - start < 10
        assert err == (f"pcgtts: error: another prepare is working on {out} (pid {run.pid}); wait for it to end, "
                       "or stop it and run again")
        run.send_signal(signal.SIGTERM)
        stdout, stderr = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.strip().splitlines()[-1] == "pcgtts: interrupted; run again to resume"
    assert "Traceback" not in stderr and stdout == ""
    assert main(argv) == 0  # the stages done are kept
    assert json.loads(capsys.readouterr().out)["stages"] == {"codec": "skipped", "target": "skipped",
                                                               "groups": "skipped", "draft": "made"}
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no lock or staging left


def test_a_lock_left_by_a_killed_run_is_taken_over_and_a_held_one_refused(tiny_models, tmp_path, capsys):
    from pcgtts.cli import main
    from pcgtts.tools.prepare import LOCK, FolderBusy, preparing

    out = tmp_path / "out"
    out.mkdir()
    with preparing(out), pytest.raises(FolderBusy, match=rf"working on {re.escape(str(out))} \(pid {os.getpid()}\)"):
        with preparing(out):
            pass
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / LOCK).write_text(f"{dead.pid}\n")  # left behind by a run that was killed
    assert main(_prepare_args(tiny_models["target"], tiny_models["codec"], out)) == 0
    assert json.loads(capsys.readouterr().out)["stages"] == {"codec": "made", "target": "made", "groups": "made",
                                                               "draft": "made"}
    assert not (out / LOCK).exists()


def test_a_complete_read_only_prepared_folder_loads_without_a_write(tiny_models, tmp_path):
    from pcgtts import Synthesizer
    from pcgtts.cli import main

    out = tmp_path / "prepared"
    assert main(_prepare_args(tiny_models["target"], tiny_models["codec"], out)) == 0

    def state() -> list[tuple]:  # root writes through chmod: what is there, and when it last changed
        return sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in [out, *out.rglob("*")])

    for path in [out, *out.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    try:
        before = state()
        synth = Synthesizer.from_pretrained(prepared=str(out), policy="ar", seed=0, max_new_tokens=10)
        assert len(synth.synthesize("Hi.")) > 0
        assert state() == before
    finally:
        for path in [out, *out.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)


def test_out_errors_name_the_users_path_not_a_probe(tmp_path):
    from pcgtts.runtime.files import check_output_dir, check_output_file

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    long_name = tmp_path / ("n" * 300)
    cases = [(check_output_dir, tmp_path / "missing" / "out", "folder .*missing does not exist"),
             (check_output_dir, a_file / "out", "a-file is a file, not a folder"),
             (check_output_dir, long_name, "longer than a file system allows"),
             (check_output_file, tmp_path / "missing" / "x.wav", "folder .*missing does not exist"),
             (check_output_file, a_file / "x.wav", "a-file is a file, not a folder"),
             (check_output_file, tmp_path / ("n" * 250 + ".wav"), "longer than this file system allows")]
    for check, path, message in cases:
        with pytest.raises(ValueError) as caught:
            check(path)
        text = str(caught.value)
        assert text.startswith(f"--out {path}: ") and re.search(message, text), text
        assert "probe" not in text and ".partial" not in text, text
    assert check_output_dir(tmp_path / "new") == tmp_path / "new" and list(tmp_path.iterdir()) == [a_file]


def test_a_first_use_waits_for_another_preparation_of_its_folder_instead_of_failing(tmp_path):
    import threading

    from pcgtts.tools.prepare import FolderBusy, preparing

    held, release, order = threading.Event(), threading.Event(), []

    def holder():
        with preparing(tmp_path):
            held.set()
            release.wait(10)
            order.append("holder done")

    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(10)
    with pytest.raises(FolderBusy):  # a command is refused at once
        with preparing(tmp_path):
            pass
    threading.Timer(0.3, release.set).start()
    with preparing(tmp_path, wait=True):  # the built-in voice's first use waits its turn
        order.append("waiter in")
    thread.join(10)
    assert order == ["holder done", "waiter in"]
