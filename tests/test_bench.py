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
