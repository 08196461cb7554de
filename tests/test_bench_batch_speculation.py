"""benchmarks/bench_batch_speculation.py: flags checked before any model loads; a short run on the
built-in voice reports each policy alone and in a batch in `pcgtts bench --json`'s form."""

from __future__ import annotations

import json

import pytest

from helpers import benchmark_script


@pytest.fixture
def bench(monkeypatch):
    module = benchmark_script("bench_batch_speculation", monkeypatch)
    monkeypatch.setattr(module, "load", lambda args: pytest.fail("a model was loaded"))
    return module


@pytest.mark.parametrize("flags, message", [
    (["--streams", "1"], "--streams"),
    (["--tokens", "4"], "--tokens"),
    (["--rounds", "0"], "--rounds"),
    (["--policies", "fast"], "policy must be one of"),
    (["--voice", "tests"], "no target/ folder"),
    (["--json", "tests"], "not a file"),
])
def test_bad_flags_exit_before_any_model_loads(bench, flags, message, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.main(flags)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_ar_is_always_the_first_policy(bench):
    assert bench.policies("eagle-pcg,pcg") == ["ar", "eagle-pcg", "pcg"]


def test_the_bound_is_what_a_free_proposer_gains_at_the_measured_passes(bench):
    """Every proposal accepted and a verify of 4 tokens costing a plain step: 4x; a pass whose time
    grows with every token carried gives nothing back; no measured acceptance: no gain."""
    assert bench.bound([1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]) == pytest.approx(4.0)
    assert bench.bound([0.5], [1.0, 2.0, 3.0, 4.0]) == 1.0  # 1.5 tokens for 2 tokens' time: plain wins
    assert bench.bound([0.5], [1.0, 1.2, 1.4, 1.6]) == pytest.approx(max(1.5 / 1.2, 1.75 / 1.4, 1.875 / 1.6))
    assert bench.bound([], [1.0, 1.0]) == 1.0


def test_streams_together_are_timed_while_all_of_them_decode(bench):
    """The window opens at the last stream's first burst (its prefill done) and closes at the first
    stream's last: tokens outside it, decoded beside another's prefill or alone at the end, do not count."""
    early = [(0.0, 1), (1.0, 2), (2.0, 2), (3.0, 2), (5.0, 2)]  # started first, ended last
    late = [(1.5, 1), (2.5, 3), (4.0, 3)]  # prefilled while the first decoded
    assert bench.together_window([early, late]) == [(4, 2.5), (6, 2.5)]
    with pytest.raises(ValueError, match="never decoded together"):
        bench.together_window([[(0.0, 1), (1.0, 1)], [(2.0, 1), (3.0, 1)]])


@pytest.mark.slow
def test_a_short_run_reports_each_policy_alone_and_together(tmp_path, capsys):
    module = benchmark_script("bench_batch_speculation")
    out = tmp_path / "spec.json"
    assert module.main(["--streams", "2", "--tokens", "12", "--policies", "ar,pcg", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
    cases = {s["case"]: s for s in report["summaries"]}
    assert set(cases) == {"B = 1 stream, plain decoding", "B = 2 streams, plain decoding", "B = 1 stream, pcg",
                          "B = 2 streams, pcg"}
    assert cases["B = 1 stream, plain decoding"]["speedup_vs_ar"] == 1.0
    assert all(s["tokens_per_second"] > 0 for s in cases.values())
    together = cases["B = 2 streams, pcg"]
    assert together["speedup_kept"] == pytest.approx(
        together["per_stream_speedup_vs_ar_in_batch"] / cases["B = 1 stream, pcg"]["speedup_vs_ar"])
    assert set(report["pass_seconds"]) == {"1", "2"} and all(len(t) == 4 for t in report["pass_seconds"].values())
    assert together["predicted_at_most"] >= 1.0 and cases["B = 1 stream, pcg"]["predicted_at_most"] >= 1.0
