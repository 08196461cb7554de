"""The built-in voice's committed form: packing the lab's folders into compact fp16 factorised files
and expanding them back into the released layouts gives the same model (to fp16 rounding), a
layout-checked draft, a loadable codec, re-keyed heads and a group table."""

import json
from pathlib import Path

import pytest
import torch

from pcgtts.train.lm import LMModelConfig, build_model, lab_tokenizer
from pcgtts.train.progress import save_checkpoint


def _lab_folders(root):
    from dataclasses import asdict

    from pcgtts.tools.demo_codec import write_demo_codec

    tok = lab_tokenizer()
    target_cfg = LMModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    draft_cfg = LMModelConfig(**{**asdict(target_cfg), "num_layers": 1})
    for name, cfg, extra in (("lm", target_cfg, {}), ("draft", draft_cfg, {"layers": [1]})):
        model = build_model(cfg, tok, seed=3)
        (root / name).mkdir(parents=True)
        save_checkpoint(root / name / "checkpoint.pt", {"model": model.state_dict(), "model_config": asdict(cfg),
                                                        "step": 7, **extra})
    return write_demo_codec(root / "codec", seed=0)


@pytest.mark.slow  # the group table over 65,536 codes takes a while on 2 cores
def test_pack_and_expand_round_trip(tmp_path):
    from pcgtts.runtime.lm.checkpoint import load_speech_embeddings
    from pcgtts.runtime.lm.draft import check_draft_layout
    from pcgtts.runtime.lm.heads import MTPHeads
    from pcgtts.runtime.lm.torch_lm import TorchLM
    from pcgtts.train.package import expand_voice, pack_voice, read_voice
    from pcgtts.train.progress import load_checkpoint

    codec = _lab_folders(tmp_path)
    heads = MTPHeads(2, 64, "stale-fingerprint").save(tmp_path / "heads.safetensors")
    pack = pack_voice(tmp_path / "voice", tmp_path / "lm", tmp_path / "draft", codec, name="test", heads_file=heads,
                      mean_group_size=20, group_cap=64, figures={"stoi": 0.5}, settings={"temperature": 0.2})
    meta = read_voice(pack)
    assert meta["target"]["step"] == 7 and meta["draft"]["layers"] == [1] and meta["figures"] == {"stoi": 0.5}
    assert meta["settings"] == {"temperature": 0.2}
    paths = expand_voice(pack, tmp_path / "expanded", progress=False)

    # The expanded target is the factorised model, materialised (fp16 rounding only).
    tok = lab_tokenizer()
    state = load_checkpoint(tmp_path / "lm" / "checkpoint.pt")
    model = build_model(LMModelConfig(**state["model_config"]), tok, 0)
    model.load_state_dict({k: v.half().float() for k, v in state["model"].items()})
    expected = model.materialise()
    target = TorchLM.load(paths["target"], max_length=64)
    ids = torch.tensor([[1, 5, 9, target.vocab.speech_offset + 17, target.vocab.speech_offset + 4000]])
    with torch.no_grad():
        ref = expected(ids).logits[0, :, target.vocab.head_rows()]
    out = target.forward(ids[0])
    assert torch.allclose(out, ref, atol=1e-3)
    check_draft_layout(paths["target"], target.tokenizer, paths["draft"])
    assert json.loads((paths["draft"] / "config.json").read_text())["pcgtts_draft"]["layers"] == [1]
    _, _, fingerprint = load_speech_embeddings(paths["target"])
    assert MTPHeads.load(paths["target"] / "mtp_heads.safetensors", fingerprint=fingerprint).num_heads == 2
    assert paths["groups"].is_file() and (paths["codec"] / "config.json").is_file()

    # An EAGLE draft added to the committed voice afterwards is checksummed and re-keyed on expansion.
    from pcgtts.runtime.lm.eagle import EAGLE_FILE, EagleDraft
    from pcgtts.train.package import add_to_voice

    EagleDraft(target.model.args, "stale-fingerprint").save(tmp_path / "eagle.safetensors")
    add_to_voice(pack, tmp_path / "eagle.safetensors", EAGLE_FILE)
    assert EAGLE_FILE in read_voice(pack)["sha256"]
    again = expand_voice(pack, tmp_path / "expanded2", progress=False)
    EagleDraft.load(again["target"] / EAGLE_FILE, target.model, fingerprint=fingerprint)

    # A later lab run starts from the committed weights (`--init-from`), refusing another size.
    from dataclasses import asdict

    from pcgtts.runtime.voicepack import init_weights

    fresh = build_model(LMModelConfig(**state["model_config"]), tok, 1)
    init_weights(fresh, pack, "target", state["model_config"])
    assert torch.equal(fresh.digits, state["model"]["digits"].half().float())
    with pytest.raises(ValueError, match="choose the matching --size"):
        init_weights(build_model(LMModelConfig.tiny(), tok, 1), pack, "target", asdict(LMModelConfig.tiny()))

    # A damaged file is named before anything is expanded; a run that starts from the target alone
    # needs only the target's file intact (what a GPU machine is sent).
    data = bytearray((pack / "draft.safetensors").read_bytes())
    data[-1] ^= 1
    (pack / "draft.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="draft.safetensors is missing or damaged"):
        read_voice(pack)
    (pack / "codec.safetensors").unlink()
    init_weights(fresh, pack, "target", state["model_config"])
    data = bytearray((pack / "target.safetensors").read_bytes())
    data[-1] ^= 1
    (pack / "target.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="target.safetensors is missing or damaged"):
        init_weights(fresh, pack, "target", state["model_config"])


@pytest.mark.slow
@pytest.mark.shipped_voice
def test_the_shipped_voice_is_the_default_and_speaks(tmp_path, monkeypatch):
    """When a trained voice is committed, `from_pretrained()` with no model expands and uses it:
    intact checksums, a target/draft/codec/groups set that loads, audio out."""
    from pcgtts import Synthesizer
    from pcgtts.builtin import VOICE_DIR, builtin_models
    from pcgtts.train.package import read_voice

    if not (VOICE_DIR / "voice.json").is_file():
        pytest.skip("no trained voice is committed in pcgtts/voice")
    read_voice(VOICE_DIR)
    monkeypatch.setenv("PCGTTS_CACHE", str(tmp_path))
    models = builtin_models()
    assert "voice-" in models.target and models.groups.endswith(".pcg")
    synth = Synthesizer.from_pretrained(seed=0, max_new_tokens=40)
    audio = synth.synthesize("Hello world.")
    assert audio.size >= 320 and abs(audio).max() > 0
    for row in synth.voices():  # every preset, and every alias, loads and speaks a sentence
        audio = synth.synthesize("Every preset voice says this sentence.", voice=row["name"])
        assert audio.size >= 320 and abs(audio).max() > 0, row["name"]


def test_replace_codec_keeps_the_codes_the_target_was_trained_on(tmp_path):
    """A decoder fine-tuned with the encoder frozen replaces the voice's codec (checksummed); a codec
    whose encoder moved is refused before the voice is touched. The voice's own settings are set
    apart, checked, and survive the swap."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pcgtts.train.package import pack_voice, read_voice, replace_codec

    codec = _lab_folders(tmp_path)
    pack = pack_voice(tmp_path / "voice", tmp_path / "lm", tmp_path / "draft", codec, name="test")
    before = (pack / "codec.safetensors").read_bytes()

    def retrained(name, key_part):
        out = tmp_path / name / "export"
        shutil.copytree(codec, out)
        state = load_file(str(out / "model.safetensors"))
        key = next(k for k in state if k.startswith(key_part) and state[k].dtype.is_floating_point)
        state[key] = state[key] + 0.5
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out, key

    moved, _ = retrained("moved", "fc_encoder.")
    with pytest.raises(ValueError, match="encoder differs"):
        replace_codec(pack, moved)
    assert (pack / "codec.safetensors").read_bytes() == before and not (pack / "codec.safetensors.tmp").exists()

    tuned, key = retrained("tuned", "acoustic_decoder.")
    replace_codec(pack, tuned)
    meta = read_voice(pack)  # every checksum still holds
    new = load_file(str(pack / "codec.safetensors"))
    assert torch.equal(new[key], load_file(str(tuned / "model.safetensors"))[key].half())
    assert "codec.safetensors" in meta["sha256"] and (pack / "codec.safetensors").read_bytes() != before

    # What the voice is played at when the user names nothing: recorded, checked, kept by a codec swap.
    from pcgtts.builtin import voice_settings
    from pcgtts.train.package import set_settings

    set_settings(pack, {"temperature": 0.2})
    for bad, needle in (({"temperature": -1.0}, "temperature"), ({"codec": "x"}, "not codec")):
        with pytest.raises(ValueError, match=needle):
            set_settings(pack, bad)
    replace_codec(pack, codec)
    assert voice_settings(pack) == {"temperature": 0.2} and read_voice(pack)["codec"]["config"]
    set_settings(pack, {})
    assert voice_settings(pack) == {}

    # The size of the group table the voice builds when expanded: checked, the cap kept unless given.
    from pcgtts.train.package import set_group_size

    set_group_size(pack, 48)
    assert read_voice(pack)["groups"] == {"mean_size": 48, "cap": 512}
    for size, cap, needle in ((0, None, "mean group size"), (600, None, "cap=512"), (40, 0, "group cap")):
        with pytest.raises(ValueError, match=needle):
            set_group_size(pack, size, cap)
    assert read_voice(pack)["groups"] == {"mean_size": 48, "cap": 512}
    set_group_size(pack, 20, 64)
    assert read_voice(pack)["groups"] == {"mean_size": 20, "cap": 64}


def test_replace_lm_swaps_target_and_draft_and_drops_what_the_old_target_trained(tmp_path):
    """A retrained target and its draft replace the voice's (checksummed), keeping codec, settings and
    group size; the heads trained on the old target's states are removed, not left to mislead; a
    missing folder is refused before the voice is touched."""
    from dataclasses import asdict

    from pcgtts.runtime.lm.heads import HEADS_FILE, MTPHeads
    from pcgtts.train.package import pack_voice, read_voice, replace_lm

    codec = _lab_folders(tmp_path)
    heads = MTPHeads(2, 64, "old-target").save(tmp_path / "heads.safetensors")
    pack = pack_voice(tmp_path / "voice", tmp_path / "lm", tmp_path / "draft", codec, name="test", heads_file=heads,
                      mean_group_size=20, group_cap=64, settings={"temperature": 0.2})
    before = {p.name: p.read_bytes() for p in pack.iterdir()}

    with pytest.raises(ValueError, match="cannot read checkpoint"):
        replace_lm(pack, tmp_path / "lm", tmp_path / "missing")
    assert {p.name: p.read_bytes() for p in pack.iterdir()} == before

    new = tmp_path / "lm2"
    new.mkdir()
    cfg = LMModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    save_checkpoint(new / "checkpoint.pt", {"model": build_model(cfg, lab_tokenizer(), seed=9).state_dict(),
                                            "model_config": asdict(cfg), "step": 99})
    assert replace_lm(pack, new, tmp_path / "draft") == [HEADS_FILE]
    meta = read_voice(pack)  # every checksum holds
    assert meta["target"]["step"] == 99 and meta["draft"]["layers"] == [1]
    assert (pack / "target.safetensors").read_bytes() != before["target.safetensors"]
    assert (pack / "codec.safetensors").read_bytes() == before["codec.safetensors"]
    assert not (pack / HEADS_FILE).exists() and HEADS_FILE not in meta["sha256"]
    assert meta["settings"] == {"temperature": 0.2} and meta["groups"] == {"mean_size": 20, "cap": 64}
    assert not list(pack.glob("*.tmp"))


def test_pack_voice_refuses_bad_settings_before_writing(tmp_path):
    from pcgtts.train.package import pack_voice

    codec = _lab_folders(tmp_path)
    with pytest.raises(ValueError, match="temperature"):
        pack_voice(tmp_path / "voice", tmp_path / "lm", tmp_path / "draft", codec, name="t",
                   settings={"temperature": -0.5})
    assert not (tmp_path / "voice").exists() and not (tmp_path / "voice.tmp").exists()


def test_a_new_expansion_of_the_builtin_voice_names_the_earlier_ones(tmp_path, monkeypatch, caplog):
    """A changed voice.json expands into a new cache folder; the folders of earlier expansions are named
    with their size, once (at the expansion), and left in place (another install may use them)."""
    import logging

    from pcgtts import builtin

    pack = tmp_path / "voice"
    pack.mkdir()
    (pack / "voice.json").write_text('{"name": "v2"}')
    root = tmp_path / "cache"
    old = root / "voice-0123456789abcdef"
    (old / "target").mkdir(parents=True)
    (old / "target" / "model.safetensors").write_bytes(b"\0" * 3_000_000)
    (root / "demo-v1").mkdir()  # not a voice expansion

    def fake_expand(pack_dir, cache):
        paths = {"target": cache / "target", "draft": cache / "draft", "codec": cache / "codec",
                 "groups": cache / "groups.pcg"}
        for name, path in paths.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir() if name != "groups" else path.write_bytes(b"")
        return paths

    monkeypatch.setattr("pcgtts.train.package.expand_voice", fake_expand)
    with caplog.at_level(logging.WARNING, logger="pcgtts.builtin"):
        models = builtin.trained_voice(pack, root)
    notes = [r.getMessage() for r in caplog.records if "earlier expansion" in r.getMessage()]
    assert len(notes) == 1 and str(old) in notes[0] and "(3 MB)" in notes[0]
    assert str(root / "demo-v1") not in notes[0] and Path(models.target).parent.name not in notes[0]
    assert old.is_dir()

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pcgtts.builtin"):
        assert builtin.trained_voice(pack, root) == models  # already expanded: nothing to say
    assert not caplog.records
