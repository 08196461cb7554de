"""A second target LM for voices with a reference (`ModelPaths.clone_target`): a prompt that ends in
reference codes (a cloned voice, a voice file, a preset) is spoken by it, every other by `target`. It
loads on the first such stream, keeps its own caches and planner, shares the draft LM, and takes the
proposers on the target's states only when its states are laid out alike (else the stream falls back to
the draft LM or plain decoding). Settings, the prepared folder and the voice pack carry it."""

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from test_clone_codec import _stub_group_table, voice_pack  # noqa: F401  (voice_pack: a fixture)

from pcgtts.runtime.audio.voice import Voice
from pcgtts.runtime.config import SynthesisConfig

REFERENCE = Voice(np.arange(40, dtype=np.int64) * 7 % 512, "A short reference sentence.")
TEXT = "Hello there."


def _tiny_config(**overrides):
    """The tiny pair's construction (tests/conftest.py `tiny_pair_config`), changed by `overrides`."""
    from pcgtts.tools.demo import DemoLMConfig

    return replace(DemoLMConfig(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
                                num_speech=1024, draft_layers=2, draft_confusion=0.0, embed_scale=0.8), **overrides)


@pytest.fixture(scope="module")
def clones(tmp_path_factory):
    """Targets for the tiny pair's vocabulary: "same" (other weights, the target's shape), "narrow"
    (hidden 32: states no proposer of the target reads) and "padded" (another vocab_size)."""
    from pcgtts.tools.demo import write_demo

    root = tmp_path_factory.mktemp("clones")
    configs = {"same": _tiny_config(), "narrow": _tiny_config(hidden_size=32, num_heads=2, num_kv_heads=1),
               "padded": _tiny_config(vocab_size=1400)}
    return {name: str(write_demo(root / name, seed=7, config=config, with_codec=False)["target"])
            for name, config in configs.items()}


def _synth(models, target=None, clone_target=None, draft=False, policy="ar", **settings):
    from pcgtts.runtime.synthesizer import Synthesizer

    config = SynthesisConfig(seed=0, min_tokens=30, tokens_per_char=2.0)
    return Synthesizer.from_pretrained(target or models["target"], draft=models["draft"] if draft else None,
                                       codec=models["codec"], clone_target=clone_target, policy=policy,
                                       max_length=512, adaptive_draft=False, config=config, **settings)


def test_the_clone_target_loads_on_the_first_voice_with_a_reference(tiny_models, clones):
    synth = _synth(tiny_models, clone_target=clones["same"])
    assert not synth.clone_target.loaded
    synth.synthesize(TEXT)
    synth.synthesize(TEXT, voice="default")
    assert not synth.clone_target.loaded  # the model's own voice never loads it
    synth.synthesize(TEXT, voice=REFERENCE)
    assert synth.clone_target.loaded
    assert synth.route(True).target is synth.clone_target.get().target is not synth.target
    assert synth.route(True) is synth.route(True) and synth.route(False).target is synth.target


