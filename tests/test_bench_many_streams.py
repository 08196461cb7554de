"""benchmarks/bench_many_streams.py against a stub server (seconds): it starts each configuration's
server, runs the levels, reads memory and /metrics, stops it and writes the report."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

STUB = textwrap.dedent('''
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    (open(sys.argv[0] + ".flags", "a")).write(json.dumps(args) + "\\n")

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
                self.send(200, b"# HELP x\\npcgtts_batch_occupancy 0.5\\npcgtts_audio_seconds_total 3.0\\n", "text/plain")

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send(200, b"\\0\\0" * 2400, "audio/pcm", [("x-sample-rate", "24000")])

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


@pytest.fixture
def bench(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_many_streams", ROOT / "benchmarks" / "bench_many_streams.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_many_streams", module)  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    stub = tmp_path / "stub_server.py"
    stub.write_text(STUB)
    monkeypatch.setattr(module, "SERVER", (sys.executable, str(stub)))
    return module, stub


def test_runs_both_servers_and_writes_the_report(bench, tmp_path, capsys):
    module, stub = bench
    out = tmp_path / "results" / "many_streams.json"
    assert module.main(["--levels", "1,2", "--requests", "1", "--max-minutes", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == doc
    assert [c["name"] for c in doc["configurations"]] == ["per-worker", "batched"]
    flags = [json.loads(line) for line in Path(str(stub) + ".flags").read_text().splitlines()]
    assert all(f[f.index("--backend") + 1] == "torch" and f[f.index("--policy") + 1] == "ar" for f in flags)
    assert "--workers" in flags[0] and "--max-batch" in flags[1] and "--max-batch" not in flags[0]
    for config in doc["configurations"]:
        assert config["server_flags"][2:] == flags[doc["configurations"].index(config)][2:]
        assert [r["clients"] for r in config["levels"]] == [1, 2]
        assert [r["completed"] for r in config["levels"]] == [1, 2]
        first, second = config["levels"]
        assert first["x_one_stream"] == 1.0
        assert second["x_one_stream"] == pytest.approx(second["audio_s_per_s"] / first["audio_s_per_s"], rel=0.02)
        assert first["refused_429"] == first["errors"] == 0 and first["ttfa_p99_ms"] > 0
        assert config["rss_mib"] > 0 and config["metrics"]["pcgtts_batch_occupancy"] == 0.5
    assert doc["commit"] and doc["machine"]["cpus"] and doc["codec_share"] is None


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
    (["--configs", "batched,fast"], "per-worker,batched"),
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
