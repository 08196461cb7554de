"""benchmarks/bench_many_streams.py against a stub server (seconds): it starts each configuration's
server, runs the levels, reads memory, CPU time and /metrics, stops it and writes the report."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import benchmark_script


STUB = textwrap.dedent('''
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    (open(sys.argv[0] + ".flags", "a")).write(json.dumps(args) + "\\n")
    codec = [0.0]  # like pcgtts_codec_seconds_total: grows by CODEC_S a request

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def send(self, status, body, kind="application/json", headers=()):
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            for key, value in headers:
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self.send(200, json.dumps({"status": "ok", "workers": 1, "streams": 4}).encode())
            else:
                text = ("# HELP x\\npcgtts_batch_occupancy 0.5\\npcgtts_audio_seconds_total 3.0\\n"
                        f"pcgtts_codec_seconds_total {codec[0]}\\n")
                self.send(200, text.encode(), "text/plain")

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            busy = time.thread_time() + BUSY_S  # CPU time a request takes on the server
            while time.thread_time() < busy:
                pass
            codec[0] += CODEC_S
            self.send(200, b"\\0\\0" * 2400, "audio/pcm", [("x-sample-rate", "24000")])

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
''').replace("BUSY_S", "0.15").replace("CODEC_S", "0.05")


@pytest.fixture
def bench(tmp_path, monkeypatch):
    module = benchmark_script("bench_many_streams", monkeypatch)  # its dataclass looks itself up there
    stub = tmp_path / "stub_server.py"
    stub.write_text(STUB)
    monkeypatch.setattr(module, "SERVER", (sys.executable, str(stub)))
    return module, stub


def served_flags(stub: Path) -> list[list[str]]:
    """Each started stub server's argv, in order."""
    return [json.loads(line) for line in Path(str(stub) + ".flags").read_text().splitlines()]


@pytest.mark.slow
def test_runs_the_three_servers_and_writes_the_report(bench, tmp_path, capsys):
    module, stub = bench
    out = tmp_path / "results" / "many_streams.json"
    assert module.main(["--levels", "1,2", "--requests", "1", "--max-minutes", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == doc
    assert [c["name"] for c in doc["configurations"]] == ["default", "per-worker", "batched"]
    flags = served_flags(stub)
    # the server users run: no backend and no policy flag; per-worker on torch; the batch picks its own
    assert "--backend" not in flags[0] and "--workers" in flags[0] and "--max-batch" not in flags[0]
    assert flags[1][flags[1].index("--backend") + 1] == "torch" and "--backend" not in flags[2]
    assert "--workers" in flags[1] and "--max-batch" in flags[2] and "--max-batch" not in flags[1]
    assert not any("--policy" in f for f in flags) and doc["policy"] is None
    for config in doc["configurations"]:
        assert config["server_flags"][2:] == flags[doc["configurations"].index(config)][2:]
        assert [r["clients"] for r in config["levels"]] == [1, 2]
        assert [r["completed"] for r in config["levels"]] == [1, 2]
        first, second = config["levels"]
        assert first["x_one_stream"] == 1.0
        assert second["x_one_stream"] == pytest.approx(second["audio_s_per_s"] / first["audio_s_per_s"], rel=0.02)
        assert first["refused_429"] == first["errors"] == 0 and first["ttfa_p99_ms"] > 0
        assert config["rss_mib"] > 0 and config["metrics"]["pcgtts_batch_occupancy"] == 0.5
        for row in config["levels"]:  # each request burns 0.15 s of the server's CPU and counts 0.05 codec s
            assert 0.15 * row["completed"] - 0.03 <= row["cpu_s"] < 0.15 * row["completed"] + 0.5  # clock ticks
            assert row["cores_busy"] > 0  # over the bench's own timing of the level (`where_time_went`, below)
            assert row["codec_share"] == pytest.approx(0.05 * row["completed"] / row["cpu_s"], abs=0.01)
    assert doc["commit"] and doc["machine"]["cpus"]
    assert "codec_share" not in doc and "codec_share_note" not in doc


def test_a_policy_given_goes_to_every_server(bench, tmp_path):
    module, stub = bench
    out = tmp_path / "r.json"
    assert module.main(["--levels", "1", "--requests", "1", "--policy", "pcg", "--configs", "batched,default",
                        "--json", str(out)]) == 0
    flags = served_flags(stub)
    assert [f[f.index("--policy") + 1] for f in flags] == ["pcg", "pcg"]
    assert "--max-batch" in flags[0] and "--backend" not in flags[1]
    assert json.loads(out.read_text())["policy"] == "pcg"


def test_where_the_time_went_without_a_codec_count_or_psutil(bench):
    module, _ = bench
    assert module.where_time_went(3.0, 2.0, 0.75) == {"cpu_s": 3.0, "cores_busy": 1.5, "codec_share": 0.25}
    assert module.where_time_went(3.0, 2.0, None) == {"cpu_s": 3.0, "cores_busy": 1.5, "codec_share": None}
    assert module.where_time_went(None, 2.0, 0.75) == {"cpu_s": None, "cores_busy": None, "codec_share": None}


def test_a_server_that_dies_is_reported_not_hung(bench, tmp_path, capsys):
    module, stub = bench
    stub.write_text("import sys; print('no such model'); sys.exit(3)")
    out = tmp_path / "r.json"
    assert module.main(["--levels", "1", "--requests", "1", "--configs", "batched", "--json", str(out)]) == 1
    config = json.loads(out.read_text())["configurations"][0]
    assert "exited (3)" in config["error"] and "no such model" in config["error"] and config["levels"] == []
    assert "failed: the server exited" in capsys.readouterr().out


def test_level_row_counts_429s_apart_from_errors(bench):
    module, _ = bench
    report = {"clients": 4, "completed": 5, "failed": 3, "refused_429": 2, "ttfa_p50_s": 0.1234, "ttfa_p99_s": 0.5,
              "rtf_p50": 0.5, "underruns": 4, "streams_with_underruns": 1, "throughput_audio_s_per_s": 3.0,
              "elapsed_s": 2.0}
    row = module.level_row(report, one_stream=1.5)
    assert (row["refused_429"], row["errors"], row["x_one_stream"], row["ttfa_p50_ms"]) == (2, 1, 2.0, 123.4)
    assert module.level_row(report, one_stream=None)["x_one_stream"] is None


@pytest.mark.parametrize("flags, message", [
    (["--configs", "batched,fast"], "default,per-worker,batched"),
    (["--configs", "default,default"], "default,per-worker,batched"),
    (["--policy", "fast"], "--policy"),
    (["--requests", "0"], "--requests"),
    (["--levels", "0"], "[1, 64]"),
    (["--max-batch", "1"], "--max-batch"),
    (["--max-minutes", "0"], "--max-minutes"),
    (["--json", "tests"], "not a file that can be written"),
    (["--json", "README.md/x.json"], "not a file that can be written"),
])
def test_bad_flags_fail_before_any_server_starts(bench, flags, message, capsys):
    module, stub = bench
    with pytest.raises(SystemExit) as stop:
        module.main(flags)
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not Path(str(stub) + ".flags").exists()
