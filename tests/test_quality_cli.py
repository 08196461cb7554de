"""`pcgtts eval`: argument checks before any model loads, the source mode end to end, and (slow)
the synth and swap pipelines on tiny random-weight models (their audio is noise: only the
pipeline and the finiteness of the metrics are asserted, not quality)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from pcgtts.cli.evaluate import check_args, register

pytest.importorskip("pocketsphinx")


def parse(*argv):
    parser = argparse.ArgumentParser(prog="pcgtts")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["eval", *argv])


@pytest.mark.parametrize("argv, message", [
    (["--policies", "ar,fast"], "unknown policy"),
    (["--theta", "1.5"], "--theta"),
    (["--beta", "-0.1"], "ssd_beta"),
    (["--draft-length", "0"], "draft_length"),
    (["--seeds", "0,0"], "distinct"),
    (["--sentences", "21"], r"\[1, 20\]"),
    (["--mode", "source", "--target", "x"], "takes no models"),
    (["--mode", "source", "--voices", "nobody"], "unknown voice"),
    (["--mode", "codec", "--codec", "/no/such/codec"], "codec directory not found"),
    (["--voices", "flite-slt"], "--voice "),
    (["--target", "t", "--policies", "ar,pcg"], "needs --groups, --theta or --mean-size"),
    (["--mode", "melgroups", "--theta", "0.3,0.4"], "one θ"),
    (["--mode", "melgroups", "--theta", "0.3", "--mean-size", "40"], "one θ"),
    (["--mean-size", "0.5"], "--mean-size values must be >= 1"),
    (["--mean-size", "600"], "cannot exceed the cap --top-k 512"),
    (["--top-k", "-1", "--mean-size", "40"], "--top-k"),
    (["--max-memory-gb", "0", "--theta", "0.3"], "--max-memory-gb"),
    (["--swap-fractions", "2"], "swap-fractions"),
    (["--temperature", "-1"], "temperature"),
    (["--temperature", "0.8,0.2,0.8"], "distinct"),
    (["--mode", "swap", "--temperature", "0.8,0.2", "--theta", "0.3"], "one value outside --mode synth"),
    (["--compute-device", "tpu"], "compute_device"),
    (["--mode", "swap", "--aa", "--theta", "0.3"], "--aa adds a row to --mode synth"),
])
def test_bad_arguments_fail_before_loading(argv, message):
    with pytest.raises(ValueError, match=message):
        check_args(parse(*argv))


def test_parser_types():
    with pytest.raises(SystemExit):
        parse("--theta", "a,b")
    with pytest.raises(SystemExit):
        parse("--mode", "nope")
    args = parse("--theta", "0.3,0.4", "--seeds", "1,2", "--draft-length", "1,3", "--mean-size", "40,140")
    assert args.theta == [0.3, 0.4] and args.seeds == [1, 2] and args.draft_length == [1, 3]
    assert args.mean_size == [40.0, 140.0] and args.top_k == 512  # groups build's cap, as bench sweeps


@pytest.mark.slow
def test_source_mode_end_to_end(tmp_path, capsys):
    pytest.importorskip("hibari")
    args = parse("--mode", "source", "--voices", "hibari-heart", "--sentences", "1", "--cache-dir",
                 str(tmp_path / "cache"), "--out", str(tmp_path / "out"))
    assert args.func(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert "hibari-heart" in "\n".join(lines[:-1])  # the readable table
    (row,) = report["summaries"]
    assert row["wer"]["n"] == 1 and row["wer"]["mean"] < 0.5 and row["wer_reversed"]["mean"] > 0.5
    assert 0.7 < row["sim"]["mean"] <= 1.0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["records"][0]["hyp"] and saved["testset"] == "pcgtts-eval-v1"


@pytest.fixture(scope="module")
def tiny_models(tiny_lm_factory, demo_codec_dir, tmp_path_factory):
    from pcgtts.export.group_table import build_groups_for_model
    from pcgtts.train.subset_draft import make_layer_subset_draft

    target = tiny_lm_factory()
    folder = tmp_path_factory.mktemp("tiny-eval")
    draft = make_layer_subset_draft(target, folder / "draft", 1)
    groups = build_groups_for_model(target, 0.3, progress=False).save(folder / "tiny.pcg")
    return {"target": str(target), "draft": str(draft), "codec": str(demo_codec_dir), "groups": str(groups)}


@pytest.mark.slow
def test_synth_pipeline_on_tiny_models(tiny_models, tmp_path):
    from pcgtts import Synthesizer
    from pcgtts.quality.harness import SynthPlan, run_synth
    from pcgtts.quality.plots import plot_curves
    from pcgtts.quality.testset import TestSet
    from pcgtts.tools.bench import BenchCase

    testset = TestSet.load()
    base = Synthesizer.from_pretrained(**tiny_models, policy="pcg", max_length=512)
    plan = SynthPlan(testset.sentences[:1], seeds=(0, 1), max_tokens=25, clone=False, aa_row=True)
    cases = [BenchCase("ar"), BenchCase("sd", 1), BenchCase("sd", 2), BenchCase("pcg", 2)]
    result = run_synth(base, cases, plan, testset.voices[0], testset, tmp_path / "cache")
    assert [s["case"] for s in result["summaries"]] == ["ar", "ar A/A", "sd L=1", "sd L=2", "pcg L=2"]
    # The A/A row pairs with AR's (sentence, seed) keys but samples other random streams.
    rows = {case: [r for r in result["records"] if r["case"] == case] for case in ("ar", "ar A/A")}
    assert [(r["sentence"], r["seed"]) for r in rows["ar"]] == [(r["sentence"], r["seed"]) for r in rows["ar A/A"]]
    assert [r["sim"] for r in rows["ar"]] != [r["sim"] for r in rows["ar A/A"]]
    for s in result["summaries"]:
        assert s["utterances"] == 2 and s["speedup_vs_ar"] > 0
        assert 0.0 <= s["wer"]["mean"] <= 1.0 + 1e-9 and math.isfinite(s["delta_wer"]["mean"])
        if s["policy"] != "ar":
            assert 0.0 <= s["acceptance_rate"] <= 1.0 and s["mean_accepted_length"] >= 1.0
    assert len(result["records"]) == 10
    assert [p.name for p in plot_curves(result["summaries"], tmp_path)] == ["curves_draft_length.png"]


@pytest.mark.slow
def test_eval_sweeps_group_tables_by_mean_size_through_the_command(tiny_models, tmp_path, monkeypatch, capsys):
    """`pcgtts eval --mean-size` (as `bench --mean-size`): θ chosen per size on the target, tables built
    capped and cached, each pcg row labelled by its θ and carrying its table's measured mean size."""
    monkeypatch.setenv("PCGTTS_CACHE", str(tmp_path / "cache"))  # the built tables land here, not in ~
    args = parse("--target", tiny_models["target"], "--draft", tiny_models["draft"], "--codec", tiny_models["codec"],
                 "--policies", "ar,pcg", "--draft-length", "2", "--mean-size", "4,24", "--top-k", "32",
                 "--sentences", "1", "--seeds", "0", "--no-clone", "--max-tokens", "12",
                 "--cache-dir", str(tmp_path / "audio"), "--out", str(tmp_path / "out"))
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    pcg = [s for s in report["summaries"] if s["policy"] == "pcg"]
    assert len(pcg) == 2
    small, large = (s["mean_group_size"] for s in pcg)
    assert 2 <= small <= 8 and 12 <= large <= 32 and pcg[0]["theta"] > pcg[1]["theta"]
    built = sorted(p.name for p in (tmp_path / "cache" / "groups").glob("*.pcg"))
    assert len(built) == 2 and all(name.endswith("-k32.pcg") for name in built)
    assert "|G|" in (tmp_path / "out" / "tables.txt").read_text()


