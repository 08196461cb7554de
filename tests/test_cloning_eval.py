"""The cloning bar's harness (quality/cloning.py): references and centroids are chosen as stated,
real utterances of a speaker are identified as that speaker, another speaker's are not."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from pcgtts.quality.cloning import cloning_plan, identify, nearest, read_manifest, run_cloning
from pcgtts.quality.stats import wilson

SENTENCES = ["The old barn stood at the edge of the field for many years.",
             "She carried a basket of apples down to the market every morning.",
             "A light rain fell on the quiet town as the lamps came on.",
             "They waited by the river until the boat finally came into view.",
             "Every winter the children built a snow fort behind the school.",
             "The engineer checked each wire twice before turning on the power."]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A lab-corpus-shaped folder: three flite voices, six utterances each; awb is held out."""
    if shutil.which("flite") is None:
        pytest.skip("needs the flite command")
    from pcgtts.quality.testset import VoiceRecipe, render

    root = tmp_path_factory.mktemp("corpus")
    cache = tmp_path_factory.mktemp("render")
    rows = []
    for voice in ("slt", "rms", "awb"):
        for i, text in enumerate(SENTENCES):
            path = render(VoiceRecipe(f"flite-{voice}", "flite", voice), text, cache)
            rel = f"audio/{voice}-{i}.wav"
            (root / "audio").mkdir(exist_ok=True)
            shutil.copyfile(path, root / rel)
            import soundfile as sf

            rows.append({"id": f"{voice}-{i:02d}", "speaker": voice, "source": f"flite:{voice}", "text": text,
                         "split": "heldout_speakers" if voice == "awb" else "train", "path": rel,
                         "seconds": sf.info(root / rel).duration})
    (root / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_wilson_interval():
    low, high = wilson(8, 10)
    assert (round(low, 3), round(high, 3)) == (0.490, 0.943)  # the textbook Wilson 95 % interval
    assert wilson(0, 5)[0] == pytest.approx(0.0, abs=1e-12) and wilson(5, 5)[1] == pytest.approx(1.0)


def test_identify_picks_the_nearest_centroid():
    centroids = {"a": np.array([1.0, 0.0]), "b": np.array([0.0, 1.0])}
    assert identify(np.array([0.9, 0.1]), "a", centroids)[0]
    passed, margin = identify(np.array([0.9, 0.1]), "b", centroids)
    assert not passed and margin < 0
    assert nearest(np.array([0.9, 0.1]), centroids) == "a" and nearest(np.array([0.2, 0.7]), centroids) == "b"


def test_plan_keeps_references_out_of_centroids(corpus):
    rows = read_manifest(corpus)
    plan = cloning_plan(rows, refs=2, per_speaker=3)
    assert plan.cloned == ("awb",)
    refs = {r["id"] for r in plan.references["awb"]}
    assert len(refs) == 2 and all(3.0 <= r["seconds"] <= 5.0 for r in plan.references["awb"])
    assert not refs & {r["id"] for r in plan.centroid_rows["awb"]}
    assert {len(v) for v in plan.centroid_rows.values()} == {3}
    with pytest.raises(ValueError, match="references asked for"):
        cloning_plan(rows, refs=7)
    with pytest.raises(FileNotFoundError, match="corpus manifest not found"):
        read_manifest(corpus / "audio")


@pytest.mark.slow  # real speech through the speaker encoder, ~3.5 s (the fast suite stays under 3 minutes)
def test_real_utterances_are_identified_and_another_speakers_are_not(corpus):
    pytest.importorskip("resemblyzer")
    from pcgtts.runtime.audio.io import load_audio

    plan = cloning_plan(read_manifest(corpus), refs=2, per_speaker=3)
    oracle = run_cloning(plan, corpus, None, SENTENCES)
    assert oracle["all_speakers"]["passed"] == oracle["all_speakers"]["n"] == 2 and oracle["mean_margin"] > 0
    impostor = next(r for r in plan.centroid_rows["slt"])

    def wrong_speaker(text, ref_path, ref_text, seed):  # a "clone" that sounds like somebody else
        return load_audio(corpus / impostor["path"])

    wrong = run_cloning(plan, corpus, wrong_speaker, SENTENCES)
    assert wrong["all_speakers"]["passed"] == 0 and wrong["mean_margin"] < 0


def test_each_case_is_transcribed_and_scored_against_the_text_it_says(corpus):
    """The WER beside the speaker test: a clone is scored against the sentence it was asked to say, the
    oracle's real utterance against its own transcript (fake judges: no encoder or recogniser needed)."""
    plan = cloning_plan(read_manifest(corpus), refs=2, per_speaker=3)
    embed = lambda audio: np.array([1.0, float(len(audio) % 7)])  # noqa: E731
    heard = {}

    def speak(text, ref_path, ref_text, seed):
        audio = np.full(16000 + seed, 0.1, dtype=np.float32)
        heard[len(audio)] = " ".join(text.split()[:-2])  # says all but its last two words
        return audio

    result = run_cloning(plan, corpus, speak, SENTENCES, embed=embed, transcribe=lambda audio: heard[len(audio)])
    for case in result["cases"]:
        words = len(case["text"].split())
        assert case["wer"] == pytest.approx(2 / words)
    assert result["wer"]["n"] == 2 and result["wer"]["mean"] == pytest.approx(np.mean([c["wer"] for c in result["cases"]]))
    assert set(result["wer_by_speaker"]) == {"awb"}

    refs = {r["id"]: r["text"] for r in plan.references["awb"]}
    oracle = run_cloning(plan, corpus, None, SENTENCES, embed=embed, transcribe=lambda audio: "")
    for case in oracle["cases"]:  # the real utterance scored against its own text (an empty hearing: WER 1)
        assert case["text"] in refs.values() and case["text"] != refs[case["reference"]] and case["wer"] == 1.0
    three = cloning_plan(read_manifest(corpus), refs=3, per_speaker=3)
    oracle = run_cloning(three, corpus, None, SENTENCES, embed=embed, transcribe=lambda audio: "")
    assert len({c["text"] for c in oracle["cases"]}) == 3  # each case another real utterance


def test_the_oracle_through_a_codec_scores_the_resynthesised_utterance(corpus):
    """--oracle --codec C: each real utterance goes through `resynthesize` before it is judged."""
    plan = cloning_plan(read_manifest(corpus), refs=2, per_speaker=3)
    judged = []

    def embed(audio):
        judged.append(len(audio))
        return np.array([1.0, 0.5])

    def halve(audio):  # stands in for a codec's encode + decode
        return audio[: len(audio) // 2]

    plain = run_cloning(plan, corpus, None, SENTENCES, embed=embed, transcribe=lambda audio: "")
    through = run_cloning(plan, corpus, None, SENTENCES, embed=embed, transcribe=lambda audio: "", resynthesize=halve)
    for a, b in zip(plain["cases"], through["cases"]):
        assert b["seconds"] == pytest.approx(a["seconds"] / 2, abs=1e-4) and b["text"] == a["text"]
    assert judged[-2:] == [round(c["seconds"] * 16000) for c in through["cases"]]
