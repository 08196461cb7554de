"""`pcgtts prepare`: a checkpoint (or the built-in voice) made ready once, in resumable stages, into a
folder that `prepared=` / `--prepared` loads with nothing of the tools, training or export code."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# A fresh interpreter: load a prepared folder, synthesise, and list what of pcgtts it imported that a
# warm synthesis must not (the tools, training and export code).
LOAD_AND_SYNTHESISE = (
    "import sys; from pcgtts import Synthesizer; "
    "synth = Synthesizer.from_pretrained(prepared=sys.argv[1], seed=0, max_new_tokens=20, **({} if len(sys.argv) < 3 "
    "else {'backend': sys.argv[2]})); "
    "audio = synth.synthesize('Hello there.'); assert len(audio) > 0; "
    "print(type(synth.target).__name__); "
    "print(','.join(sorted(m for m in sys.modules if m.startswith(('pcgtts.train', 'pcgtts.export', 'pcgtts.tools')))))")


PREPARE = "from pcgtts.cli import main; raise SystemExit(main(['prepare']))"


def _prepare(tiny_models, out: Path, **options):
    from pcgtts.tools.prepare import CheckpointPreparation, prepare_checkpoint

    prep = CheckpointPreparation(tiny_models["target"], tiny_models["codec"], **{"group_size": 8, "draft_layers": 2,
                                                                                   "onnx": False, **options})
    return prepare_checkpoint(prep, out, progress=False)


def _fresh(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOAD_AND_SYNTHESISE, *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_a_prepared_checkpoint_loads_and_synthesises_without_tools_training_or_export_code(tiny_models, tmp_path):
    out = tmp_path / "prepared"
    report = _prepare(tiny_models, out)
    assert report == {"codec": "made", "target": "made", "groups": "made", "draft": "made"}
    manifest = json.loads((out / "prepared.json").read_text())
    assert manifest["plan"] == ["codec", "target", "groups", "draft"] and not (out / ".staging").exists()
    assert json.loads((out / "draft" / "config.json").read_text())["pcgtts_draft"]["layers"] == [0, 3]
    run = _fresh(str(out))
    assert run.returncode == 0, run.stderr
    kind, imported = run.stdout.split("\n")[:2]
    assert kind == "TorchLM" and imported == "", imported


def test_prepare_is_idempotent_and_resumes_after_a_stage_is_removed_or_interrupted(tiny_models, tmp_path,
                                                                                    monkeypatch):
    out = tmp_path / "prepared"
    _prepare(tiny_models, out)
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != "prepared.json"}
    assert set(_prepare(tiny_models, out).values()) == {"skipped"}  # a second run does no work
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps

    shutil.rmtree(out / "draft")  # a stage's files gone: that stage (and those after it) made again
    assert _prepare(tiny_models, out) == {"codec": "skipped", "target": "skipped", "groups": "skipped",
                                          "draft": "made"}

    import pcgtts.train.subset_draft as draft

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    shutil.rmtree(out / "draft")
    monkeypatch.setattr(draft, "make_layer_subset_draft", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _prepare(tiny_models, out)
    assert "draft" not in json.loads((out / "prepared.json").read_text())["stages"]
    from pcgtts.runtime.config import resolve_settings

    with pytest.raises(ValueError, match="not fully prepared .*draft"):  # an unfinished folder is refused
        resolve_settings({"prepared": str(out)})
    monkeypatch.undo()
    assert _prepare(tiny_models, out)["draft"] == "made" and not (out / ".staging").exists()


def test_a_changed_source_or_option_is_prepared_again(tiny_models, tmp_path):
    """A stage whose inputs changed (an option, the checkpoint's files) is made again, with those after it."""
    out = tmp_path / "prepared"
    models = {**tiny_models, "target": shutil.copytree(tiny_models["target"], tmp_path / "target")}
    _prepare(models, out)
    assert _prepare(models, out, draft_layers=1) == {"codec": "skipped", "target": "skipped", "groups": "skipped",
                                                     "draft": "made"}
    config = models["target"] / "config.json"
    config.write_text(config.read_text() + "\n")
    assert _prepare(models, out, draft_layers=1) == {"codec": "skipped", "target": "made", "groups": "made",
                                                     "draft": "made"}
    assert set(_prepare(models, out, draft_layers=1).values()) == {"skipped"}


def test_bad_input_is_a_one_line_error_before_any_work(tiny_models, tmp_path, capsys):
    from pcgtts.cli import main

    out = tmp_path / "out"
    not_llasa = tmp_path / "not-llasa"
    not_llasa.mkdir()
    (not_llasa / "config.json").write_text('{"architectures": ["BertModel"]}')
    (not_llasa / "model.safetensors").write_bytes(b"")
    target, codec = str(tiny_models["target"]), str(tiny_models["codec"])
    cases = [(["--checkpoint", str(tmp_path / "missing"), "--codec", codec, "--out", str(out)], "folder not found"),
             (["--checkpoint", str(not_llasa), "--codec", codec, "--out", str(out)], "not a LLaSA checkpoint"),
             (["--checkpoint", target, "--codec", codec, "--out", str(out), "--group-size", "600"],
              r"group size must lie in \[1, 512\]"),
             (["--checkpoint", target, "--codec", codec, "--out", str(out), "--draft-layers", "9"],
              r"--draft-layers: a count in \[1, 4\]"),
             (["--checkpoint", target], "needs --codec and --out"),
             (["--group-size", "20"], "--group-size need --checkpoint")]
    for flags, message in cases:
        assert main(["prepare", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and re.search(message, err), (flags, err)
    assert not out.exists()
    with pytest.raises(SystemExit):  # argparse: a group size must be a positive number
        main(["prepare", "--checkpoint", str(tiny_models["target"]), "--group-size", "0"])


def test_prepared_with_model_paths_is_a_one_line_error_and_flags_resolve_to_its_models(tiny_models, tmp_path):
    from pcgtts.cli import build_parser
    from pcgtts.cli.commands import resolve_cli_settings
    from pcgtts.runtime.config import resolve_settings

    out = tmp_path / "prepared"
    _prepare(tiny_models, out)
    with pytest.raises(ValueError, match="give either prepared or target, draft, not both"):
        resolve_settings({"prepared": str(out), "target": "t", "draft": "d"})
    with pytest.raises(ValueError, match="not a prepared folder"):
        resolve_settings({"prepared": str(tmp_path)})
    with pytest.raises(ValueError, match="no onnxruntime exports"):
        resolve_settings({"prepared": str(out), "backend": "onnxruntime"})
    for command in (["speak", "hi"], ["bench"], ["eval"], ["serve"]):
        settings = resolve_cli_settings(build_parser().parse_args([*command, "--prepared", str(out)]), policy="ar")
        models = settings.models
        assert (models.target, models.draft, models.codec, models.groups, models.prepared) == (
            str(out / "target"), str(out / "draft"), str(out / "codec"), str(out / "groups.pcg"), None), command
        # a user's checkpoint: not played at the built-in voice's own settings
        assert settings.synthesis.decode.sampling.temperature == 0.8


@pytest.mark.slow  # three checked exports, ~1 min
def test_a_prepared_checkpoint_with_exports_runs_on_onnxruntime_on_a_cpu(tiny_models, tmp_path):
    out = tmp_path / "prepared"
    assert _prepare(tiny_models, out, onnx=True)["onnx"] == "made"
    assert all((out / "onnx-int8" / name).is_dir() for name in ("target", "draft", "codec"))
    run = _fresh(str(out))
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["OrtLM", ""], run.stdout
    from pcgtts.runtime.config import prepared_settings, resolve_settings

    batch = prepared_settings(resolve_settings({"prepared": str(out), "max_batch": 2}))  # LMs on torch, codec graph
    assert batch.models.codec == str(out / "onnx-int8" / "codec") and "onnx-int8" not in batch.models.target
    assert batch.device.backend == "auto"
    assert _prepare(tiny_models, out, onnx=False) == {name: "skipped" for name in ("codec", "target", "groups", "draft")}
    assert not (out / "onnx-int8" / "target").exists()  # a stage no longer asked for is removed


@pytest.mark.slow
@pytest.mark.shipped_voice
def test_the_built_in_voice_once_prepared_synthesises_without_tools_training_or_export_code(tmp_path):
    env = {"PCGTTS_CACHE": str(tmp_path / "cache")}
    prepared = subprocess.run([sys.executable, "-c", PREPARE], capture_output=True, text=True, timeout=1200,
                              env={**os.environ, **env})
    assert prepared.returncode == 0, prepared.stderr
    folder = json.loads(prepared.stdout)["prepared"]
    again = subprocess.run([sys.executable, "-c", PREPARE], capture_output=True, text=True, timeout=600,
                           env={**os.environ, **env})
    assert set(json.loads(again.stdout)["stages"].values()) == {"skipped"}, again.stdout
    code = ("import sys; from pcgtts import Synthesizer; synth = Synthesizer.from_pretrained(seed=0, max_new_tokens=20); "
            "assert len(synth.synthesize('Hello there.')) > 0; "
            "print(','.join(sorted(m for m in sys.modules if m.startswith(('pcgtts.train', 'pcgtts.export', "
            "'pcgtts.tools')))))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **env})
    assert run.returncode == 0 and run.stdout.strip() == "", (run.stdout, run.stderr)
    assert Path(folder).parent == tmp_path / "cache"


# ---------------------------------------------------------------- the built-in voice's shipped group table

VOICE = Path(__file__).resolve().parents[1] / "pcgtts" / "voice"  # the committed voice (other tests see the demo)


def _shipped_table_bytes(pack: Path) -> bytes:
    import lzma

    return lzma.decompress((pack / json.loads((pack / "voice.json").read_text())["groups"]["table"]).read_bytes())


def test_the_built_in_voice_ships_its_group_table_checksummed(tmp_path):
    """The table expansion would build (a minute and more on 2 cores) ships with the voice, recorded in
    voice.json with its sha256: a damaged one is refused before anything is expanded."""
    from pcgtts.groups.table import GroupTable
    from pcgtts.runtime.voicepack import read_voice

    meta = read_voice(VOICE)  # every checksum, the table's included
    assert meta["groups"]["table"] in meta["sha256"]
    (tmp_path / "groups.pcg").write_bytes(_shipped_table_bytes(VOICE))
    table = GroupTable.load(tmp_path / "groups.pcg")
    assert table.top_k == meta["groups"]["cap"] and table.stats["num_tokens"] == 65536
    assert abs(table.stats["mean_group_size"] - meta["groups"]["mean_size"]) < 1
    damaged = shutil.copytree(VOICE, tmp_path / "voice")
    path = damaged / meta["groups"]["table"]
    path.write_bytes(path.read_bytes()[:-1] + bytes([path.read_bytes()[-1] ^ 1]))
    with pytest.raises(ValueError, match=r"groups\.pcg\.xz is missing or damaged"):
        read_voice(damaged)


@pytest.mark.slow  # expands the shipped voice (about 20 s on 2 cores)
def test_expanding_the_built_in_voice_copies_its_table_instead_of_building_it(tmp_path, monkeypatch):
    import pcgtts.export.group_table as group_table
    from pcgtts.groups.table import GroupTable
    from pcgtts.runtime.lm.checkpoint import load_speech_embeddings
    from pcgtts.train.package import expand_voice

    def built(*args, **kwargs):
        raise AssertionError("the group table was built")

    monkeypatch.setattr(group_table, "build_groups_for_model", built)
    paths = expand_voice(VOICE, tmp_path / "expanded", progress=False)
    assert paths["groups"].read_bytes() == _shipped_table_bytes(VOICE)
    _, vocab, fingerprint = load_speech_embeddings(paths["target"])
    GroupTable.load(paths["groups"], expect_vocab=vocab, expect_fingerprint=fingerprint)  # it fits the target


@pytest.mark.slow  # builds the table over 65,536 codes (one to two minutes on 2 cores)
def test_the_shipped_group_table_is_the_one_expansion_builds(tmp_path):
    """What the voice's expansion builds without it: θ for the recorded mean size, the cap; byte for
    byte on a CPU like the one it was built on. Another CPU's kernels round the similarities in
    another order, and the few that lie within that rounding of θ may fall on its other side (on an
    AMD EPYC: 18 of 65,536 groups, 6 members of 3.15 million): the table is then the same but for them."""
    from pcgtts.export.group_table import build_groups_for_model
    from pcgtts.groups.build import theta_for_mean_size
    from pcgtts.groups.table import GroupTable
    from pcgtts.runtime.lm.checkpoint import load_speech_embeddings
    from pcgtts.runtime.voicepack import read_voice
    from pcgtts.train.package import expand_lm

    groups = read_voice(VOICE, files=())["groups"]
    target = expand_lm(VOICE, "target", tmp_path / "target")
    rows, _, _ = load_speech_embeddings(target)
    theta = theta_for_mean_size(rows, groups["mean_size"], groups["cap"])
    build_groups_for_model(target, theta, groups["cap"], progress=False).save(tmp_path / "groups.pcg")
    shipped_bytes = _shipped_table_bytes(VOICE)
    if (tmp_path / "groups.pcg").read_bytes() == shipped_bytes:  # compared here, not in an assert: pytest
        return  # would diff two 6 MB byte strings for minutes
    (tmp_path / "shipped.pcg").write_bytes(shipped_bytes)
    built, shipped = (GroupTable.load(tmp_path / name) for name in ("groups.pcg", "shipped.pcg"))
    assert built.num_groups == shipped.num_groups and built.top_k == shipped.top_k
    assert abs(len(built.group_members) - len(shipped.group_members)) <= 1e-4 * len(shipped.group_members)

    def groups_of(table):
        return {table.members(k).tobytes() for k in range(table.num_groups)}

    assert len(groups_of(built) ^ groups_of(shipped)) <= 2e-3 * shipped.num_groups  # a few, at θ


# ---------------------------------------------------------------- the built-in voice's export in the background

def _expanded_cache(tmp_path: Path, exported: bool = False) -> Path:
    """A cache folder whose manifest records the built-in voice expanded (and with `exported`, its onnxruntime
    graphs made), stand-in files in place."""
    from pcgtts.runtime.prepared import FORMAT, MANIFEST, VERSION

    folder = tmp_path / "voice-cache"
    stages = {"expand": {"inputs": {}, "files": ["target"]}}
    if exported:
        stages["onnx"] = {"inputs": {}, "files": ["onnx-int8/target"]}
    for file in (file for stage in stages.values() for file in stage["files"]):
        (folder / file).mkdir(parents=True)
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "version": VERSION, "plan": list(stages),
                                               "stages": stages}))
    return folder


def test_the_first_use_runs_torch_while_a_background_process_exports_unless_switched_off(tmp_path, monkeypatch):
    from pcgtts import builtin
    from pcgtts.runtime.config import ModelPaths

    folder = _expanded_cache(tmp_path)
    started = []
    monkeypatch.setattr(builtin, "start_background_export", lambda cache: started.append(cache))
    models = ModelPaths(target=str(folder / "target"))
    assert not builtin.exporting_in_background(models) and not started  # switched off (the suite does): export first
    monkeypatch.setenv(builtin.BACKGROUND_ENV, "1")
    assert builtin.exporting_in_background(models) and started == [folder]
    done = _expanded_cache(tmp_path / "done", exported=True)
    assert not builtin.exporting_in_background(ModelPaths(target=str(done / "target")))  # made: nothing to do
    assert started == [folder]


def test_the_background_export_runs_apart_logs_to_the_cache_and_only_one_works_on_a_folder(tmp_path, monkeypatch):
    from pcgtts import builtin
    from pcgtts.tools.prepare import preparing

    folder = _expanded_cache(tmp_path)
    monkeypatch.setattr(builtin, "BACKGROUND_EXPORT", "import os, sys; print('exporting', *sys.argv[1:], "
                                                      "os.environ['PCGTTS_BACKGROUND_EXPORT'], os.getsid(0) == os.getpid())")
    process = builtin.start_background_export(folder, VOICE)
    assert process.wait(timeout=60) == 0
    assert (folder / builtin.EXPORT_LOG).read_text() == f"exporting {folder} {VOICE} 0 True\n"  # its own session
    with preparing(folder):  # another preparation at work on the folder: none is started
        assert builtin.start_background_export(folder, VOICE) is None
        # and one started just before the other took the lock gives way to it, saying so in its log
        code = f"from pcgtts.builtin import background_export_main; background_export_main({str(folder)!r}, {str(VOICE)!r})"
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "another prepare is working on" in run.stdout, (run.stdout, run.stderr)


def test_the_built_in_voice_prepared_elsewhere_plays_as_the_built_in_voice(tmp_path, monkeypatch):
    """`pcgtts prepare --out DIR` of the built-in voice, then `--prepared DIR`: its presets by name and its
    own settings (its temperature), under the caller's."""
    from pcgtts.builtin import named_presets, voice_settings
    from pcgtts.runtime.config import resolve_settings
    from pcgtts.tools.prepare import prepare_builtin

    def fake_expand(pack_dir, out):  # the stand-in checkpoints; the rest of the stage is real
        paths = {"target": out / "target", "draft": out / "draft", "codec": out / "codec", "groups": out / "groups.pcg",
                 "clone_codec": out / "clone_codec", "clone_target": out / "clone_target"}  # the voice's second pair
        for name, path in paths.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir() if name != "groups" else path.write_bytes(b"")
        return paths

    monkeypatch.setattr("pcgtts.train.package.expand_voice", fake_expand)
    out = tmp_path / "ready"
    prepare_builtin(out, VOICE, onnx=False, progress=False)
    own = voice_settings(VOICE)
    assert own["temperature"] == 0.2
    settings = resolve_settings({"prepared": str(out)})
    assert settings.synthesis.decode.sampling.temperature == own["temperature"]
    assert named_presets(settings.models).resolve("onyx") == "oak" and "oak" in {v["name"] for v in
                                                                                 named_presets(settings.models).listing()}
    assert resolve_settings({"prepared": str(out), "temperature": 0.7}).synthesis.decode.sampling.temperature == 0.7