def test_the_clone_target_is_loaded_once_whichever_threads_ask_first():
    import threading
    import time

    from pcgtts.runtime.loading import LazyTarget, TargetModels

    calls = []

    def load():
        calls.append(threading.get_ident())
        time.sleep(0.05)  # the others ask meanwhile
        if len(calls) == 1:
            raise OSError("a damaged file")  # a failed load is tried again by the next caller
        return TargetModels(target=object())

    lazy = LazyTarget("clone", load)
    with pytest.raises(OSError, match="damaged"):
        lazy.get()
    got = []
    threads = [threading.Thread(target=lambda: got.append(lazy.get())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 2 and len(got) == 4 and all(models is got[0] for models in got) and lazy.loaded


def test_a_voice_with_a_reference_is_spoken_by_the_clone_target(tiny_models, clones, tmp_path):
    both = _synth(tiny_models, clone_target=clones["same"], draft=True, policy="sd")
    main = _synth(tiny_models, draft=True, policy="sd")
    clone = _synth(tiny_models, target=clones["same"], draft=True, policy="sd")
    cloned = clone.synthesize(TEXT, voice=REFERENCE)
    assert len(cloned) and not np.array_equal(cloned, main.synthesize(TEXT, voice=REFERENCE))
    assert np.array_equal(both.synthesize(TEXT, voice=REFERENCE), cloned)
    assert np.array_equal(both.synthesize(TEXT, voice=REFERENCE.save(tmp_path / "me.voice")), cloned)  # a voice file
    assert np.array_equal(both.synthesize(TEXT), main.synthesize(TEXT))  # its own voice: the target, as before
    both.release()
    assert np.array_equal(both.synthesize(TEXT, voice=REFERENCE), cloned)  # its cache freed and made again


def test_without_a_clone_target_the_target_speaks_every_voice(tiny_models):
    synth = _synth(tiny_models)
    assert synth.clone_target is None and synth.route(True).target is synth.target
    same = _synth(tiny_models, clone_target=tiny_models["target"])  # the target's own folder: loaded once
    assert same.clone_target is None


def test_a_clone_target_of_another_layout_is_refused_before_loading(tiny_models, clones, tmp_path):
    with pytest.raises(ValueError, match=r"clone_target model directory not found: .*nowhere"):
        _synth(tiny_models, clone_target=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"^clone target .*padded.* has 1400 embedding rows .* the clone target "
                                         r"was not made for this target$"):
        _synth(tiny_models, clone_target=clones["padded"])


def test_the_serving_policy_falls_back_from_proposers_on_the_targets_states():
    from pcgtts.runtime.synthesizer import serving_policy

    assert serving_policy("eagle-pcg", draft=True, heads=False, eagle=False) == "pcg"
    assert serving_policy("mtp-sd", draft=True, heads=False, eagle=True) == "sd"
    assert serving_policy("mtp-topm", draft=True, heads=False, eagle=False) == "ar"  # no draft policy runs topm
    assert serving_policy("eagle-sd", draft=False, heads=False, eagle=False) == "ar"
    assert serving_policy("eagle-sd", draft=False, heads=False, eagle=True) == "eagle-sd"
    assert serving_policy("sd", draft=True, heads=False, eagle=False) == "sd"


@pytest.fixture(scope="module")
def eagle_target(tiny_models, tmp_path_factory):
    """A copy of the tiny target with a (random) EAGLE draft beside it."""
    from helpers import random_draft

    from pcgtts.runtime.lm.eagle import EAGLE_FILE
    from pcgtts.runtime.lm.torch_lm import TorchLM

    folder = shutil.copytree(tiny_models["target"], tmp_path_factory.mktemp("eagle") / "target")
    random_draft(TorchLM.load(folder, max_length=64), seed=3).save(Path(folder) / EAGLE_FILE)
    return str(folder)


def test_eagle_serves_a_clone_target_of_the_targets_shape(tiny_models, clones, eagle_target):
    synth = _synth(tiny_models, target=eagle_target, clone_target=clones["same"], policy="eagle-sd")
    assert len(synth.synthesize(TEXT, voice=REFERENCE))
    route = synth.route(True)
    assert route.planner.eagle is not None and route.planner.eagle is not synth.eagle


def test_a_clone_target_of_another_shape_falls_back_to_the_draft_and_says_so_once(tiny_models, clones, eagle_target,
                                                                                   caplog):
    synth = _synth(tiny_models, target=eagle_target, clone_target=clones["narrow"], draft=True, policy="eagle-sd")
    clone = _synth(tiny_models, target=clones["narrow"], draft=True, policy="sd")
    with caplog.at_level(logging.WARNING, logger="pcgtts.runtime.synthesizer"):
        first = synth.synthesize(TEXT, voice=REFERENCE)
        assert np.array_equal(synth.synthesize(TEXT, voice=REFERENCE), first)
    assert synth.route(True).planner.eagle is None
    assert np.array_equal(first, clone.synthesize(TEXT, voice=REFERENCE))  # decoded as sd with the draft LM
    said = [r.getMessage() for r in caplog.records if "policy eagle-sd" in r.getMessage()]
    assert len(said) == 1 and "at sd" in said[0]
    assert synth.eagle is not None and len(synth.synthesize(TEXT))  # its own voice keeps the EAGLE draft


@pytest.mark.slow  # exports two graphs: half a minute
def test_an_exported_clone_target_runs_on_onnxruntime(tiny_models, clones, tmp_path):
    from pcgtts.tools.prepare import export_for_onnxruntime

    for name, source in (("target", tiny_models["target"]), ("clone_target", clones["same"])):
        export_for_onnxruntime(name, source, tmp_path / name)
    models = {**tiny_models, "target": str(tmp_path / "target")}
    both = _synth(models, clone_target=str(tmp_path / "clone_target"), backend="onnxruntime")
    clone = _synth(models, target=str(tmp_path / "clone_target"), backend="onnxruntime")
    assert np.array_equal(both.synthesize(TEXT, voice=REFERENCE), clone.synthesize(TEXT, voice=REFERENCE))
    assert type(both.route(True).target) is type(both.target) and both.route(True).target is not both.target
    with pytest.raises(ValueError, match="clone_target .*: a checkpoint, but the target .* is an ONNX export"):
        _synth(models, clone_target=clones["same"], backend="onnxruntime")


# --- settings, the command line, the prepared folder --------------------------------------------------

def test_the_settings_and_the_command_line_name_a_clone_target(tmp_path):
    from helpers import assert_a_model_path_setting

    from pcgtts.builtin import with_builtin_models
    from pcgtts.runtime.config import resolve_settings

    assert_a_model_path_setting(tmp_path, "clone_target", "t2")
    with pytest.raises(ValueError, match="clone_target given without a target"):
        with_builtin_models(resolve_settings({"clone_target": "x"}))
    with pytest.raises(ValueError, match="give either prepared or clone_target, not both"):
        resolve_settings({"prepared": str(tmp_path), "clone_target": "x"})


def test_a_prepared_folder_names_its_clone_target_and_its_export(tmp_path):
    from pcgtts.runtime.prepared import EXPORTED, checkpoint_paths, onnx_paths

    for name in ("target", "codec", "clone_target"):
        (tmp_path / name).mkdir()
    paths = checkpoint_paths(tmp_path)
    assert paths["clone_target"] == str(tmp_path / "clone_target") and "clone_target" in EXPORTED
    assert onnx_paths(tmp_path, paths)["clone_target"] == str(tmp_path / "onnx-int8" / "clone_target")
    (tmp_path / "clone_target").rmdir()
    assert "clone_target" not in checkpoint_paths(tmp_path)


def test_a_prepared_checkpoint_carries_its_clone_target(tiny_models, clones, tmp_path, capsys):
    import re

    from pcgtts.cli import main
    from pcgtts.runtime.config import resolve_settings
    from pcgtts.tools.prepare import CheckpointPreparation, prepare_checkpoint

    target, codec, out = str(tiny_models["target"]), str(tiny_models["codec"]), tmp_path / "out"
    for flags, message in ((["--clone-target", clones["same"]], "--clone-target need --checkpoint"),
                           (["--checkpoint", target, "--codec", codec, "--clone-target", str(tmp_path / "missing"),
                             "--out", str(out)], "--clone-target .*missing: folder not found"),
                           (["--checkpoint", target, "--codec", codec, "--clone-target", codec, "--out", str(out)],
                            "--clone-target .*: not a LLaSA checkpoint"),
                           (["--checkpoint", target, "--codec", codec, "--clone-target", clones["padded"],
                             "--out", str(out)], "clone target .*padded.* has 1400 embedding rows")):
        assert main(["prepare", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and re.search(message, err), (flags, err)
    assert not out.exists()
    prep = CheckpointPreparation(tiny_models["target"], tiny_models["codec"], draft_layers=1, onnx=False,
                                 clone_target=clones["same"])
    assert prepare_checkpoint(prep, out, progress=False)["clone_target"] == "made"
    models = resolve_settings({"prepared": str(out)}).models
    assert models.clone_target == str(out / "clone_target") and models.target == str(out / "target")
    assert (out / "clone_target" / "model.safetensors").read_bytes() == (
        Path(clones["same"]) / "model.safetensors").read_bytes()


def test_an_export_and_a_checkpoint_do_not_mix(tiny_models, tmp_path):
    from pcgtts.runtime.loading import check_clone_target

    exported = tmp_path / "exported"
    exported.mkdir()
    (exported / "pcgtts-lm.json").write_text('{"kind": "onnx"}')
    with pytest.raises(ValueError, match=r"^clone_target .*exported: an ONNX export, but the target .* is a checkpoint"):
        check_clone_target(str(exported), tiny_models["target"])


# --- the built-in voice's pack: clone_target.safetensors, expanded with the target's tokenizer ----------

def _lab_lm(folder: Path, seed: int, text_rows: int | None = None) -> Path:
    """A lab `lm` folder (checkpoint.pt) of a tiny factorised target; `text_rows`: another text vocabulary."""
    from dataclasses import asdict

    import torch

    from pcgtts.train.lm import LMModelConfig, build_model, lab_tokenizer
    from pcgtts.train.progress import save_checkpoint

    cfg = LMModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    state = build_model(cfg, lab_tokenizer(), seed=seed).state_dict()
    if text_rows is not None:
        state["text"] = torch.zeros(text_rows, state["text"].shape[1])
    folder.mkdir(parents=True)
    save_checkpoint(folder / "checkpoint.pt", {"model": state, "model_config": asdict(cfg), "step": 2})
    return folder


def test_a_clone_target_of_another_vocabulary_layout_is_refused_and_the_voice_kept(voice_pack, tmp_path):
    from pcgtts.train.package import add_clone_target

    pack = Path(shutil.copytree(voice_pack, tmp_path / "voice"))
    before = (pack / "voice.json").read_text()
    with pytest.raises(ValueError) as refused:
        add_clone_target(pack, _lab_lm(tmp_path / "other", seed=5, text_rows=300))
    message = str(refused.value)
    assert "\n" not in message and "different speech-token layout" in message and "clone target" in message
    assert (pack / "voice.json").read_text() == before and not list(pack.glob("clone_target*"))
    with pytest.raises(ValueError, match="lab LM folder"):
        add_clone_target(pack, tmp_path)


@pytest.mark.slow
def test_a_voice_pack_carries_a_clone_target_into_its_prepared_folder(voice_pack, tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file

    from pcgtts.runtime.config import resolve_settings
    from pcgtts.runtime.lm.checkpoint import same_tokenizer_files
    from pcgtts.runtime.voicepack import read_voice
    from pcgtts.tools.prepare import prepare_builtin
    from pcgtts.train.package import CLONE_TARGET_FILE, add_clone_target

    pack = Path(shutil.copytree(voice_pack, tmp_path / "voice"))
    add_clone_target(pack, _lab_lm(tmp_path / "multi", seed=11))
    meta = read_voice(pack)
    assert CLONE_TARGET_FILE in meta["sha256"] and meta["clone_target"]["step"] == 2
    _stub_group_table(monkeypatch)
    prepare_builtin(tmp_path / "ready", pack, onnx=False, progress=False)
    models = resolve_settings({"prepared": str(tmp_path / "ready"), "backend": "torch"}).models
    assert models.clone_target == str(tmp_path / "ready" / "clone_target")
    assert same_tokenizer_files(models.target, models.clone_target)
    target, clone = (load_file(str(Path(path) / "model.safetensors")) for path in (models.target, models.clone_target))
    assert target.keys() == clone.keys()  # a plain LlamaForCausalLM like the target, with its own weights
    assert not torch.equal(target["model.embed_tokens.weight"], clone["model.embed_tokens.weight"])



def test_another_voice_folders_target_becomes_the_clone_target_as_it_is(voice_pack, tmp_path):
    from pcgtts.runtime.voicepack import read_voice
    from pcgtts.train.package import CLONE_TARGET_FILE, add_clone_target

    other = Path(shutil.copytree(voice_pack, tmp_path / "other"))
    add_clone_target(other, _lab_lm(tmp_path / "multi", seed=11))  # give it a target of its own to pass on
    donor = tmp_path / "donor"
    donor.mkdir()
    shutil.copyfile(other / CLONE_TARGET_FILE, donor / "target.safetensors")
    meta = read_voice(other)
    (donor / "voice.json").write_text(json.dumps({**meta, "target": meta["clone_target"], "sha256": {
        "target.safetensors": meta["sha256"][CLONE_TARGET_FILE]}}))
    pack = Path(shutil.copytree(voice_pack, tmp_path / "voice"))
    add_clone_target(pack, donor)
    assert (pack / CLONE_TARGET_FILE).read_bytes() == (donor / "target.safetensors").read_bytes()
    assert read_voice(pack)["clone_target"] == meta["clone_target"]
