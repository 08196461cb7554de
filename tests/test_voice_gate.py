"""The release gate of `pcgtts train package`: a new voice worse than the shipped one (WER, identity,
draft acceptance, a dropped preset) is refused with one line and the shipped folder untouched;
a voice that is not worse goes in with the comparison in voice.json and the model card;
--accept-worse lets a worse one through and records why."""

import json

import numpy as np
import pytest

from pcgtts.cli import build_parser
from pcgtts.quality.gate import (GateConfig, GateRefused, SynthesizerRunner, check_gate, compare, measure,
                                 run_gate)
from pcgtts.runtime.voicepack import FORMAT, VERSION

PRESETS = ("heart", "slt", "rms")


class FakeVoice:
    """A voice whose 'audio' spells what it says: the fake judges read it back. `flaws` degrade it:
    "mumbles" (the default voice drops every other word), "blurs" (slt sounds like heart),
    "slow_drafts" (acceptance 0.3 lower), "no_eagle", "drops_rms"."""

    def __init__(self, flaws=()):
        self.flaws = set(flaws)
        self.presets = tuple(p for p in PRESETS if not ("drops_rms" in self.flaws and p == "rms"))

    def speak(self, text, voice, seed):
        words = text.split()
        if voice == "default" and "mumbles" in self.flaws:
            words = words[::2]
        sounds_like = "heart" if voice == "slt" and "blurs" in self.flaws else voice
        return np.frombuffer(f"{sounds_like}|{seed}|{' '.join(words)}".encode(), np.uint8).astype(np.float32)

    def acceptance(self, text, policy, seed):
        rate = 0.6 + 0.02 * (len(text) % 7) + 0.01 * seed
        return rate - 0.3 if "slow_drafts" in self.flaws else rate

    def runs(self, policy):
        return not (policy == "eagle-pcg" and "no_eagle" in self.flaws)


def _decode(audio):
    return bytes(np.asarray(audio, np.uint8)).decode()


def fake_transcribe(audio):
    return _decode(audio).split("|", 2)[2]


def fake_embed(audio):
    voice, seed = _decode(audio).split("|")[:2]
    vec = np.full(8, 0.01 * int(seed))
    vec[PRESETS.index(voice) if voice in PRESETS else 7] += 1.0
    return vec


def _gate(old_flaws=(), new_flaws=(), tmp_path=None, **kw):
    voices = {"old": FakeVoice(old_flaws), "new": FakeVoice(new_flaws)}
    for side in voices:
        _voice_folder(tmp_path / side, side)
    return run_gate(tmp_path / "old", tmp_path / "new", GateConfig(sentences=6, seeds=(0, 1)),
                    open_voice=lambda folder: voices[folder.name], transcribe=fake_transcribe, embed=fake_embed, **kw)


def _voice_folder(path, name, flaws=()):
    path.mkdir(parents=True, exist_ok=True)
    (path / "voice.json").write_text(json.dumps({"format": FORMAT, "version": VERSION, "name": name,
                                                 "settings": {"temperature": 0.2}, "sha256": {},
                                                 "fake_flaws": list(flaws)}))
    (path / "MODEL_CARD.md").write_text(f"# Model card: {name}\n\n## Model details\n\n{name} details.\n")
    return path


@pytest.mark.parametrize("flaws, needle", [(("mumbles",), "default wer"), (("blurs",), "slt identity"),
                                           (("slow_drafts",), "pcg acceptance"),
                                           (("no_eagle",), "eagle-pcg no longer runs"),
                                           (("drops_rms",), "preset rms is dropped")])
def test_a_worse_voice_is_refused(tmp_path, flaws, needle):
    result = _gate(new_flaws=flaws, tmp_path=tmp_path)
    assert not result["passed"] and any(needle in f for f in result["failures"]), result["failures"]
    with pytest.raises(GateRefused, match=needle):
        check_gate(result)
    reason = "the new codec needs it"
    assert check_gate(result, accept_worse=reason)["accepted_worse"] == reason


