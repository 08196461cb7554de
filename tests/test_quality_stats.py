"""Confidence intervals and paired differences of the quality harness, on data with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pcgtts.quality.stats import Estimate, format_table, mean_ci, paired_diff


def test_mean_ci_matches_the_t_interval():
    est = mean_ci([1, 2, 3, 4, 5])
    # mean 3, s = sqrt(2.5), t_{0.975, 4} = 2.776445
    half = 2.7764451 * math.sqrt(2.5) / math.sqrt(5)
    assert est.mean == pytest.approx(3.0)
    assert (est.low, est.high) == (pytest.approx(3 - half, rel=1e-6), pytest.approx(3 + half, rel=1e-6))
    assert est.n == 5 and est.excludes_zero()  # the interval [1.04, 4.96] lies above 0


def test_mean_ci_confidence_level_and_missing_values():
    wide, narrow = mean_ci([1, 2, 3, 4, 5], 0.99), mean_ci([1, 2, 3, 4, 5], 0.8)
    assert wide.half_width > mean_ci([1, 2, 3, 4, 5]).half_width > narrow.half_width
    est = mean_ci([1.0, None, float("nan"), 3.0])
    assert est.n == 2 and est.mean == 2.0
    assert math.isnan(mean_ci([4.0]).low) and mean_ci([4.0]).mean == 4.0
    assert mean_ci([]).n == 0
    with pytest.raises(ValueError):
        mean_ci([1, 2], confidence=1.0)


def test_mean_ci_covers_the_true_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    covered = 0
    for _ in range(2000):
        est = mean_ci(rng.normal(10.0, 2.0, size=8))
        covered += est.low <= 10.0 <= est.high
    assert 0.93 < covered / 2000 < 0.97


def test_paired_diff_sees_a_small_consistent_change_that_unpaired_intervals_miss():
    rng = np.random.default_rng(1)
    keys = [(f"s{i}", seed) for i in range(10) for seed in range(3)]
    base = {k: float(v) for k, v in zip(keys, rng.normal(0.2, 0.1, size=len(keys)))}  # sentence noise
    shifted = {k: v + 0.02 + float(rng.normal(0, 0.002)) for k, v in base.items()}
    d = paired_diff(shifted, base)
    assert d.mean == pytest.approx(0.02, abs=0.002)
    assert d.excludes_zero() and d.low > 0.015
    a, b = mean_ci(list(shifted.values())), mean_ci(list(base.values()))
    assert a.low < b.high  # the unpaired intervals overlap: only the pairing resolves the change


def test_paired_diff_exact_values_and_key_checks():
    d = paired_diff({"a": 3.0, "b": 5.0, "c": 4.0}, {"a": 1.0, "b": 2.0, "c": 3.0})  # diffs 2, 3, 1
    half = 4.3026527 * 1.0 / math.sqrt(3)
    assert d.mean == pytest.approx(2.0) and d.high == pytest.approx(2.0 + half, rel=1e-6)
    assert paired_diff({"a": None, "b": 1.0}, {"a": 1.0, "b": 0.5}).n == 1  # undefined pairs are left out
    with pytest.raises(ValueError, match="same utterances"):
        paired_diff({"a": 1.0}, {"b": 1.0})


def test_estimate_format_and_table():
    assert Estimate(0.1234, 0.1, 0.1468, 9).format(scale=100) == "12.3 ± 2.3"
    assert Estimate(0.02, 0.01, 0.03, 9).format(scale=100, signed=True) == "+2.0 ± 1.0"
    assert Estimate(float("nan"), float("nan"), float("nan"), 0).format() == "-"
    assert Estimate(1.0, 0.5, 1.5, 4).as_dict()["low"] == 0.5
    assert Estimate(1.0, float("nan"), float("nan"), 1).as_dict()["low"] is None
    text = format_table(["case", "WER"], [["ar", "12.3"], ["pcg L=3", "9.0"]], title="t")
    lines = text.splitlines()
    assert lines[0] == "t" and lines[1].startswith("case") and lines[3].startswith("ar  ")
    assert len({len(line) for line in lines[1:]}) == 1  # aligned columns
    with pytest.raises(ValueError):
        format_table(["a", "b"], [["only one"]])


def test_each_utterance_gets_its_own_random_stream():
    """One stream per (seed, sentence), stable across runs: utterances of one seed must not share
    their draws (they did, and the paired intervals took them for independent)."""
    from pcgtts.quality.harness import AA_SEED_OFFSET, stream_seed

    seeds = {stream_seed(seed, f"s{i:02d}") for seed in (0, 1, 2) for i in range(1, 21)}
    assert len(seeds) == 60
    assert stream_seed(0, "s01") == stream_seed(0, "s01") == 1199378483  # zlib.crc32(b"0/s01")
    assert stream_seed(0, "s01") + AA_SEED_OFFSET not in seeds


def test_eval_diff_pairs_two_runs_by_case_sentence_and_seed(tmp_path, capsys):
    """Two synth runs (e.g. two models): the difference is taken utterance by utterance, cases only one
    run has are left out, and runs on different utterances or of another mode are refused."""
    import json

    from pcgtts.cli import main
    from pcgtts.quality.diff import diff_runs

    def run(wer_of, cases=("ar",), sentences=("s1", "s2", "s3")):
        records = [{"case": c, "sentence": s, "seed": seed, "wer": wer_of(i, seed), "cer": 0.5, "sim": 0.7}
                   for c in cases for i, s in enumerate(sentences) for seed in (0, 1)]
        return {"mode": "synth", "temperature": 0.2, "records": records, "models": {"target": "m"}}

    base = run(lambda i, seed: 0.2 * i + 0.1 * seed)  # sentences differ a lot, the change below is small
    new = run(lambda i, seed: 0.2 * i + 0.1 * seed - 0.05 - 0.01 * seed, cases=("ar", "pcg L=3"))
    (row,) = diff_runs(base, new)
    assert (row["case"], row["temperature"], row["utterances"]) == ("ar", 0.2, 6)
    delta = row["wer"]["delta"]
    assert delta["mean"] == pytest.approx(-0.055) and delta["high"] < 0  # consistent: the interval excludes 0
    assert row["wer"]["base"]["high"] > row["wer"]["new"]["low"]  # where the unpaired intervals overlap
    assert row["cer"]["delta"]["mean"] == 0.0
    with pytest.raises(ValueError, match="same utterances"):
        diff_runs(base, run(lambda i, seed: 0.0, sentences=("s1", "s2")))
    with pytest.raises(ValueError, match="cannot be paired"):
        diff_runs(base, {"mode": "codec", "records": []})
    with pytest.raises(ValueError, match="synth or codec runs"):
        diff_runs({"mode": "swap", "records": []}, {"mode": "swap", "records": []})

    (tmp_path / "a.json").write_text(json.dumps(base))
    (tmp_path / "b.json").write_text(json.dumps(new))
    assert main(["eval-diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "-5.5 ±" in out and json.loads(out.splitlines()[-1])["rows"][0]["case"] == "ar"
    (tmp_path / "c.json").write_text("{not json")
    assert main(["eval-diff", str(tmp_path / "a.json"), str(tmp_path / "c.json")]) == 2


def test_eval_diff_pairs_two_codecs_by_voice_and_sentence(capsys):
    """Two `--mode codec` runs (the same recordings resynthesised by two codecs) pair by voice and
    sentence, STOI and MCD beside WER."""
    from pcgtts.quality.diff import diff_runs, render

    def run(shift):
        return {"mode": "codec", "records": [
            {"voice": v, "sentence": f"s{i}", "seed": 0, "wer": 0.1 * i + shift, "cer": 0.1, "sim": 0.8,
             "stoi": 0.7 + 0.05 * i - shift, "mcd": 2.0} for v in ("a", "b") for i in range(4)]}

    rows = diff_runs(run(0.0), run(-0.02))
    assert [(r["case"], r["temperature"], r["utterances"]) for r in rows] == [("a", None, 4), ("b", None, 4)]
    assert rows[0]["wer"]["delta"]["mean"] == pytest.approx(-0.02)
    assert rows[0]["stoi"]["delta"]["mean"] == pytest.approx(0.02) and rows[0]["mcd"]["delta"]["mean"] == 0.0
    table = render(rows, "old", "new")
    assert "ΔSTOI" in table and "+0.020" in table


def test_eval_diff_pairs_a_sweep_whose_records_lack_their_temperature_with_one_whose_records_have_it():
    """Older sweep runs kept each case's temperature in its summary only: rows pair by
    (case, temperature) across both forms, each at its own temperature (not the run's first)."""
    from pcgtts.quality.diff import diff_runs

    cases = {"ar T=0.2": 0.2, "ar T=0.8": 0.8}

    def run(shift, with_t):
        records = [{"case": c, "sentence": s, "seed": 0, "wer": 0.1 * i + shift, "cer": 0.1, "sim": 0.7,
                    **({"temperature": t} if with_t else {})} for c, t in cases.items() for i, s in enumerate("abc")]
        return {"mode": "synth", "temperature": 0.2, "records": records,
                "summaries": [{"case": c, "temperature": t} for c, t in cases.items()]}

    rows = diff_runs(run(0.0, with_t=False), run(-0.05, with_t=True))
    assert [(r["case"], r["temperature"], r["utterances"]) for r in rows] == [("ar T=0.2", 0.2, 3), ("ar T=0.8", 0.8, 3)]
    assert all(r["wer"]["delta"]["mean"] == pytest.approx(-0.05) for r in rows)
