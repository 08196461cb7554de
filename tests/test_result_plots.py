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


def level(clients: int, audio: float, ttfa_p99: float, x_one: float | None = None, cpu_s: float | None = None,
          codec_s: float | None = None) -> dict:
    """A level's row; with `cpu_s` (and `codec_s`) the server's CPU figures over its 3 s, as the benchmark
    records them now (an older record has none)."""
    row = {"clients": clients, "completed": 2 * clients, "ttfa_p50_ms": ttfa_p99 / 2, "ttfa_p99_ms": ttfa_p99,
           "rtf_p50": 0.5, "underruns": 0, "streams_behind": 0, "audio_s_per_s": audio, "x_one_stream": x_one,
           "refused_429": 0, "errors": 0, "elapsed_s": 3.0}
    if cpu_s is not None:
        row.update(cpu_s=cpu_s, cores_busy=round(cpu_s / 3.0, 2),
                   codec_share=None if codec_s is None else round(codec_s / cpu_s, 3))
    return row


def served(*flags: str) -> list[str]:
    return ["--host", "127.0.0.1", "--port", "40000", *flags]


MANY = {"benchmark": "many_streams", "machine": {"cpus": 16, "torch": "2.13.0", "gpu": "a GPU"},
        "date": "2026-12-02", "commit": "abcdef1", "command": "python benchmarks/bench_many_streams.py",
        "requests_per_client": 2, "policy": None,
        "configurations": [
            {"name": "default", "about": "what users run, 2 workers", "rss_mib": 900.0,
             "server_flags": served("--workers", "2", "--queue-size", "64"),
             "levels": [level(1, 3.0, 200.0, 1.0, 3.6, 0.9), level(2, 5.0, 250.0, 1.67, 6.0, 1.8),
                        level(4, 5.0, 700.0, 1.67, 6.0)]},
            {"name": "per-worker", "about": "2 workers", "rss_mib": 2048.4,
             "server_flags": served("--backend", "torch", "--workers", "2", "--queue-size", "64"),
             "levels": [level(1, 1.5, 300.0, 1.0, 3.0, 0.6), level(2, 3.0, 310.0, 2.0, 6.0, 1.2),
                        level(4, 3.0, 900.0, 2.0, 6.0, 1.2)]},
            {"name": "batched", "about": "one worker, 16 streams", "rss_mib": 1024.0,
             "server_flags": served("--backend=torch", "--max-batch", "16", "--queue-size", "64", "--policy", "pcg"),
             "levels": [level(1, 1.5, 320.0, 1.0, 3.0, 0.6), level(2, 2.7, 330.0, 1.8, 4.5, 0.9),
                        level(4, 6.0, 400.0, 4.0, 6.0, 1.5)]}]}
# as the benchmark wrote it before it measured the CPU: two servers on one route, no CPU figures
OLD_MANY = {**{k: v for k, v in MANY.items() if k != "configurations"}, "policy": "ar", "backend": "torch",
            "codec_share": None, "codec_share_note": "the codec's share of the time is not measured",
            "configurations": [
                {"name": "per-worker", "about": "2 workers",
                 "server_flags": served("--backend", "torch", "--policy", "ar", "--workers", "2"),
                 "levels": [level(1, 1.5, 300.0, 1.0), level(2, 3.0, 310.0, 2.0)]},
                {"name": "batched", "about": "one worker, 16 streams",
                 "levels": [level(1, 1.5, 320.0, 1.0), level(2, 2.7, 330.0, 1.8)]}]}
SPEED_PAGE = results_pages.Page(Path("BENCHMARKS.md"), Path("benchmarks/results/speed.json"), Path("m.md"), 600)
SPEED = {"title": "Speed", "machines": {}, "tables": []}


def tables_of(page: list[str]) -> list[int]:
    """The lines where the page's many-streams tables start (their header)."""
    return [i for i, line in enumerate(page) if line.startswith("| concurrent streams")]


def test_many_streams_get_a_section_with_a_table_per_server_and_a_picture(tmp_path):
    plot = result_plots.many_streams_plot(MANY)
    assert plot.path == Path("docs/img/many-streams.png")
    data = json.loads(plot.data)
    assert [s["name"] for s in data["series"]] == ["default", "per-worker", "batched"]  # a line each
    assert data["series"][2]["ttfa_p99_ms"] == [320.0, 330.0, 400.0] and data["series"][2]["clients"] == [1, 2, 4]
    assert "per-worker" not in data["title"] and "per-worker" not in plot.alt
    assert result_plots.write(tmp_path, [plot]) == [tmp_path / plot.path]
    width, height, texts = result_plots.png_info(tmp_path / plot.path)
    assert (width, height) == result_plots.SIZE_PX and texts["Description"] == plot.stamp

    page = results_pages.render_page(SPEED_PAGE, SPEED, "Method.", many_streams=MANY).splitlines()
    assert "- Many streams at once" in page
    heading = page.index("## Many streams at once")
    assert page[heading + 2] == f"![{plot.alt}](docs/img/many-streams.png)"
    tables = tables_of(page)
    assert len(tables) == 3 and "×" not in page[tables[0]].split("× its 1 stream")[1]
    assert all(page[t].endswith("| cores busy | codec share of CPU | audio s per s × default |") for t in tables[1:])
    assert page[tables[0] + 2] == "| 1 | 100 | 200 | 0 | 0 | 3.00 | 1.00 | 0 | 0 | 1.20 | 0.25 |"
    assert page[tables[0] + 4].endswith("| 0 | 0 | 2.00 |  |")  # a level without the codec's count: a blank
    # each configuration's aggregate audio against the first's (default) at the same level
    assert [page[tables[1] + 2 + i].split(" | ")[-1] for i in range(3)] == ["0.50 |", "0.60 |", "0.60 |"]
    assert [page[tables[2] + 2 + i].split(" | ")[-1] for i in range(3)] == ["0.50 |", "0.54 |", "1.20 |"]
    assert any("2,048 MiB" in line for line in page) and any("a GPU; 16 CPU cores" in line for line in page)
    # each configuration's route, from its own flags
    routes = {line.split("**")[1]: line.split("; route: ")[1].split(";")[0] for line in page if "; route: " in line}
    assert routes == {"default": "the voice's own backend (on a CPU its onnxruntime graphs), its default policy",
                      "per-worker": "torch backend, its default policy", "batched": "torch backend, policy pcg"}
    assert not any("the same route for all" in line for line in page)