def test_an_equal_or_better_voice_passes(tmp_path):
    same = _gate(tmp_path=tmp_path)
    assert same["passed"] and same["failures"] == []
    rows = {(r["metric"], r["voice"]) for r in same["rows"]}
    assert rows >= {("wer", "default"), ("wer", "heart"), ("identity", "slt"), ("acceptance", "pcg"),
                    ("acceptance", "eagle-pcg")}
    better = _gate(old_flaws=("mumbles", "slow_drafts"), tmp_path=tmp_path)  # the old one was the worse
    assert better["passed"]
    wer = next(r for r in better["rows"] if r["metric"] == "wer" and r["voice"] == "default")
    assert wer["diff"]["high"] < 0 and wer["new"] < wer["old"]
    # a preset dropped on purpose is allowed, and named
    dropped = _gate(new_flaws=("drops_rms",), tmp_path=tmp_path, allowed_drops=("rms",))
    assert dropped["passed"] and dropped["dropped"] == ["rms"] and dropped["allowed_drops"] == ["rms"]


def test_compare_reads_noise_as_no_worse():
    """A difference whose interval straddles 0 (one sentence worse, one better) is not a refusal."""
    old = {"wer": {"default": {"0:0": 0.2, "1:0": 0.4, "2:0": 0.3}}, "identity": {}, "acceptance": {}}
    new = {"wer": {"default": {"0:0": 0.4, "1:0": 0.2, "2:0": 0.3}}, "identity": {}, "acceptance": {}}
    assert compare(old, new)["failures"] == []
    worse = {"wer": {"default": {"0:0": 0.5, "1:0": 0.6, "2:0": 0.55}}, "identity": {}, "acceptance": {}}
    assert compare(old, worse)["failures"]


# -- the package command: staging, refusal, the recorded comparison --------------------------------

@pytest.fixture
def fake_judges(monkeypatch):
    """The package command's gate with FakeVoice voices (their flaws read from voice.json) and fake judges."""
    import pcgtts.quality.gate as gate
    import pcgtts.quality.metrics as metrics

    def open_pack(folder, cache_root=None, temperature=None, max_tokens=None):
        return FakeVoice(json.loads((folder / "voice.json").read_text()).get("fake_flaws", ()))

    monkeypatch.setattr(gate, "open_pack", open_pack)
    monkeypatch.setattr(metrics, "recognizer", lambda: type("R", (), {"transcribe": staticmethod(fake_transcribe)}))
    monkeypatch.setattr(metrics, "speaker_encoder", lambda: type("E", (), {"embed": staticmethod(fake_embed)}))


def _package(*argv):
    args = build_parser().parse_args(["train", "package", "--gate-sentences", "4", *map(str, argv)])
    return args.func(args)


def _snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_package_refuses_a_worse_voice_and_leaves_the_shipped_one(tmp_path, fake_judges, capsys):
    shipped = _voice_folder(tmp_path / "voice", "lab-v7")
    before = _snapshot(shipped)
    worse = _voice_folder(tmp_path / "pack", "lab-v8", flaws=("mumbles",))
    report = tmp_path / "gate.json"
    with pytest.raises(SystemExit, match=r"pcgtts train package: the new voice 'lab-v8' is worse than the shipped "
                                         r"'lab-v7': default wer .*--accept-worse REASON") as refused:
        _package("--voice", worse, "--out", shipped, "--gate-report", report)
    assert "\n" not in str(refused.value)
    assert _snapshot(shipped) == before and not (tmp_path / "voice.tmp").exists()
    assert json.loads(report.read_text())["passed"] is False  # the measurement is kept to look at

    reason = "lab-v8's general codec: more presets told apart; the default voice's WER is fixed next"
    assert _package("--voice", worse, "--out", shipped, "--accept-worse", reason) == 0
    meta = json.loads((shipped / "voice.json").read_text())
    assert meta["name"] == "lab-v8" and meta["gate"]["accepted_worse"] == reason
    assert meta["gate"]["old"]["name"] == "lab-v7" and not meta["gate"]["passed"]
    card = (shipped / "MODEL_CARD.md").read_text()
    assert "## Comparison with the voice it replaced" in card and reason in card and "lab-v8 details" in card
    assert "| default | 0.0 % → 47.3 % | +47.3 ± 4.6 |" in card and "Acceptance in the default voice: pcg " in card


def test_package_installs_a_voice_that_is_not_worse(tmp_path, fake_judges, capsys):
    shipped = _voice_folder(tmp_path / "voice", "lab-v7")
    _package("--voice", _voice_folder(tmp_path / "pack", "lab-v8"), "--out", shipped)
    meta = json.loads((shipped / "voice.json").read_text())
    assert meta["name"] == "lab-v8" and meta["gate"]["passed"] and meta["gate"]["accepted_worse"] is None
    assert "Nothing is worse beyond its interval" in (shipped / "MODEL_CARD.md").read_text()
    out = capsys.readouterr().out
    assert "passed" in out
    # a second gate replaces the card's comparison, not appends another
    _package("--voice", _voice_folder(tmp_path / "pack2", "lab-v9"), "--out", shipped)
    assert (shipped / "MODEL_CARD.md").read_text().count("## Comparison with the voice it replaced") == 1


