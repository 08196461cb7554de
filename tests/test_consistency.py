"""The long-text measure: a voice judged against its own sentence-to-sentence spread and pace."""

from __future__ import annotations

import numpy as np
import pytest

from pcgtts.quality.consistency import judge_paragraph, position_drift, run_consistency, speech_seconds, syllables

SR = 16000
TEXTS = [f"Sentence number {w} is spoken at an even pace today." for w in
         ("one", "two", "three", "four", "five", "six", "seven", "eight")]


def tone(seconds: float, lead: float = 0.3, tail: float = 0.4) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    body = 0.5 * np.sin(2 * np.pi * 220 * t)
    return np.concatenate([np.zeros(int(lead * SR)), body, np.zeros(int(tail * SR))]).astype(np.float32)


def test_syllables_are_counted_from_spelling():
    assert syllables("The library opens at nine and closes at five on weekdays.") == 16
    assert syllables("Yes.") == 1
    assert syllables("make the little cake") == 5


def test_speech_seconds_trims_leading_and_trailing_silence():
    assert speech_seconds(tone(1.0)) == pytest.approx(1.0, abs=0.021)
    assert speech_seconds(np.zeros(SR, np.float32)) == 0.0


def test_position_drift_cancels_each_sentences_own_pace():
    pace = np.array([6.5, 5.8, 5.6, 4.9, 5.1, 6.1, 4.6, 4.4])  # sentences differ, position does not matter
    assert position_drift(pace, pace) == pytest.approx(0.0)
    slowing = np.exp(np.log(0.8) * np.arange(8) / 7)  # 20 % slower at the last position than the first
    assert position_drift(pace * slowing, pace * slowing[::-1]) == pytest.approx(-0.2)
    assert np.isnan(position_drift([4.0], [4.0]))


def fixed_embed(vectors):
    it = iter(vectors)
    return lambda audio: next(it)


def test_a_steady_voice_holds_and_a_drifting_one_does_not():
    rng = np.random.default_rng(0)
    base = rng.normal(size=256)
    steady = [base + 0.1 * rng.normal(size=256) for _ in TEXTS]
    # every sentence at its own pace (syllables over seconds differ by sentence), whatever its position
    pace = {t: 4.0 + 0.5 * i % 3 for i, t in enumerate(TEXTS)}
    in_order = [tone(syllables(t) / pace[t]) for t in TEXTS]
    ok = judge_paragraph(in_order, in_order[::-1], TEXTS, fixed_embed(steady))
    assert ok["identity_holds"] and ok["rate_holds"]
    assert abs(ok["rate_drift"]) < 0.02

    # the last sentence turns into another speaker; each position is 30 % slower by the end
    other = rng.normal(size=256)
    drifting = steady[:-1] + [other]
    slower = [1 + 0.3 * i / (len(TEXTS) - 1) for i in range(len(TEXTS))]
    in_order = [tone(syllables(t) / pace[t] * slower[i]) for i, t in enumerate(TEXTS)]
    in_reverse = [tone(syllables(t) / pace[t] * slower[i]) for i, t in enumerate(TEXTS[::-1])]
    bad = judge_paragraph(in_order, in_reverse, TEXTS, fixed_embed(drifting))
    assert not bad["identity_holds"]
    assert not bad["rate_holds"] and bad["rate_drift"] < -0.2


def test_run_consistency_speaks_every_sentence_per_voice_and_seed():
    said = []

    def speak(text, voice, seed):
        said.append((voice, seed, text))
        return tone(syllables(text) / 4.0)

    rng = np.random.default_rng(1)
    base = {v: rng.normal(size=64) for v in ("a", "b")}
    calls = iter([base[v] + 0.05 * rng.normal(size=64) for v in ("a", "a", "b", "b") for _ in TEXTS])
    result = run_consistency(speak, ["a", "b"], TEXTS, seeds=(0, 1), embed=lambda audio: next(calls))
    assert len(said) == 2 * 2 * 2 * len(TEXTS)  # voices x seeds x (in order, in reverse) x sentences
    assert [text for _, seed, text in said if seed == 1000][:2] == TEXTS[::-1][:2]
    assert result["per_voice"]["a"]["readings"] == 2
    assert result["per_voice"]["b"]["identity_holds"] == 2 and result["per_voice"]["b"]["rate_holds"] == 2