def test_an_older_many_streams_record_still_renders_with_blank_cells():
    page = results_pages.render_page(SPEED_PAGE, SPEED, "Method.", many_streams=OLD_MANY).splitlines()
    tables = tables_of(page)
    assert len(tables) == 2 and page[tables[1]].endswith("| audio s per s × per-worker |")
    assert page[tables[0] + 2] == "| 1 | 150 | 300 | 0 | 0 | 1.50 | 1.00 | 0 | 0 |  |  |"
    assert page[tables[1] + 3].endswith("| 0 | 0 |  |  | 0.90 |")
    routes = [line.split("; route: ")[1].rstrip(".") for line in page if "; route: " in line]
    assert routes == ["torch backend, policy ar"] * 2  # the second from the record's own backend and policy
    assert "The codec's share of the time is not measured." in page
    assert json.loads(result_plots.many_streams_plot(OLD_MANY).data)["series"][0]["name"] == "per-worker"


BATCH_OF_ONE = {"benchmark": "batch_of_one", "machine": {"cpus": 2, "torch": "2.13.0"}, "date": "2026-12-03",
                "commit": "abcdef2", "command": "python benchmarks/bench_batch_of_one.py", "backend": "torch",
                "max_batch": 8, "rounds": 6, "sentences": ["a.", "b.", "c.", "d."],
                "policies": [{"policy": "ar", "adaptive": False, "in_batch": True, "today_tok_s": 120.04,
                              "batch_tok_s": 108.0, "ratio": 0.9012, "ratio_min": 0.85, "ratio_max": 0.97,
                              "today_ttfa_ms": 80.2, "batch_ttfa_ms": 95.0, "rounds": []},
                             {"policy": "pcg", "adaptive": True, "in_batch": True, "today_tok_s": 150.0,
                              "batch_tok_s": None, "ratio": None, "ratio_min": None, "ratio_max": None,
                              "today_ttfa_ms": 70.0, "batch_ttfa_ms": None, "rounds": []}]}


def test_one_stream_through_the_batch_is_a_small_table_in_the_many_streams_section():
    page = results_pages.render_page(SPEED_PAGE, SPEED, "Method.", many_streams=MANY,
                                     batch_of_one=BATCH_OF_ONE).splitlines()
    heading = page.index("### One stream through the batch against today's loop")
    assert page.index("## Many streams at once") < heading and page.count("## Many streams at once") == 1
    assert page[heading + 4].startswith("| policy | today's loop tok/s | the batch tok/s | batch / today |")
    assert page[heading + 6] == "| ar | 120.0 | 108.0 | 0.90 (0.85-0.97) | 80 | 95 |"
    assert page[heading + 7] == "| pcg (adaptive) | 150.0 |  |  | 70 |  |"
    assert "- `python benchmarks/bench_batch_of_one.py`" in page and "max_batch` 8" in page[heading + 2]
    # without a many-streams record, the section still holds it
    alone = results_pages.render_page(SPEED_PAGE, SPEED, "Method.", batch_of_one=BATCH_OF_ONE).splitlines()
    assert "- Many streams at once" in alone and alone.index("## Many streams at once") < alone.index(page[heading])
    with pytest.raises(ValueError, match=r"batch_of_one.json: no commit$"):
        results_pages.render_batch_of_one({k: v for k, v in BATCH_OF_ONE.items() if k != "commit"})


@pytest.mark.parametrize("name, record, drawn, shown", [
    ("many_streams.json", MANY, ["BENCHMARKS.md", "docs/img/many-streams.png"], "## Many streams at once"),
    ("batch_of_one.json", BATCH_OF_ONE, ["BENCHMARKS.md"], "### One stream through the batch"),
])
def test_no_record_no_section_and_one_makes_the_page_stale(tmp_path, name, record, drawn, shown):
    from test_results_pages import copy_of_the_tree

    root = copy_of_the_tree(tmp_path)
    path = root / "benchmarks/results" / name
    for record_file in ("many_streams.json", "batch_of_one.json"):  # the section's records, both gone
        (root / "benchmarks/results" / record_file).unlink(missing_ok=True)
    results_pages.write_files(root)
    assert shown not in (root / "BENCHMARKS.md").read_text()
    assert results_pages.stale_files(root) == []
    path.write_text(json.dumps(record))
    assert results_pages.stale_files(root) == [root / d for d in drawn]
    assert set(results_pages.write_files(root)) == {root / d for d in drawn}
    assert shown in (root / "BENCHMARKS.md").read_text() and results_pages.stale_files(root) == []


def test_a_many_streams_record_without_its_command_is_refused_in_one_line():
    broken = {k: v for k, v in MANY.items() if k != "command"}
    with pytest.raises(ValueError, match=r"many_streams.json: no command$"):
        results_pages.render_many_streams(broken)
    assert result_plots.many_streams_plot(None) is None
    assert result_plots.many_streams_data({"configurations": [{"name": "x", "levels": []}]}) is None
