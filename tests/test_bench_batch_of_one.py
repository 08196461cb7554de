"""benchmarks/bench_batch_of_one.py on the tiny test models (seconds): one stream through the batch against
today's loop, paired round by round; bad flags stop it before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import benchmark_script

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return benchmark_script("bench_batch_of_one", monkeypatch)


def model_flags(models: dict) -> list[str]:
    return ["--target", str(models["target"]), "--draft", str(models["draft"]), "--codec", str(models["codec"])]


def test_one_round_of_ar_reports_both_and_their_ratio(bench, tiny_models, tmp_path, capsys):
    out = tmp_path / "batch_of_one.json"
    assert bench.main([*model_flags(tiny_models), "--policies", "ar", "--rounds", "1", "--max-tokens", "12",
                       "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    printed = capsys.readouterr().out.strip().splitlines()
    assert json.loads(printed[-1]) == doc and any(line.split()[:1] == ["ar"] for line in printed)
    assert doc["benchmark"] == "batch_of_one" and doc["backend"] == "torch" and doc["max_batch"] == 8
    assert doc["commit"] and doc["machine"]["cpus"] and doc["date"] and doc["command"].endswith(str(out))
    (row,) = doc["policies"]
    assert (row["policy"], row["in_batch"], row["adaptive"]) == ("ar", True, False)
    (one,) = row["rounds"]
    assert one["first"] == "today" and one["seed"] == 0
    for lane in ("today", "batch"):
        figures = one[lane]
        assert figures["tokens"] > 0 and figures["ttfa_ms"] > 0
        assert figures["tok_s"] == pytest.approx(figures["tokens"] / figures["wall_s"], rel=0.01)
    assert one["batch"]["tokens"] == one["today"]["tokens"]  # seeded alike: the same stream either way
    assert one["ratio"] == pytest.approx(one["batch"]["tok_s"] / one["today"]["tok_s"], rel=1e-3)
    assert row["ratio"] == row["ratio_min"] == row["ratio_max"] == pytest.approx(one["ratio"], rel=1e-3)
    assert row["today_tok_s"] == pytest.approx(one["today"]["tok_s"]) and row["batch_ttfa_ms"] == one["batch"]["ttfa_ms"]


def test_rounds_alternate_which_goes_first_and_pair_their_ratios(bench):
    def lane(tok_s):
        return {"tokens": 10, "wall_s": 10 / tok_s, "tok_s": tok_s, "ttfa_ms": 100.0}

    rounds = [{"seed": s, "first": f, "today": lane(t), "batch": lane(b), "ratio": b / t}
              for s, f, t, b in ((0, "today", 10.0, 9.0), (1, "batch", 20.0, 10.0), (2, "today", 10.0, 12.0))]
    row = bench.summarize("pcg", {"adaptive": True, "in_batch": True}, rounds)
    assert (row["ratio"], row["ratio_min"], row["ratio_max"]) == (0.9, 0.5, 1.2)
    assert (row["today_tok_s"], row["batch_tok_s"]) == (10.0, 10.0)  # medians of each, not the ratio of medians
    assert bench.label(row) == "pcg (adaptive)" and bench.label({**row, "in_batch": False}).endswith("not batched)")


@pytest.mark.parametrize("flags, message", [
    (["--rounds", "0"], "--rounds"),
    (["--max-batch", "1"], "--max-batch"),
    (["--policies", "ar,fast"], "distinct policies"),
    (["--backend", "onnxruntime"], "torch backend"),
    (["--policies", "pcg"], "group table"),  # the tiny models have none
    (["--json", "tests"], "is a directory"),
    (["--json", "no/such/folder/x.json"], "does not exist"),
])
def test_bad_flags_exit_2_before_any_model_loads(bench, tiny_models, monkeypatch, flags, message, capsys):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model loaded")

    monkeypatch.setattr("pcgtts.runtime.synthesizer.Synthesizer.load", no_loading)
    with pytest.raises(SystemExit) as stop:
        bench.main([*model_flags(tiny_models), *flags])
    assert stop.value.code == 2 and message in capsys.readouterr().err