@pytest.mark.slow
def test_a_temperature_sweep_runs_every_case_at_each_temperature_paired_with_ar_at_the_first(tiny_models, tmp_path):
    """At temperature 0 speculation must equal greedy AR, so the sweep's T=0 rows of ar and sd hear
    the same audio: the same transcript and similarity on every (sentence, seed)."""
    from pcgtts import Synthesizer
    from pcgtts.quality.harness import SynthPlan, run_synth
    from pcgtts.quality.testset import TestSet
    from pcgtts.tools.bench import BenchCase

    testset = TestSet.load()
    base = Synthesizer.from_pretrained(**tiny_models, policy="sd", max_length=512)
    plan = SynthPlan(testset.sentences[:1], seeds=(0, 1), max_tokens=20, clone=False, sweep_temperatures=(0.0,))
    result = run_synth(base, [BenchCase("ar"), BenchCase("sd", 2)], plan, testset.voices[0], testset, tmp_path / "c")
    assert [(s["case"], s["temperature"]) for s in result["summaries"]] == [
        ("ar T=0.8", 0.8), ("sd L=2 T=0.8", 0.8), ("ar T=0", 0.0), ("sd L=2 T=0", 0.0)]
    assert result["temperatures"] == [0.8, 0.0]
    rows = {c: [r for r in result["records"] if r["case"] == c] for c in ("ar T=0", "sd L=2 T=0", "ar T=0.8")}
    assert [(r["tokens"], r["hyp"], r["sim"]) for r in rows["ar T=0"]] == \
        [(r["tokens"], r["hyp"], r["sim"]) for r in rows["sd L=2 T=0"]]
    assert [r["sim"] for r in rows["ar T=0"]] != [r["sim"] for r in rows["ar T=0.8"]]
    # A rule is paired with AR at its own temperature (at T=0: the same audio, a zero difference);
    # AR at a swept temperature with AR at the first (what the temperature itself does).
    summary = {s["case"]: s for s in result["summaries"]}
    assert [summary[c]["baseline"] for c in summary] == ["ar T=0.8", "ar T=0.8", "ar T=0.8", "ar T=0"]
    assert summary["sd L=2 T=0"]["delta_sim"]["mean"] == 0.0 and summary["sd L=2 T=0"]["delta_wer"]["mean"] == 0.0
    assert summary["ar T=0"]["delta_sim"]["mean"] != 0.0
    assert {r["temperature"] for r in rows["ar T=0"]} == {0.0}  # each record its own T (eval-diff's column)
    with pytest.raises(ValueError, match="distinct"):
        SynthPlan(testset.sentences[:1], sweep_temperatures=(0.8,))


