"""`pcgtts bench`: the JSON it writes must be internally consistent.

Runs on the tiny models (default suite) and on the full demo (`-m slow`); see tests/conftest.py."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench_report(models, groups_file, tmp_path_factory):
    from pcgtts.cli import main

    out = tmp_path_factory.mktemp("bench")
    texts = out / "texts.txt"
    texts.write_text("Good morning.\nThe train to the coast leaves at half past nine.\n")
    argv = ["bench", "--target", str(models["target"]), "--draft", str(models["draft"]),
            "--codec", str(models["codec"]), "--groups", str(groups_file), "--policy", "ar,pcg",
            "--runs", "2", "--warmup", "1", "--max-tokens", "30", "--texts", str(texts),
            "--speed", "0.02", "--json", str(out / "b.json"), "--plot", str(out / "b.png")]
    assert main(argv) == 0
    return json.loads((out / "b.json").read_text()), out / "b.png"


def test_records_are_consistent(bench_report):
    report, _ = bench_report
    assert [s["case"] for s in report["summaries"]] == ["ar", "pcg L=3"]
    assert len(report["utterances"]) == 2 * 2 * 2  # cases x runs x texts; warm-up excluded
    for u in report["utterances"]:
        draft_length = 0 if u["case"] == "ar" else 3
        assert u["tokens"] == sum(u["chunk_tokens"]) > 0
        assert u["audio_seconds"] == pytest.approx(u["tokens"] * 320 / 16000)
        assert 0 < u["time_to_first_audio"] < u["total_seconds"]
        # Every step yields its accepted drafts plus one corrected/bonus token; tokens after a
        # stop token or past the cap are dropped (at most one step's worth per sentence).
        made = u["accepted"] + u["steps"]
        assert sum(n for _, n in u["trace"]) == made
        assert u["tokens"] <= made <= u["tokens"] + (draft_length + 1) * u["sentences"]
        assert u["target_forwards"] == u["steps"]
        assert u["draft_forwards"] == draft_length * u["steps"]
        assert u["drafted"] == draft_length * u["steps"]
        # The simulated listener plays at 2% speed: it never waits for a chunk.
        assert u["underruns"] == 0 and u["underrun_seconds"] == 0
        assert all(c["late"] <= 0 for c in u["chunks"])


def test_summaries_and_harness_overhead(bench_report):
    report, _ = bench_report
    ar, pcg = report["summaries"]
    assert ar["speedup_vs_ar"] == 1.0 and ar["target_forwards_per_token"] >= 1.0
    assert 0 <= pcg["acceptance_rate"] <= 1 and 1 <= pcg["mean_accepted_length"] <= 4
    assert pcg["target_forwards_per_token"] < 1.0  # several tokens per verify pass
    assert pcg["predicted_speedup"] > 0 and pcg["efficiency"] > 0
    # AR's per-token overhead on both sides: the prediction moves toward 1, never past it.
    bounds = sorted((1.0, pcg["predicted_speedup"]))
    assert pcg["per_token_overhead"] >= 0 and bounds[0] <= pcg["predicted_speedup_with_overhead"] <= bounds[1]
    ttfa = ar["time_to_first_audio"]
    assert ttfa["p50"] <= ttfa["p90"] <= ttfa["p99"]
    for s in report["summaries"]:
        # The harness's own bookkeeping must be negligible next to a decode step.
        assert 0 < s["harness_us_per_step"] < 0.05 * 1e6 * s["t_target_step"]


def test_plot_is_a_png(bench_report):
    import matplotlib.pyplot as plt

    _, png = bench_report
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = plt.imread(png)
    assert image.shape[0] > 400 and image.shape[1] > 400


def test_codec_thread_both_runs_every_case_both_ways_against_its_own_ar():
    import argparse

    from pcgtts.cli.bench import cases
    from pcgtts.tools.bench import add_speedups

    args = argparse.Namespace(policy=["ar", "pcg"], draft_length=[3], theta=None, beta=None, adaptive=False,
                              codec_thread="both")
    todo = cases(args)
    assert [c.label for c in todo] == ["ar", "pcg L=3", "ar in-line codec", "pcg L=3 in-line codec"]
    summaries = [{"policy": c.policy, "codec_thread": c.codec_thread, "tokens_per_second": tps, "t_target_step": None}
                 for c, tps in zip(todo, (100.0, 120.0, 80.0, 100.0))]
    add_speedups(summaries)
    assert [s["speedup_vs_ar"] for s in summaries] == [1.0, 1.2, 1.0, 1.25]


def test_a_theta_sweep_gives_every_pcg_rule_its_tables_and_leaves_the_others_alone():
    import argparse

    from pcgtts.cli.bench import cases

    args = argparse.Namespace(policy=["ar", "eagle-pcg", "eagle-sd", "pcg"], draft_length=[3], theta=[0.8, 0.9],
                              beta=None, adaptive=False, codec_thread=None)
    assert [(c.policy, c.theta) for c in cases(args)] == [
        ("ar", None), ("eagle-pcg", 0.8), ("eagle-pcg", 0.9), ("eagle-sd", None), ("pcg", 0.8), ("pcg", 0.9)]


def test_an_adaptive_case_is_predicted_with_the_costs_its_loop_learned_and_with_those_measured_at_load():
    """The prediction for an adaptive case uses the costs each utterance's loop had moved its plan to
    (their mean over utterances); the load-time one is kept beside it. Hand-checked numbers: with
    rates 0.5 and only L = 1 steps, tokens 1.5 a step; planned: 1.5 x 1.0 / (0.2 + 1.2 + 0.1) = 1.0,
    learned (AR 1.3 + 0.1, verify 1.8, rule 0.2): 1.5 x 1.4 / (0.2 + 1.8 + 0.2) = 0.9545..."""
    from pcgtts.tools.bench import _mean_costs, predicted_speedup

    planned = {"target_forward": [1.0, 1.2], "draft_forward": [0.2, 0.2], "rule": 0.1, "sample": 0.0}
    learned = [{"target_forward": [1.3, 1.7], "draft_forward": [0.2, 0.2], "rule": 0.1, "sample": 0.1},
               {"target_forward": [1.3, 1.9], "draft_forward": [0.2, 0.2], "rule": 0.3, "sample": 0.1}]
    mean = _mean_costs(learned)
    assert mean["target_forward"] == pytest.approx([1.3, 1.8]) and mean["draft_forward"] == pytest.approx([0.2, 0.2])
    assert (mean["rule"], mean["sample"]) == pytest.approx((0.2, 0.1))
    assert _mean_costs([]) is None
    summary = {"conditional_acceptance": [0.5], "length_counts": [0, 10], "tokens": 15, "catchup_tokens": 0,
               "planned_costs": planned, "learned_costs": mean, "policy": "sd"}
    assert predicted_speedup(summary, {}, at_load=True) == pytest.approx(1.0)
    assert predicted_speedup(summary, {}) == pytest.approx(1.5 * 1.4 / 2.2)
    assert predicted_speedup(dict(summary, learned_costs=None), {}) == pytest.approx(1.0)


def test_an_adaptive_prediction_counts_the_tokens_its_steps_emitted_not_rates_pooled_over_lengths():
    """10 steps of L = 1 that emitted 1 token each (nothing accepted) and 10 of L = 2 that emitted 3
    each: 40 tokens. Pooled rates (a_1 = 10 / 20, a_2 = 1) would credit the L = 1 steps with 1.5
    tokens each (45). Costs: AR 1.0; L = 1: 0.2 + 1.2; L = 2: 0.4 + 1.4; 10 catch-up tokens: the
    draft's forward of 11 tokens less one of 1 (0.3 + 9 x 0.1 - 0.2 = 1.0): 40 / (14 + 18 + 1)."""
    from pcgtts.runtime.decode.cost_model import StepCosts, counted_seconds
    from pcgtts.tools.bench import predicted_speedup

    planned = {"target_forward": [1.0, 1.2, 1.4], "draft_forward": [0.2, 0.3], "rule": 0.0, "sample": 0.0}
    summary = {"conditional_acceptance": [0.5, 1.0], "length_counts": [0, 10, 10], "tokens": 40,
               "catchup_tokens": 10, "planned_costs": planned, "learned_costs": None, "policy": "sd"}
    assert counted_seconds(StepCosts(**planned), [0, 10, 10], 10) == pytest.approx(33.0)
    assert predicted_speedup(summary, {}) == pytest.approx(40 / 33.0)
    pooled = (10 * 1.5 + 10 * 3) / 33.0  # what rates pooled over the mix would have claimed
    assert predicted_speedup(summary, {}) < pooled


