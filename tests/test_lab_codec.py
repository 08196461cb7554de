"""Speech lab codec: a tiny X-codec2 trains (loss falls), exports in transformers' format, loads with
`Xcodec2Model.from_pretrained` and the runtime's `Codec`, and resumes at the right step."""

import json

import numpy as np
import pytest
import soundfile as sf
import torch

from pcgtts.train.codec import (CodecModelConfig, CodecTrainConfig, ReconstructionLoss, codec_forward, new_codec,
                                train_codec)

TINY = CodecModelConfig(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2, semantic_hidden=32,
                        semantic_intermediate=64)


def _corpus(root):
    """Two 1.2 s harmonic 'utterances' (real FLAC files, real manifest format)."""
    rng = np.random.default_rng(0)
    t = np.arange(int(1.2 * 16000)) / 16000
    recs = []
    for i, f0 in enumerate((140.0, 210.0)):
        audio = sum(np.sin(2 * np.pi * f0 * k * t) / k for k in range(1, 6)) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))
        audio = (0.4 * audio / np.abs(audio).max() + 0.01 * rng.standard_normal(t.size)).astype(np.float32)
        (root / "audio").mkdir(parents=True, exist_ok=True)
        sf.write(str(root / f"audio/u{i}.flac"), audio, 16000, subtype="PCM_16")
        recs.append({"id": f"u{i}", "speaker": "s", "source": "test", "variant": "original", "text": "x y z w",
                     "split": "train", "seconds": 1.2, "path": f"audio/u{i}.flac"})
    (root / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return root


def test_semonly_init_is_alive_and_learns():
    model = new_codec(TINY, seed=0)
    assert float(model.acoustic_encoder.conv2.weight.abs().sum()) == 0.0
    assert not any(p.requires_grad for p in model.acoustic_encoder.parameters())
    torch.manual_seed(0)
    feats, target = torch.randn(2, 8, 160), 0.3 * torch.sin(torch.arange(2 * 2560).view(2, 2560) * 0.05)
    loss_fn = ReconstructionLoss()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    losses = []
    for _ in range(6):
        audio, _ = codec_forward(model, feats)
        loss = loss_fn(audio, target)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert audio.abs().max() > 0  # not the dead all-zero decoder of HF's default init
    assert losses[-1] < losses[0]


def test_an_acoustic_codec_trains_its_waveform_encoder_and_matches_the_stock_encode():
    """`acoustic=True`: the acoustic encoder starts alive and learns, and the training forward's codes for
    a whole utterance are the stock `Xcodec2Model.encode`'s (the same submodules, in the same order)."""
    from dataclasses import replace

    from pcgtts.runtime.audio.features import encoder_inputs

    model = new_codec(replace(TINY, acoustic=True), seed=0)
    assert float(model.acoustic_encoder.conv2.weight.detach().abs().sum()) > 0
    assert all(p.requires_grad for p in model.acoustic_encoder.parameters())
    torch.manual_seed(0)
    feats, target = torch.randn(2, 8, 160), 0.3 * torch.sin(torch.arange(2 * 2560).view(2, 2560) * 0.05)
    before = {k: v.clone() for k, v in model.acoustic_encoder.state_dict().items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    loss_fn, losses = ReconstructionLoss(), []
    for _ in range(6):
        audio, _ = codec_forward(model, feats, target)
        loss = loss_fn(audio, target)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    assert any(not torch.equal(before[k], v) for k, v in model.acoustic_encoder.state_dict().items())

    model.eval()
    rng = np.random.default_rng(1)
    wav = (0.3 * np.sin(np.arange(12345) * 0.03) + 0.02 * rng.standard_normal(12345)).astype(np.float32)
    inputs = encoder_inputs(wav)
    with torch.no_grad():
        stock = model.encode(inputs["input_values"], inputs["input_features"], padding_mask=inputs["padding_mask"],
                             input_features_mask=inputs["input_features_mask"]).audio_codes[0, 0]
        _, ours = codec_forward(model, inputs["input_features"], inputs["input_values"][:, 0])
        _, semonly = codec_forward(model, inputs["input_features"])
    assert torch.equal(ours[0].long(), stock.long())
    assert not torch.equal(semonly[0].long(), stock.long())  # the waveform encoder is in the codes


@pytest.mark.slow  # tens of seconds on a loaded 2-core box
def test_train_export_load_and_resume(tmp_path):
    from transformers import Xcodec2Model

    from pcgtts.runtime.audio.codec import Codec

    corpus = _corpus(tmp_path / "corpus")
    cfg = CodecTrainConfig(corpus=corpus, out_dir=tmp_path / "codec", model=TINY, steps=6, batch_size=2,
                           crop_frames=8, warmup=1, log_every=1, checkpoint_minutes=60)
    first = train_codec(cfg, stop_after=3)
    assert first["step"] == 3
    second = train_codec(cfg)
    assert second["step"] == 6
    steps = [json.loads(line)["step"] for line in (tmp_path / "codec" / "loss.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert (tmp_path / "codec" / "loss.png").is_file()
    export = tmp_path / "codec" / "export"
    model = Xcodec2Model.from_pretrained(str(export)).eval()
    codes = torch.randint(0, 65536, (1, 1, 10))
    with torch.no_grad():
        audio = model.decode(audio_codes=codes).audio_values
    assert audio.shape == (1, 1, 3200)
    codec = Codec.from_pretrained(export, decode_only=False)
    wav, _ = sf.read(str(corpus / "audio/u0.flac"), dtype="float32")
    enc = codec.encode(wav)
    assert enc.shape == (wav.size // 320 + 1,) and enc.min() >= 0 and enc.max() < 65536
    assert np.allclose(codec.decode(enc), model.decode(audio_codes=torch.as_tensor(enc)[None, None]).audio_values[0, 0]
                       .detach().numpy(), atol=1e-5)


@pytest.mark.slow
def test_frozen_encoder_keeps_the_codes_and_trains_the_decoder(tmp_path):
    """Stage 2 (`--freeze-encoder`): resumed from a joint checkpoint, the encoder side (everything up
    to the quantizer) stays bit-identical, so the codes an LM trains on stop changing, while the
    decoder still learns; the freeze is sticky for later runs in the same folder."""
    from pcgtts.train.codec import ENCODER_PARTS, FROZEN_MARKER

    corpus = _corpus(tmp_path / "corpus")
    base = dict(corpus=corpus, out_dir=tmp_path / "codec", model=TINY, batch_size=2, crop_frames=8, warmup=1,
                log_every=1, checkpoint_minutes=60)
    train_codec(CodecTrainConfig(steps=2, **base))
    before = torch.load(tmp_path / "codec" / "checkpoint.pt", weights_only=False)["model"]
    train_codec(CodecTrainConfig(steps=4, freeze_encoder=True, **base))
    assert (tmp_path / "codec" / FROZEN_MARKER).is_file()
    train_codec(CodecTrainConfig(steps=5, **base))  # no flag: the marker keeps it frozen
    after = torch.load(tmp_path / "codec" / "checkpoint.pt", weights_only=False)["model"]
    encoder = [k for k in before if k.split(".")[0] in ENCODER_PARTS]
    decoder = [k for k in before if k.startswith("acoustic_decoder.")]
    assert encoder and decoder
    assert all(torch.equal(before[k], after[k]) for k in encoder)
    assert any(not torch.equal(before[k], after[k]) for k in decoder)


def test_lab_codec_acoustic_trains_the_waveform_encoder_in_the_loop(tmp_path):
    """`lab codec --acoustic`: the training loop feeds the crops' waveforms to the acoustic encoder (its
    weights move from their fresh init) and records the choice, so a semonly run cannot resume it."""
    from dataclasses import replace

    corpus = _corpus(tmp_path / "corpus")
    acoustic = replace(TINY, acoustic=True)
    cfg = CodecTrainConfig(corpus=corpus, out_dir=tmp_path / "codec", model=acoustic, steps=2, batch_size=2,
                           crop_frames=8, warmup=1, log_every=1, checkpoint_minutes=60)
    train_codec(cfg)
    state = torch.load(tmp_path / "codec" / "checkpoint.pt", weights_only=False)
    assert state["model_config"]["acoustic"] is True
    fresh = new_codec(acoustic, seed=0).state_dict()
    moved = [k for k in fresh if k.startswith("acoustic_encoder.") and not torch.equal(fresh[k], state["model"][k])]
    assert moved
    with pytest.raises(ValueError, match="another model config"):
        train_codec(replace(cfg, model=TINY, steps=3))


def test_crops_from_the_feature_cache_equal_features_made_per_crop(tmp_path):
    """CropSampler computes each utterance's features once; a crop equals what encoder_inputs of the whole
    utterance, sliced, gives (the pre-cache path)."""
    import random

    from pcgtts.runtime.audio.features import encoder_inputs
    from pcgtts.train.codec import CropSampler

    corpus = _corpus(tmp_path / "corpus")
    sampler = CropSampler(corpus, crop_frames=8)
    feats, waves = sampler.batch(6, random.Random(3))
    rng = random.Random(3)
    for b in range(6):
        rec = sampler.records[rng.randrange(len(sampler.records))]
        audio, _ = sf.read(str(corpus / rec["path"]), dtype="int16")
        full = encoder_inputs(audio.astype(np.float32) / 32768.0)
        t0 = rng.randrange(0, full["input_features"].shape[1] - 8 + 1)
        assert torch.equal(feats[b], full["input_features"][0, t0:t0 + 8])
        assert torch.equal(waves[b], full["input_values"][0, 0, t0 * 320:(t0 + 8) * 320])


def test_the_decoder_stage_trains_on_the_stock_codes_of_whole_utterances_made_once(tmp_path, monkeypatch):
    """With the encoder frozen, each utterance's codes are made once (kept across resumes in CODES_FILE) and are
    exactly what the runtime's `Codec.encode` gives the whole utterance; a step runs the decoder alone."""
    from dataclasses import replace

    import pcgtts.train.codec as codec_mod
    from pcgtts.runtime.audio.codec import Codec
    from pcgtts.train.codec import CODES_FILE

    corpus = _corpus(tmp_path / "corpus")
    base = dict(corpus=corpus, out_dir=tmp_path / "codec", model=replace(TINY, acoustic=True), batch_size=2,
                crop_frames=8, warmup=1, log_every=1, checkpoint_minutes=60)
    train_codec(CodecTrainConfig(steps=1, **base))  # joint: the codes still move
    assert not (tmp_path / "codec" / CODES_FILE).exists()
    calls = []
    real = codec_mod._quantize
    monkeypatch.setattr(codec_mod, "_quantize", lambda *a: calls.append(a[1].shape) or real(*a))
    train_codec(CodecTrainConfig(steps=4, freeze_encoder=True, **base))
    assert len(calls) == 2 and all(shape[:2] == (1, 61) for shape in calls)  # both whole utterances, once each
    codes = dict(np.load(tmp_path / "codec" / CODES_FILE))
    assert sorted(codes) == ["u0", "u1"]
    stock = Codec.from_pretrained(tmp_path / "codec" / "export", decode_only=False)
    for uid, got in codes.items():
        wav, _ = sf.read(str(corpus / f"audio/{uid}.flac"), dtype="float32")
        assert np.array_equal(got, stock.encode(wav))
    calls.clear()
    train_codec(CodecTrainConfig(steps=6, **base))  # resumed: no utterance is encoded twice
    assert calls == []


def test_max_minutes_stops_checkpointed_and_the_device_is_validated(tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    cfg = CodecTrainConfig(corpus=corpus, out_dir=tmp_path / "codec", model=TINY, steps=50, batch_size=2,
                           crop_frames=8, warmup=1, log_every=1, checkpoint_minutes=60, max_minutes=1e-9)
    out = train_codec(cfg)
    assert out["step"] == 1 and (tmp_path / "codec" / "checkpoint.pt").is_file()
    assert train_codec(cfg)["step"] == 2  # resumes, then stops again
    with pytest.raises(ValueError, match="device"):
        CodecTrainConfig(corpus=corpus, out_dir=tmp_path / "x", device="tpu")
    with pytest.raises(ValueError, match="max_minutes"):
        CodecTrainConfig(corpus=corpus, out_dir=tmp_path / "x", max_minutes=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            train_codec(CodecTrainConfig(corpus=corpus, out_dir=tmp_path / "y", model=TINY, device="cuda",
                                         crop_frames=8))


def test_audio_pack_round_trips_within_its_budget(tmp_path):
    """pack_audio keeps every speaker under a small budget and leaves held-out splits out; unpack_audio
    gives a corpus the codec trains from, with audio close to the original (Opus)."""
    from pcgtts.train.codec import CropSampler
    from pcgtts.train.corpus import pack_audio, read_manifest, unpack_audio

    corpus = _corpus(tmp_path / "corpus")
    rows = read_manifest(corpus)
    for i in range(2, 6):  # two more speakers, one of them held out
        src = corpus / rows[i % 2]["path"]
        rel = f"audio/v{i}.flac"
        (corpus / rel).write_bytes(src.read_bytes())
        rows.append({**rows[i % 2], "id": f"v{i}", "speaker": f"s{i % 3}", "path": rel,
                     "split": "heldout_speakers" if i == 5 else "codec_only" if i == 4 else "train"})
    (corpus / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    full = pack_audio(corpus, tmp_path / "all.npz")
    assert full["utterances"] == 5 and full["speakers"] == 4  # the held-out one is not packed
    with np.load(tmp_path / "all.npz") as data:
        audio_bytes = sum(data[f"u{n}"].size for n in range(5))
    small = pack_audio(corpus, tmp_path / "small.npz", max_bytes=audio_bytes - 1)  # one utterance short
    assert small["speakers"] == 4 and small["utterances"] == 4
    manifest = unpack_audio(tmp_path / "all.npz", tmp_path / "unpacked")
    got = {r["id"]: r for r in read_manifest(manifest)}
    assert set(got) == {"u0", "u1", "v2", "v3", "v4"} and all(r["packed"] == "opus" for r in got.values())
    a, _ = sf.read(str(corpus / "audio/u0.flac"), dtype="float32")
    b, rate = sf.read(str(tmp_path / "unpacked" / got["u0"]["path"]), dtype="float32")
    assert rate == 16000 and b.size == a.size
    assert np.corrcoef(a, b)[0, 1] > 0.9
    assert len(CropSampler(tmp_path / "unpacked", crop_frames=8).records) == 5


def test_init_from_a_frozen_voice_codec_freezes_a_semonly_run_but_not_an_acoustic_one(tmp_path):
    """The built-in voice's codec records a frozen encoder (its LM was trained on those codes): a semonly run
    started from it inherits the freeze; an --acoustic run must not, or its zeroed waveform encoder would stay
    frozen at zero."""
    import hashlib
    from dataclasses import replace

    from safetensors.torch import save_file

    from pcgtts.train.codec import FROZEN_MARKER
    from pcgtts.train.package import FORMAT, VERSION

    corpus = _corpus(tmp_path / "corpus")
    voice = tmp_path / "voice"
    voice.mkdir()
    save_file({k: v.contiguous() for k, v in new_codec(TINY, seed=1).state_dict().items()},
              str(voice / "codec.safetensors"))
    digest = hashlib.sha256((voice / "codec.safetensors").read_bytes()).hexdigest()
    (voice / "voice.json").write_text(json.dumps({
        "format": FORMAT, "version": VERSION, "name": "t", "sha256": {"codec.safetensors": digest},
        "codec": {"encoder_frozen": {"frozen_at_step": 0, "parts": ["semantic_encoder", "quantizer"]}}}))
    base = CodecTrainConfig(corpus=corpus, out_dir=tmp_path / "semonly", model=TINY, steps=1, batch_size=2,
                            crop_frames=8, warmup=1, log_every=1, checkpoint_minutes=60, init_from=voice)
    train_codec(base)
    assert (tmp_path / "semonly" / FROZEN_MARKER).is_file()
    acoustic = replace(base, out_dir=tmp_path / "acoustic", model=replace(TINY, acoustic=True))
    train_codec(acoustic)
    assert not (tmp_path / "acoustic" / FROZEN_MARKER).is_file()
    state = torch.load(tmp_path / "acoustic" / "checkpoint.pt", weights_only=False)["model"]
    assert state["acoustic_encoder.conv2.weight"].abs().sum() > 0  # trained away from its zeros
