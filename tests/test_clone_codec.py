"""A second codec decoder for voices with a reference (`ModelPaths.clone_codec`): speech prompted with
reference codes (a preset, a cloned voice, ref_audio) is decoded by it, the model's own voice by
`codec`; the encoder is the same. Settings, loading, the stream worker, the voice pack and the prepared
folder carry it."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pcgtts.runtime.audio.voice import Voice
from pcgtts.runtime.config import SynthesisConfig

REFERENCE = Voice(np.arange(40, dtype=np.int64) * 7 % 512, "A short reference sentence.")
TEXT = "Hello there."


def perturbed_codec(source: Path, out: Path, seed: int = 1) -> Path:
    """A copy of the X-codec2 folder `source` whose decoder weights differ (its encoder the same)."""
    import torch
    from safetensors.torch import load_file, save_file

    from pcgtts.train.codec import ENCODER_PARTS

    shutil.copytree(source, out)
    state = load_file(str(source / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    for key, value in state.items():
        if key.split(".")[0] not in ENCODER_PARTS and value.is_floating_point():
            state[key] = value + 0.05 * torch.randn(value.shape, generator=generator)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def clone_codec_dir(demo_codec_dir, tmp_path_factory):
    return perturbed_codec(demo_codec_dir, tmp_path_factory.mktemp("clone") / "codec")


@pytest.fixture(scope="module")
def tiny_target(tiny_lm_factory):
    return tiny_lm_factory()


def _synth(target, codec, clone_codec=None):
    from pcgtts.runtime.synthesizer import Synthesizer

    config = SynthesisConfig(seed=0, min_tokens=30, tokens_per_char=2.0)
    return Synthesizer.from_pretrained(target, codec=codec, clone_codec=clone_codec, policy="ar", max_length=512,
                                       config=config)


@pytest.fixture(scope="module")
def synths(tiny_target, demo_codec_dir, clone_codec_dir):
    """The same target three ways: codec only, codec + clone codec, and the clone codec as the codec."""
    return {"codec": _synth(tiny_target, demo_codec_dir),
            "both": _synth(tiny_target, demo_codec_dir, clone_codec_dir),
            "clone": _synth(tiny_target, clone_codec_dir)}


def test_the_perturbed_codec_decodes_differently(synths):
    codes = np.arange(30, dtype=np.int64)
    assert not np.allclose(synths["codec"].codec.decode(codes), synths["clone"].codec.decode(codes), atol=1e-4)


def test_the_models_own_voice_is_decoded_by_the_codec(synths):
    plain = synths["codec"].synthesize(TEXT)
    assert len(plain) and np.array_equal(synths["both"].synthesize(TEXT), plain)
    assert np.array_equal(synths["both"].synthesize(TEXT, voice="default"), plain)


def test_a_voice_with_a_reference_is_decoded_by_the_clone_codec(synths):
    with_clone = synths["both"].synthesize(TEXT, voice=REFERENCE)
    assert np.allclose(with_clone, synths["clone"].synthesize(TEXT, voice=REFERENCE), atol=1e-5)
    assert not np.allclose(with_clone, synths["codec"].synthesize(TEXT, voice=REFERENCE), atol=1e-4)


def test_without_a_clone_codec_every_voice_is_decoded_by_the_codec(synths):
    assert synths["codec"].clone_codec is None
    from pcgtts.runtime.stream_worker import window_codec

    assert window_codec(synths["codec"], np.arange(5)) is synths["codec"].codec
    assert window_codec(synths["both"], np.arange(5)) is synths["both"].clone_codec
    assert window_codec(synths["both"], np.zeros(0, np.int64)) is synths["both"].codec


def test_a_clone_codec_at_the_codecs_path_loads_once(tiny_target, demo_codec_dir):
    synth = _synth(tiny_target, demo_codec_dir, str(demo_codec_dir) + "/")
    assert synth.clone_codec is synth.codec


def test_a_missing_clone_codec_is_refused_before_loading(tiny_target, demo_codec_dir, tmp_path, monkeypatch):
    import pcgtts.runtime.lm.loader as loader

    def refuse(*args, **kwargs):
        raise AssertionError("a model loaded before the bad path was reported")

    monkeypatch.setattr(loader, "load_lm", refuse)
    with pytest.raises(ValueError, match="clone_codec model directory not found: .*nowhere"):
        _synth(tiny_target, demo_codec_dir, tmp_path / "nowhere")
    with pytest.raises(ValueError, match="clone_codec .*: not an X-codec2 folder"):
        _synth(tiny_target, demo_codec_dir, tiny_target)  # an LM checkpoint in its place


def test_the_setting_comes_from_a_config_file_and_the_cli(tmp_path):
    from helpers import assert_a_model_path_setting

    assert_a_model_path_setting(tmp_path, "clone_codec", "c2")


def test_the_built_in_voice_refuses_a_clone_codec_without_a_target():
    from pcgtts.builtin import with_builtin_models
    from pcgtts.runtime.config import resolve_settings

    with pytest.raises(ValueError, match="clone_codec given without a target"):
        with_builtin_models(resolve_settings({"clone_codec": "x"}))


def test_a_prepared_folder_names_its_clone_codec(tmp_path):
    from pcgtts.runtime.prepared import checkpoint_paths, onnx_paths

    for name in ("target", "codec", "clone_codec"):
        (tmp_path / name).mkdir()
    paths = checkpoint_paths(tmp_path)
    assert paths["clone_codec"] == str(tmp_path / "clone_codec")
    assert onnx_paths(tmp_path, paths)["clone_codec"] == str(tmp_path / "onnx-int8" / "clone_codec")
    (tmp_path / "clone_codec").rmdir()
    assert "clone_codec" not in checkpoint_paths(tmp_path)


# --- the built-in voice's pack: clone_codec.safetensors, checksummed, expanded beside the codec ----------

@pytest.fixture(scope="module")
def voice_pack(tmp_path_factory, demo_codec_dir):
    """A small committed voice (tiny factorised target and draft, the demo codec)."""
    from dataclasses import asdict

    from pcgtts.train.lm import LMModelConfig, build_model, lab_tokenizer
    from pcgtts.train.package import pack_voice
    from pcgtts.train.progress import save_checkpoint

    root = tmp_path_factory.mktemp("lab")
    cfg = LMModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    for name, extra in (("lm", {}), ("draft", {"layers": [0, 1]})):
        (root / name).mkdir()
        save_checkpoint(root / name / "checkpoint.pt", {"model": build_model(cfg, lab_tokenizer(), seed=3).state_dict(),
                                                        "model_config": asdict(cfg), "step": 1, **extra})
    return pack_voice(root / "voice", root / "lm", root / "draft", demo_codec_dir, name="test")


def _stub_group_table(monkeypatch):
    """The group table stubbed (building one over 65,536 codes is slow)."""
    import pcgtts.export.group_table as group_table
    import pcgtts.groups.build as build

    class Table:
        def save(self, path):
            Path(path).write_bytes(b"")

    monkeypatch.setattr(build, "theta_for_mean_size", lambda *args: 0.5)
    monkeypatch.setattr(group_table, "build_groups_for_model", lambda *args, **kwargs: Table())


def _expand_without_groups(pack, out, monkeypatch):
    from pcgtts.train.package import expand_voice

    _stub_group_table(monkeypatch)
    return expand_voice(pack, out, progress=False)


@pytest.mark.slow  # expands a voice pack / exports a graph: seconds each
def test_a_voice_pack_carries_a_clone_codec_checksummed_and_expands_it(voice_pack, clone_codec_dir, demo_codec_dir,
                                                                       tmp_path, monkeypatch):
    from safetensors import safe_open

    from pcgtts.runtime.audio.codec import Codec
    from pcgtts.runtime.voicepack import read_voice
    from pcgtts.train.codec import ENCODER_PARTS
    from pcgtts.train.package import CLONE_CODEC_FILE, add_clone_codec

    pack = Path(shutil.copytree(voice_pack, tmp_path / "voice"))
    assert "clone_codec" not in _expand_without_groups(pack, tmp_path / "plain", monkeypatch)
    add_clone_codec(pack, clone_codec_dir)
    meta = read_voice(pack)
    assert CLONE_CODEC_FILE in meta["sha256"] and meta["clone_codec"]["encoder"] == "codec"
    with safe_open(str(pack / CLONE_CODEC_FILE), framework="pt") as f:  # the decoder side only, fp16
        keys = list(f.keys())
        assert keys and not any(k.split(".")[0] in ENCODER_PARTS for k in keys)
        assert {str(f.get_tensor(k).dtype) for k in keys} == {"torch.float16"}
    paths = _expand_without_groups(pack, tmp_path / "expanded", monkeypatch)
    codes = np.arange(30, dtype=np.int64)
    expanded = Codec.from_pretrained(paths["clone_codec"], decode_only=True).decode(codes)
    assert np.allclose(expanded, Codec.from_pretrained(clone_codec_dir, decode_only=True).decode(codes), atol=2e-2)
    assert not np.allclose(expanded, Codec.from_pretrained(paths["codec"], decode_only=True).decode(codes), atol=2e-2)

    damaged = pack / CLONE_CODEC_FILE
    damaged.write_bytes(damaged.read_bytes()[:-1] + bytes([damaged.read_bytes()[-1] ^ 1]))
    with pytest.raises(ValueError, match=r"clone_codec\.safetensors is missing or damaged"):
        read_voice(pack)


def test_a_clone_codec_with_another_encoder_is_refused_and_the_voice_kept(voice_pack, tmp_path):
    from pcgtts.tools.demo_codec import write_demo_codec
    from pcgtts.train.package import add_clone_codec

    pack = Path(shutil.copytree(voice_pack, tmp_path / "voice"))
    before = (pack / "voice.json").read_text()
    with pytest.raises(ValueError, match="its encoder differs from the voice's"):
        add_clone_codec(pack, write_demo_codec(tmp_path / "other", seed=5))
    assert (pack / "voice.json").read_text() == before and not list(pack.glob("clone_codec*"))


@pytest.mark.slow  # whole preparations: seconds
def test_the_built_in_voice_with_a_clone_codec_is_prepared_with_it(voice_pack, clone_codec_dir, tmp_path,
                                                                  monkeypatch):
    from pcgtts.runtime.config import resolve_settings
    from pcgtts.tools.prepare import prepare_builtin
    from pcgtts.train.package import add_clone_codec

    pack = Path(shutil.copytree(voice_pack, tmp_path / "voice"))
    add_clone_codec(pack, clone_codec_dir)
    _stub_group_table(monkeypatch)
    prepare_builtin(tmp_path / "ready", pack, onnx=False, progress=False)
    models = resolve_settings({"prepared": str(tmp_path / "ready"), "backend": "torch"}).models
    assert models.clone_codec == str(tmp_path / "ready" / "clone_codec")
    assert (Path(models.clone_codec) / "model.safetensors").is_file()


# --- a user's checkpoint: `pcgtts prepare --checkpoint C --codec X --clone-codec Y` -----------------------

def test_a_prepared_checkpoint_carries_its_clone_codec(tiny_models, clone_codec_dir, tmp_path, capsys):
    from pcgtts.cli import main
    from pcgtts.runtime.config import resolve_settings
    from pcgtts.tools.prepare import CheckpointPreparation, prepare_checkpoint

    target, codec, out = str(tiny_models["target"]), str(tiny_models["codec"]), tmp_path / "out"
    for flags, message in ((["--clone-codec", str(clone_codec_dir)], "--clone-codec need --checkpoint"),
                           (["--checkpoint", target, "--codec", codec, "--clone-codec", str(tmp_path / "missing"),
                             "--out", str(out)], "--clone-codec .*missing: folder not found"),
                           (["--checkpoint", target, "--codec", codec, "--clone-codec", target, "--out", str(out)],
                            "--clone-codec .*: not an X-codec2 folder")):
        assert main(["prepare", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and __import__("re").search(message, err), (flags, err)
    assert not out.exists()
    prep = CheckpointPreparation(tiny_models["target"], tiny_models["codec"], draft_layers=1, onnx=False,
                                 clone_codec=clone_codec_dir)
    assert prepare_checkpoint(prep, out, progress=False)["clone_codec"] == "made"
    models = resolve_settings({"prepared": str(out)}).models
    assert models.clone_codec == str(out / "clone_codec") and models.codec == str(out / "codec")
    assert (out / "clone_codec" / "model.safetensors").read_bytes() == (clone_codec_dir / "model.safetensors").read_bytes()


@pytest.mark.slow  # expands a voice pack / exports a graph: seconds each
def test_the_clone_codec_exports_for_onnxruntime_like_the_codec(clone_codec_dir, tiny_target, demo_codec_dir,
                                                               tmp_path):
    from pcgtts.runtime.audio.codec import Codec
    from pcgtts.runtime.audio.onnx_codec import OrtCodec, is_exported_codec
    from pcgtts.tools.prepare import export_for_onnxruntime

    export_for_onnxruntime("clone_codec", clone_codec_dir, tmp_path / "clone_codec")
    assert is_exported_codec(tmp_path / "clone_codec")
    codes = np.arange(30, dtype=np.int64)
    assert np.allclose(OrtCodec(tmp_path / "clone_codec").decode(codes),
                       Codec.from_pretrained(clone_codec_dir, decode_only=True).decode(codes), atol=1e-3)
    # an exported decoder folder runs on onnxruntime, as for --codec
    assert isinstance(_synth(tiny_target, demo_codec_dir, tmp_path / "clone_codec").clone_codec, OrtCodec)


def test_the_server_passes_the_clone_codec_to_the_runtime():
    from pcgtts.runtime.config import ModelPaths
    from pcgtts.serve.config import ServerConfig

    settings = ServerConfig(models=ModelPaths(target="t", codec="c", clone_codec="c2")).runtime_settings()
    assert (settings["codec"], settings["clone_codec"]) == ("c", "c2")
