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


def test_the_committed_pages_are_what_the_json_gives_and_within_their_limits():
    run = subprocess.run([sys.executable, "tools/results_pages.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def copy_of_the_tree(tmp_path: Path) -> Path:
    for page in results_pages.PAGES:
        for path in (page.path, page.data, page.method):
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / path, tmp_path / path)
    (tmp_path / results_pages.CARD).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / results_pages.CARD, tmp_path / results_pages.CARD)
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