@pytest.mark.slow
def test_swap_pipeline_on_tiny_models(tiny_models, tmp_path):
    import numpy as np

    from pcgtts import Synthesizer
    from pcgtts.groups.table import GroupTable
    from pcgtts.quality.harness import SynthPlan
    from pcgtts.quality.swap import run_swap, target_codes
    from pcgtts.quality.testset import TestSet

    testset = TestSet.load()
    base = Synthesizer.from_pretrained(tiny_models["target"], codec=tiny_models["codec"], policy="ar", max_length=512)
    plan = SynthPlan(testset.sentences[:1], max_tokens=30, clone=False)
    codes = target_codes(base, testset.sentences[0].text, None, 0, plan)
    again = target_codes(base, testset.sentences[0].text, None, 0, plan)
    assert len(codes) > 0 and (codes == again).all()  # seeded: the same sequence
    table = GroupTable.load(tiny_models["groups"])
    seqs = [{"sentence": "s01", "seed": 0, "text": testset.sentences[0].text, "codes": codes}]
    result = run_swap(base.codec, seqs, {0.3: table}, [0.5, 1.0])
    assert [(r["mode"], r["p"]) for r in result["summaries"]] == [("group", 0.5), ("group", 1.0),
                                                                  ("random", 0.5), ("random", 1.0)]
    random_full = result["summaries"][-1]
    assert random_full["swapped"]["mean"] == pytest.approx(1.0)
    assert all(np.isfinite(r["swapped"]["mean"]) for r in result["summaries"])


@pytest.mark.slow
def test_mel_groups_match_the_embedding_group_size_and_drive_pcg(tiny_models, tmp_path):
    from pcgtts import Synthesizer
    from pcgtts.groups.table import GroupTable
    from pcgtts.quality.harness import SynthPlan, run_synth
    from pcgtts.quality.melgroups import build_mel_groups
    from pcgtts.quality.testset import TestSet
    from pcgtts.runtime.lm.checkpoint import load_speech_embeddings
    from pcgtts.tools.bench import BenchCase

    rows, vocab, fingerprint = load_speech_embeddings(tiny_models["target"])
    base = Synthesizer.from_pretrained(**tiny_models, policy="pcg", max_length=512)
    table, info = build_mel_groups(base.codec, rows, 0.3, (vocab.speech_offset, vocab.vocab_size, fingerprint),
                                   sample_size=256)
    assert table.num_tokens == vocab.num_speech
    assert info["neighbours_mel"] == pytest.approx(info["neighbours_embedding"], rel=0.05, abs=0.5)
    table.save(tmp_path / "mel.pcg")
    GroupTable.load(tmp_path / "mel.pcg", expect_vocab=base.target.vocab, expect_fingerprint=fingerprint)
    testset = TestSet.load()
    plan = SynthPlan(testset.sentences[:1], max_tokens=20, clone=False)
    tables = {1.0: table.to_device(base.target.device)}
    result = run_synth(base, [BenchCase("ar"), BenchCase("pcg", 2, theta=1.0)], plan, testset.voices[0], testset,
                       tmp_path / "cache", groups_for=tables.__getitem__)
    pcg = result["summaries"][1]
    assert pcg["policy"] == "pcg" and 0.0 <= pcg["acceptance_rate"] <= 1.0