def test_a_paragraph_too_short_to_judge_is_refused():
    with pytest.raises(ValueError, match="at least"):
        judge_paragraph([tone(1.0)] * 3, [tone(1.0)] * 3, TEXTS[:3], lambda a: np.ones(4))


def parse(*argv):
    import argparse

    from pcgtts.cli.evaluate import register

    parser = argparse.ArgumentParser(prog="pcgtts")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["eval", *argv])


@pytest.mark.parametrize("argv, message", [
    (["--mode", "consistency", "--sentences", "3"], "at least 4 sentences"),
    (["--mode", "consistency", "--voices", "default,default"], "twice"),
])
def test_consistency_mode_refuses_bad_arguments_before_loading(argv, message):
    from pcgtts.cli.evaluate import check_args

    with pytest.raises(ValueError, match=message):
        check_args(parse(*argv))


def test_the_paragraph_is_twelve_sentences_not_in_the_test_set():
    from pcgtts.quality.testset import TestSet, load_paragraph

    paragraph = load_paragraph()
    assert len(paragraph) == 12
    assert not set(paragraph) & {s.text for s in TestSet.load().sentences}


@pytest.mark.slow
def test_consistency_mode_runs_end_to_end_on_tiny_models(tiny_models, tmp_path, capsys):
    import json

    from pcgtts.cli import main

    pytest.importorskip("resemblyzer")
    code = main(["eval", "--mode", "consistency", "--target", str(tiny_models["target"]), "--codec", str(tiny_models["codec"]),
                 "--voices", "default", "--sentences", "4", "--seeds", "0", "--max-tokens", "25",
                 "--out", str(tmp_path / "out")])
    assert code == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    voice = line["per_voice"]["default"]
    assert line["mode"] == "consistency" and voice["readings"] == 1 and len(line["paragraph"]) == 4
    assert json.loads((tmp_path / "out" / "results.json").read_text())["per_voice"]["default"]["readings"] == 1


def test_the_quality_harness_scores_a_sentence_without_speech_as_empty_audio(tiny_synth, monkeypatch):
    from pcgtts.quality.harness import synthesize_one
    from pcgtts.runtime.decode import loop

    def no_speech(tokens, stop_index, max_new_tokens, stats):  # the stop token drawn first, every step
        stats.finish = "stop"
        return []

    monkeypatch.setattr(loop, "emitted", no_speech)
    audio, figures = synthesize_one(tiny_synth, "Yes.", tiny_synth.config, None)
    assert audio.size == 0 and figures["tokens"] == 0


@pytest.mark.slow
@pytest.mark.shipped_voice
def test_the_shipped_voice_stays_itself_and_keeps_its_pace_across_the_paragraph():
    """The default voice reads the 12-sentence paragraph in order and in reverse (seed 0, plain decoding on
    torch at its own temperature): the last sentence is as like the first as its nearby sentences are to
    each other, and its pace moves by at most 10 % from the first position to the last."""
    pytest.importorskip("resemblyzer")
    from pcgtts import Synthesizer
    from pcgtts.builtin import VOICE_DIR
    from pcgtts.quality.testset import load_paragraph

    if not (VOICE_DIR / "voice.json").is_file():
        pytest.skip("no trained voice is committed in pcgtts/voice")
    synth = Synthesizer.from_pretrained(policy="ar", backend="torch")

    def speak(text, voice, seed):
        return synth.synthesize(text, voice=voice, seed=seed)

    result = run_consistency(speak, ["default"], load_paragraph(), seeds=(0,))
    reading = result["readings"][0]
    assert reading["identity_holds"], reading
    assert reading["rate_holds"], reading
