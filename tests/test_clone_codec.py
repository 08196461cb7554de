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


def test_the_setting_comes_from_a_config_file_and_the_cli(tmp_path):
    from pcgtts.cli import build_parser
    from pcgtts.cli.commands import resolve_settings_from_flags
    from pcgtts.runtime.config import read_config_file, resolve_settings

    (tmp_path / "settings.toml").write_text('[models]\ntarget = "t"\ncodec = "c"\nclone_codec = "c2"\n')
    assert read_config_file(tmp_path / "settings.toml")["clone_codec"] == str(tmp_path / "c2")
    assert resolve_settings({"clone_codec": "x"}).models.clone_codec == "x"
    args = build_parser().parse_args(["speak", "hi", "--target", "t", "--codec", "c", "--clone-codec", "c2",
                                      "--out", str(tmp_path / "o.wav")])
    assert resolve_settings_from_flags(args).models.clone_codec == "c2"


def test_the_built_in_voice_refuses_a_clone_codec_without_a_target():
    from pcgtts.builtin import with_builtin_models
    from pcgtts.runtime.config import resolve_settings

    with pytest.raises(ValueError, match="clone_codec given without a target"):
        with_builtin_models(resolve_settings({"clone_codec": "x"}))
