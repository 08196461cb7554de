"""BENCHMARKS.md, QUALITY.md and the model card's figures are generated from benchmarks/results/*.json:
the committed pages equal what the JSON gives, stay within their length limits, and a run's JSON
becomes rows of a table."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import results_pages  # noqa: E402  (a script in tools/, imported by path)
from test_process_words import PROCESS_WORDS  # noqa: E402


def test_the_committed_pages_are_what_the_json_gives_and_within_their_limits():
    run = subprocess.run([sys.executable, "tools/results_pages.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def copy_of_the_tree(tmp_path: Path) -> Path:
    for page in results_pages.PAGES:
        for path in (page.path, page.data, page.method, *([page.first_speak] if page.first_speak else []),
                     *(extra for extra in (page.many_streams, page.batch_of_one) if extra and (ROOT / extra).is_file())):
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / path, tmp_path / path)
    for path in (results_pages.CARD, results_pages.DOCS_QUALITY, *(p.path for p in results_pages.expected_plots(ROOT))):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, tmp_path / path)
    return tmp_path


def test_a_page_edited_by_hand_fails_the_check(tmp_path):
    root = copy_of_the_tree(tmp_path)
    page = root / "BENCHMARKS.md"
    page.write_text(page.read_text().replace("762-768", "999"))
    assert results_pages.stale_files(root) == [page]


def test_a_bench_report_becomes_rows_and_replaces_the_rows_of_its_labels(tmp_path):
    root = copy_of_the_tree(tmp_path)
    report = {"date": "2026-11-28", "summaries": [
        {"case": "ar", "policy": "ar", "tokens_per_second": 500.0, "speedup_vs_ar": 1.0},
        {"case": "pcg L = 3 (the 3-layer draft)", "policy": "pcg", "tokens_per_second": 550.0,
         "speedup_vs_ar": 1.1, "predicted_speedup": 1.2, "acceptance_rate": 0.3, "mean_accepted_length": 1.9}]}
    (root / "bench.json").write_text(json.dumps(report))
    command = "pcgtts bench --policy ar,pcg --runs 3"
    results_pages.add_file(root, root / "bench.json", "cpu-builtin-int8", command, None, "abcdef1")
    table = next(t for t in results_pages.load(root / "benchmarks/results/speed.json")["tables"]
                 if t["id"] == "cpu-builtin-int8")
    rows = [r for r in table["rows"] if r["label"] == "pcg L = 3 (the 3-layer draft)"]
    assert len(rows) == 1 and rows[0]["figures"]["tok_s"] == 550.0 and rows[0]["commit"] == "abcdef1"
    assert table["commands"][rows[0]["cmd"]] == command
    results_pages.write_files(root)
    assert results_pages.stale_files(root) == []


def test_a_record_without_its_command_is_refused_in_one_line():
    doc = {"machines": {"cpu": "a CPU"}, "tables": [{"id": "t", "title": "T", "machine": "cpu", "commands": {"A": "x"},
           "rows": [{"label": "ar", "figures": {"tok_s": 1.0}, "baseline": "itself", "date": "2026-11-28",
                     "commit": "abcdef1", "cmd": "B"}]}]}
    with pytest.raises(ValueError, match="command 'B' is not in the table's commands"):
        results_pages.validate(doc, "doc")


def test_an_eval_results_file_becomes_rows_with_intervals_in_percent(tmp_path):
    root = copy_of_the_tree(tmp_path)
    est = lambda mean, half: {"mean": mean, "low": mean - half, "high": mean + half, "n": 60}  # noqa: E731
    result = {"mode": "synth", "summaries": [
        {"case": "ar", "baseline": "ar", "utterances": 60, "speedup_vs_ar": 1.0, "wer": est(0.235, 0.05)},
        {"case": "eagle-pcg L=3", "baseline": "ar", "utterances": 60, "speedup_vs_ar": 1.2, "acceptance_rate": 0.44,
         "wer": est(0.232, 0.05), "delta_wer": est(-0.004, 0.046), "delta_cer": est(-0.002, 0.03),
         "delta_sim": est(-0.001, 0.006)}]}
    (root / "run").mkdir()
    (root / "run" / "results.json").write_text(json.dumps(result))
    results_pages.add_file(root, root / "run", "builtin-rules", "pcgtts eval --mode synth --policies ar,eagle-pcg",
                           "2026-11-28", "abcdef1")
    table = next(t for t in results_pages.load(root / "benchmarks/results/quality.json")["tables"]
                 if t["id"] == "builtin-rules")
    row = next(r for r in table["rows"] if r["label"] == "eagle-pcg L=3")
    assert row["figures"]["d_wer"] == {"mean": -0.4, "pm": 4.6}
    assert row["figures"]["d_cer"] == {"mean": -0.2, "pm": 3.0}
    assert row["baseline"] == "ar in the same run"
    results_pages.write_files(root)
    assert "-0.4 ± 4.6" in (root / "QUALITY.md").read_text()


def test_a_consistency_run_becomes_one_row_per_voice(tmp_path):
    root = copy_of_the_tree(tmp_path)
    voice = {"readings": 2, "identity_holds": 2, "rate_holds": 1, "worst_rate_drift": 0.107,
             "first_last_cosine": [0.91, 0.89], "near_cosine_floor": [0.82, 0.83]}
    result = {"mode": "consistency", "summaries": [], "per_voice": {"heart-high": voice}}
    (root / "run").mkdir()
    (root / "run" / "results.json").write_text(json.dumps(result))
    results_pages.add_file(root, root / "run", "consistency", "pcgtts eval --mode consistency", "2026-12-01", "abcdef1")
    table = next(t for t in results_pages.load(root / "benchmarks/results/quality.json")["tables"]
                 if t["id"] == "consistency")
    row = next(r for r in table["rows"] if r["label"] == "heart-high")
    assert row["figures"] == {"first_last_cos": 0.9, "near_floor": 0.825, "id_holds": "2 / 2", "rate_drift": 10.7,
                              "rate_holds": "1 / 2"}
    results_pages.write_files(root)
    assert "| heart-high | 0.900 | 0.825 | 2 / 2 | +10.7 | 1 / 2 |" in (root / "QUALITY.md").read_text()


@pytest.mark.parametrize("argv", [["--table", "cpu-builtin-int8"], ["--command", "x"], ["--add", "f.json"],
                                  ["--add", "f.json", "--table", "t", "--command", "c", "--check"]])
def test_flags_that_would_be_ignored_are_refused_before_any_work(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        results_pages.main(argv)
    assert stop.value.code == 2 and "error:" in capsys.readouterr().err


def test_a_missing_run_file_is_a_one_line_error_and_changes_nothing(tmp_path, capsys):
    root = copy_of_the_tree(tmp_path)
    before = (root / "benchmarks/results/speed.json").read_text()
    code = results_pages.main(["--root", str(root), "--add", str(root / "none.json"), "--table", "cpu-builtin-int8",
                               "--command", "pcgtts bench"])
    assert code == 2 and capsys.readouterr().err.count("\n") == 1
    assert (root / "benchmarks/results/speed.json").read_text() == before


def test_the_pages_and_records_speak_of_the_measurements_not_of_how_the_work_was_scheduled():
    for path in [p.path for p in results_pages.PAGES] + [p.data for p in results_pages.PAGES] \
            + [p.method for p in results_pages.PAGES] + [results_pages.CARD, Path("train/DATA_CARD.md")]:
        found = [hit.group(0) for hit in PROCESS_WORDS.finditer((ROOT / path).read_text())]
        assert not found, f"{path}: {found}"