def test_package_from_lab_folders_is_gated_and_keeps_the_presets(tmp_path, fake_judges, monkeypatch, capsys):
    """The lab's route (--root): the packed voice is staged with the shipped presets and refused when worse."""
    import shutil
    from pathlib import Path

    import pcgtts.quality.gate as gate
    from test_lab_package import _lab_folders

    lab = tmp_path / "lab"
    codec = _lab_folders(lab)
    codec.rename(lab / "codec_export")
    (lab / "codec").mkdir()
    (lab / "codec_export").rename(lab / "codec" / "export")
    shipped = _voice_folder(tmp_path / "voice", "lab-v7")
    shutil.copytree(Path(__file__).resolve().parents[1] / "pcgtts" / "voice" / "voices", shipped / "voices")
    before = _snapshot(shipped)
    monkeypatch.setattr(gate, "open_pack", lambda folder, *a, **k: FakeVoice(("mumbles",) if folder.name == "voice.tmp"
                                                                             else ()))
    with pytest.raises(SystemExit, match="worse than the shipped 'lab-v7': default wer"):
        _package("--root", lab, "--out", shipped, "--name", "lab-v8")
    assert _snapshot(shipped) == before and not (tmp_path / "voice.tmp").exists()
    _package("--root", lab, "--out", shipped, "--name", "lab-v8", "--accept-worse", "a test")
    meta = json.loads((shipped / "voice.json").read_text())
    assert meta["name"] == "lab-v8" and meta["gate"]["accepted_worse"] == "a test"
    assert "voices/heart.voice" in meta["sha256"] and (shipped / "target.safetensors").is_file()


def test_package_bad_gate_flags_fail_before_work(tmp_path, no_models):
    shipped = _voice_folder(tmp_path / "voice", "lab-v7")
    pack = _voice_folder(tmp_path / "pack", "lab-v8")
    for argv, needle in ((["--gate-seeds", "0,0"], "distinct seeds"), (["--gate-sentences", "21"], "in \\[2, 20\\]"),
                         (["--accept-worse", " "], "needs a reason"), (["--name", "x"], "--voice puts"),
                         (["--gate-report", tmp_path / "nowhere" / "g.json"], "not found")):
        with pytest.raises(SystemExit, match=needle):
            _package("--voice", pack, "--out", shipped, *argv)
    assert json.loads((shipped / "voice.json").read_text())["name"] == "lab-v7"


# -- the real runner on tiny random-weight models ---------------------------------------------------

def test_synthesizer_runner_measures_a_tiny_voice(tiny_models, tiny_groups_file):
    """The runner the gate loads voices into: plain-decoding audio, per-utterance acceptance; the same
    voice against itself (same seeds) is no worse."""
    from pcgtts.runtime.config import SynthesisConfig
    from pcgtts.runtime.synthesizer import Synthesizer

    synth = Synthesizer.from_pretrained(tiny_models["target"], draft=tiny_models["draft"], codec=tiny_models["codec"],
                                        groups=tiny_groups_file, max_length=256,
                                        config=SynthesisConfig(min_tokens=10, min_tokens_per_char=0.5))
    runner = SynthesizerRunner(synth, temperature=0.8, max_tokens=24)
    assert runner.runs("pcg") and not runner.runs("eagle-pcg")
    sentences = ["One two three.", "Four five six."]
    a = measure(runner, ["default"], sentences, (0,), ("pcg", "eagle-pcg"), lambda audio: "one two", None)
    b = measure(runner, ["default"], sentences, (0,), ("pcg", "eagle-pcg"), lambda audio: "one two", None)
    # measured at the fixed draft length: every utterance drafts, whatever this machine's timings
    assert set(a["acceptance"]) == {"pcg"} and all(r is not None and 0 <= r <= 1 for r in a["acceptance"]["pcg"].values())
    assert a["wer"]["default"] == {"0:0": pytest.approx(1 / 3), "1:0": 1.0}
    assert compare(a, b)["failures"] == []