def test_a_per_token_overhead_pulls_the_prediction_toward_one_and_is_read_from_the_ar_case():
    """AR at 400 tok/s with 2 ms of forward + sampling a token: 0.5 ms a token outside any step.
    A fixed-length case of 2 tokens a verify (rates 1.0 at L = 1) at 3 ms a step: 1.5 ms a token,
    predicted 2 / 1.5; with the overhead on both sides (2 + 0.5) / (1.5 + 0.5) = 1.25. An adaptive
    case's model seconds (the second test above, 40 tokens in 33 s, AR 1.0 s) take it the same way."""
    from pcgtts.tools.bench import per_token_overhead, predicted_speedup

    ar = {"tokens_per_second": 400.0, "t_target_step": 0.002}
    assert per_token_overhead(ar) == pytest.approx(0.0005)
    assert per_token_overhead({"tokens_per_second": 600.0, "t_target_step": 0.002}) == 0.0  # never negative
    fixed = {"conditional_acceptance": [1.0], "policy": "sd", "draft_length": 1, "t_draft_step": 0.001,
             "t_target_step": 0.002}
    assert predicted_speedup(fixed, ar) == pytest.approx(2 / 1.5)
    assert predicted_speedup(fixed, ar, overhead=0.0005) == pytest.approx(2.5 / 2.0)
    planned = {"target_forward": [1.0, 1.2, 1.4], "draft_forward": [0.2, 0.3], "rule": 0.0, "sample": 0.0}
    adaptive = {"conditional_acceptance": [0.5, 1.0], "length_counts": [0, 10, 10], "tokens": 40,
                "catchup_tokens": 10, "planned_costs": planned, "learned_costs": None, "policy": "sd"}
    assert predicted_speedup(adaptive, ar, overhead=0.5) == pytest.approx(1.5 / (33.0 / 40 + 0.5))
    assert 1.0 < predicted_speedup(adaptive, ar, overhead=0.5) < predicted_speedup(adaptive, ar)
