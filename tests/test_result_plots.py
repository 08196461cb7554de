"""The results pages' pictures (tools/result_plots.py): drawn from the tables' rows, of a fixed size, the same
bytes each time, embedded above their table in QUALITY.md and in the site's quality page, and left out
when a table has nothing to draw or matplotlib is missing."""

from __future__ import annotations

import copy
import json
import logging
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import results_pages  # noqa: E402  (a script in tools/, imported by path)
from pcgtts.tools import result_plots  # noqa: E402  (the module results_pages draws with)

pytest.importorskip("matplotlib")


def row(label: str, figures: dict, baseline: str = "ar in the same run") -> dict:
    return {"label": label, "figures": figures, "baseline": baseline, "date": "2026-12-01", "commit": "abcdef1",
            "cmd": "A"}


DOC = {"title": "Quality", "machines": {"cpu": "a small CPU"}, "tables": [
    {"id": "builtin-rules", "title": "Built-in voice (lab-v9) · every rule", "machine": "cpu",
     "commands": {"A": "pcgtts eval --mode synth"}, "rows": [
         row("ar", {"n": 60, "wer": {"mean": 23.5, "pm": 5.0}}, "itself"),
         row("eagle-pcg", {"n": 60, "x_ar": 1.22, "wer": {"mean": 23.2, "pm": 5.0}}),
         row("pcg (no interval)", {"n": 60, "x_ar": 0.54, "wer": 31.6}),
         row("sd (no WER)", {"n": 60, "x_ar": 0.48})]},
    {"id": "presets", "title": "Built-in voice (lab-v9) · preset voices", "machine": "cpu",
     "commands": {"A": "pcgtts eval --mode voices"}, "rows": [
         row("heart (the default preset)", {"n": 20, "wer": {"mean": 29.2, "pm": 6.8},
                                            "self_id": "20 / 20 = 100 % [84, 100]"}, "the other presets"),
         row("slt", {"n": 20, "wer": 65.3, "self_id": "17 / 20 = 85 %"}, "the other presets")]}]}
PAGE = results_pages.Page(Path("QUALITY.md"), Path("benchmarks/results/quality.json"), Path("method.md"), 400)


def test_a_figure_reads_as_mean_and_interval_whatever_form_the_record_gives():
    assert result_plots.estimate({"mean": 23.5, "pm": 5.0}) == [23.5, 18.5, 28.5]
    assert result_plots.estimate(31.6) == [31.6, None, None]
    assert result_plots.estimate("19 / 20 = 95 % [76, 99]") == [95.0, 76.0, 99.0]
    assert result_plots.estimate("17 / 20 = 85 %") == [85.0, None, None]
    assert result_plots.estimate("3 / 4 held") is None and result_plots.estimate(None) is None


def test_both_tables_give_pictures_of_the_fixed_size_embedded_above_their_tables(tmp_path):
    results_pages.validate(DOC, "quality.json")
    plots = result_plots.plots_for(DOC)
    assert [p.path for p in plots] == [Path("docs/img/quality-frontier.png"), Path("docs/img/presets.png")]
    frontier = result_plots.frontier_data(DOC["tables"][0])
    assert frontier["plain"] == {"label": "ar", "wer": [23.5, 18.5, 28.5]}
    assert [p["label"] for p in frontier["points"]] == ["eagle-pcg", "pcg (no interval)"]  # no WER: no point
    assert "lab-v9" in frontier["title"]

    written = result_plots.write(tmp_path, plots)
    assert written == [tmp_path / p.path for p in plots]
    for plot in plots:
        width, height, texts = result_plots.png_info(tmp_path / plot.path)
        assert (width, height) == result_plots.SIZE_PX and texts["Description"] == plot.stamp
        assert "Software" not in texts  # no matplotlib version in the file
    assert result_plots.stale(tmp_path, plots) == [] and result_plots.write(tmp_path, plots) == []

    page = results_pages.render_page(PAGE, DOC, "How it is measured.").splitlines()
    heading = page.index("## Built-in voice (lab-v9) · every rule")
    assert page[heading + 2] == f"![{plots[0].alt}](docs/img/quality-frontier.png)"
    assert page[page.index("## Built-in voice (lab-v9) · preset voices") + 2].endswith("(docs/img/presets.png)")
    block = results_pages.render_docs_block(plots)
    assert "(img/quality-frontier.png)" in block and "(img/presets.png)" in block


def test_drawing_twice_gives_the_same_bytes(tmp_path):
    plots = result_plots.plots_for(DOC)
    result_plots.write(tmp_path, plots)
    for plot in plots:
        assert result_plots.render(plot) == (tmp_path / plot.path).read_bytes()


def test_a_changed_row_makes_its_picture_stale(tmp_path):
    result_plots.write(tmp_path, result_plots.plots_for(DOC))
    doc = copy.deepcopy(DOC)
    doc["tables"][1]["rows"][1]["figures"]["wer"] = 50.0
    assert result_plots.stale(tmp_path, result_plots.plots_for(doc)) == [tmp_path / "docs/img/presets.png"]


def test_a_table_with_nothing_to_draw_gives_no_picture_and_no_embed(tmp_path):
    assert result_plots.frontier_data({"title": "t", "rows": []}) is None
    assert result_plots.presets_data({"title": "t", "rows": []}) is None
    doc = copy.deepcopy(DOC)
    doc["tables"] = doc["tables"][1:]
    doc["tables"][0]["rows"] = [row("slt", {"n": 20, "cer": 43.8}, "the other presets")]
    assert result_plots.plots_for(doc) == []
    assert result_plots.write(tmp_path, []) == [] and not (tmp_path / "docs").exists()
    assert "![" not in results_pages.render_page(PAGE, doc, "How it is measured.")
    assert "![" not in results_pages.render_docs_block([])


def test_without_matplotlib_the_pictures_are_skipped_with_a_log_line_and_the_page_is_written(tmp_path, monkeypatch,
                                                                                            caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    plots = result_plots.plots_for(DOC)
    with caplog.at_level(logging.WARNING):
        assert result_plots.write(tmp_path, plots) == []
    assert "matplotlib is not installed" in caplog.text and not (tmp_path / "docs").exists()
    assert "(docs/img/presets.png)" in results_pages.render_page(PAGE, DOC, "How it is measured.")


def test_the_check_names_a_missing_picture_and_writing_draws_it_again(tmp_path):
    from test_results_pages import copy_of_the_tree

    root = copy_of_the_tree(tmp_path)
    assert results_pages.stale_files(root) == []
    (root / "docs/img/presets.png").unlink()
    assert results_pages.stale_files(root) == [root / "docs/img/presets.png"]
    assert results_pages.write_files(root) == [root / "docs/img/presets.png"]
    assert results_pages.stale_files(root) == []


def level(clients: int, audio: float, ttfa_p99: float, x_one: float | None = None) -> dict:
    return {"clients": clients, "completed": 2 * clients, "ttfa_p50_ms": ttfa_p99 / 2, "ttfa_p99_ms": ttfa_p99,
            "rtf_p50": 0.5, "underruns": 0, "streams_behind": 0, "audio_s_per_s": audio, "x_one_stream": x_one,
            "refused_429": 0, "errors": 0, "elapsed_s": 3.0}


MANY = {"benchmark": "many_streams", "machine": {"cpus": 16, "torch": "2.13.0", "gpu": "a GPU"},
        "date": "2026-12-02", "commit": "abcdef1", "command": "python benchmarks/bench_many_streams.py",
        "requests_per_client": 2, "policy": "ar", "backend": "torch",
        "codec_share_note": "the codec's share of the time is not measured",
        "configurations": [
            {"name": "per-worker", "about": "2 workers", "rss_mib": 2048.4,
             "levels": [level(1, 1.5, 300.0, 1.0), level(2, 3.0, 310.0, 2.0), level(4, 3.0, 900.0, 2.0)]},
            {"name": "batched", "about": "one worker, 16 streams", "rss_mib": 1024.0,
             "levels": [level(1, 1.5, 320.0, 1.0), level(2, 2.7, 330.0, 1.8), level(4, 6.0, 400.0, 4.0)]}]}
SPEED_PAGE = results_pages.Page(Path("BENCHMARKS.md"), Path("benchmarks/results/speed.json"), Path("m.md"), 600)


def test_many_streams_get_a_section_with_a_table_per_server_and_a_picture(tmp_path):
    plot = result_plots.many_streams_plot(MANY)
    assert plot.path == Path("docs/img/many-streams.png")
    data = json.loads(plot.data)
    assert [s["name"] for s in data["series"]] == ["per-worker", "batched"]
    assert data["series"][1]["ttfa_p99_ms"] == [320.0, 330.0, 400.0] and data["series"][1]["clients"] == [1, 2, 4]
    assert result_plots.write(tmp_path, [plot]) == [tmp_path / plot.path]
    width, height, texts = result_plots.png_info(tmp_path / plot.path)
    assert (width, height) == result_plots.SIZE_PX and texts["Description"] == plot.stamp

    page = results_pages.render_page(SPEED_PAGE, {"title": "Speed", "machines": {}, "tables": []}, "Method.",
                                     many_streams=MANY).splitlines()
    assert "- Many streams at once" in page
    heading = page.index("## Many streams at once")
    assert page[heading + 2] == f"![{plot.alt}](docs/img/many-streams.png)"
    tables = [i for i, line in enumerate(page) if line.startswith("| concurrent streams")]
    assert len(tables) == 2 and "× per-worker" not in page[tables[0]] and page[tables[1]].endswith("× per-worker |")
    assert page[tables[0] + 2] == "| 1 | 150 | 300 | 0 | 0 | 1.50 | 1.00 | 0 | 0 |"
    # the batched row's aggregate audio against the per-worker row at the same level
    assert [page[tables[1] + 2 + i].split(" | ")[-1] for i in range(3)] == ["1.00 |", "0.90 |", "2.00 |"]
    assert any("2,048 MiB" in line for line in page) and any("a GPU; 16 CPU cores" in line for line in page)


def test_no_many_streams_record_no_section_and_one_makes_the_page_and_picture_stale(tmp_path):
    from test_results_pages import copy_of_the_tree

    root = copy_of_the_tree(tmp_path)
    record = root / "benchmarks/results/many_streams.json"
    record.unlink(missing_ok=True)
    results_pages.write_files(root)
    assert "Many streams at once" not in (root / "BENCHMARKS.md").read_text()
    assert results_pages.stale_files(root) == []
    record.write_text(json.dumps(MANY))
    assert results_pages.stale_files(root) == [root / "BENCHMARKS.md", root / "docs/img/many-streams.png"]
    assert set(results_pages.write_files(root)) == {root / "BENCHMARKS.md", root / "docs/img/many-streams.png"}
    assert "## Many streams at once" in (root / "BENCHMARKS.md").read_text() and results_pages.stale_files(root) == []


def test_a_many_streams_record_without_its_command_is_refused_in_one_line():
    broken = {k: v for k, v in MANY.items() if k != "command"}
    with pytest.raises(ValueError, match=r"many_streams.json: no command$"):
        results_pages.render_many_streams(broken)
    assert result_plots.many_streams_plot(None) is None
    assert result_plots.many_streams_data({"configurations": [{"name": "x", "levels": []}]}) is None
