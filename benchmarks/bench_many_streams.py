"""Many streams at once: the server users run beside a per-worker torch server and a batched server, in
one run on one machine.

For each configuration this starts `pcgtts serve` on 127.0.0.1 (a free port, the built-in voice),
waits for /health, runs `benchmarks/load_serve.py`'s levels of concurrent clients against it, reads
the server's resident memory (its process and children: one model copy per worker shows here) and
its /metrics, and stops it:

- default: `--workers 2 --queue-size 64` and no backend or policy flag: what `pcgtts serve` runs for
  its users (the built-in voice's own route: on a CPU its onnxruntime graphs, its default policy);
- per-worker: `--backend torch --workers 2 --queue-size 64`, two model copies, one stream each at a time;
- batched: `--max-batch 16 --queue-size 64`, one worker decoding up to 16 streams together (its LMs on
  torch, its codec windows on the exported decoder graph: `runtime/config.py` `codec_graph_beside_a_batch`).

Each server decodes with its own default policy unless `--policy` names one for all of them.
Per configuration and level: TTFA p50/p99 (client side, queue wait included), underruns, streams that
fell behind real time, aggregate audio seconds per second and its ratio to the configuration's own
1-stream figure, 429s and other errors, and where the time went: the server's CPU seconds over the
level (user + system of its process and children), the cores they kept busy (CPU seconds / the level's
wall time) and the codec's share of them (the growth of /metrics' `pcgtts_codec_seconds_total`, the
codec's time on the streams' windows, / the CPU seconds; none when the server does not count it).
Progress on stderr, a table, then one JSON line; `--json PATH` writes it
(benchmarks/results/many_streams.json is what BENCHMARKS.md's "Many streams at once" is drawn from).

    python benchmarks/bench_many_streams.py --json benchmarks/results/many_streams.json
    python benchmarks/bench_many_streams.py --levels 1 --requests 1 --configs batched   # a smoke check
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load_serve  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
from pcgtts.runtime.config import POLICIES  # noqa: E402  (names only: torch is not imported)

ROOT = Path(__file__).resolve().parent.parent
RESULT = Path("benchmarks/results/many_streams.json")
SERVER = (sys.executable, "-m", "pcgtts.cli", "serve")
CODEC_SECONDS = "pcgtts_codec_seconds_total"  # the codec's time on the streams' windows (serve/metrics.py)
METRICS = ("pcgtts_batch_occupancy", "pcgtts_late_chunks_total", "pcgtts_audio_seconds_total", CODEC_SECONDS)
CONFIGS = ("default", "per-worker", "batched")


@dataclass(frozen=True)
class Configuration:
    """One server: its name in the results, what it is in words, and its `pcgtts serve` flags."""

    name: str
    about: str
    flags: tuple[str, ...]


def configurations(max_batch: int, workers: int) -> dict[str, Configuration]:
    return {
        "default": Configuration("default", f"what `pcgtts serve` runs for its users: the built-in voice's own "
                                 f"route, {workers} workers ({workers} model copies)",
                                 ("--workers", str(workers), "--queue-size", "64")),
        "per-worker": Configuration("per-worker", f"{workers} workers, one stream each at a time "
                                    f"({workers} model copies)",
                                    ("--backend", "torch", "--workers", str(workers), "--queue-size", "64")),
        "batched": Configuration("batched", f"one worker decoding up to {max_batch} streams together "
                                 "(one model copy)",
                                 ("--max-batch", str(max_batch), "--queue-size", "64")),
    }


def config_names(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a comma-separated subset of {','.join(CONFIGS)}, got {text!r}")
    return names


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(config: Configuration, port: int, policy: str | None, extra: list[str]) -> list[str]:
    """The configuration's `pcgtts serve` command line; `policy` (None: the server's own default) for every one."""
    return [*SERVER, "--host", "127.0.0.1", "--port", str(port), *config.flags,
            *(("--policy", policy) if policy else ()), *extra]


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float, log: Path) -> dict:
    """/health's body once the server answers; a RuntimeError when it exits or the time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}) before it answered: "
                               + " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:]))
        try:
            r = httpx.get(f"{url}/health", timeout=2)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not answer /health within {timeout_s:g} s")


def _process_tree_sum(pid: int, measure) -> float | None:
    """`measure(process)` summed over a process and its children (None without psutil or the process)."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0.0
    for p in procs:
        try:
            total += measure(p)
        except psutil.Error:  # a child that ended meanwhile
            pass
    return total


def resident_mib(pid: int) -> float | None:
    """Resident memory of a process and its children, MiB (None without psutil or the process)."""
    total = _process_tree_sum(pid, lambda p: p.memory_info().rss)
    return None if total is None else total / 2**20


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) a process and its children have used so far (None without psutil)."""
    def used(p) -> float:
        times = p.cpu_times()
        return times.user + times.system

    return _process_tree_sum(pid, used)


def read_metrics(url: str) -> dict[str, float]:
    """The few /metrics figures the report keeps (`METRICS`), by name."""
    import httpx

    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in METRICS:
            try:
                found[name] = float(value)
            except ValueError:
                pass
    return found


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def level_row(report: dict, one_stream: float | None) -> dict:
    """A load_serve level report as the benchmark's row (ms, counts, the ratio to 1 stream); `where_time_went`
    adds the server's CPU figures."""
    ms = lambda s: None if s is None else round(s * 1000, 1)  # noqa: E731
    throughput = report["throughput_audio_s_per_s"]
    return {"clients": report["clients"], "completed": report["completed"],
            "ttfa_p50_ms": ms(report["ttfa_p50_s"]), "ttfa_p99_ms": ms(report["ttfa_p99_s"]),
            "rtf_p50": report["rtf_p50"], "underruns": report["underruns"],
            "streams_behind": report["streams_with_underruns"], "audio_s_per_s": round(throughput, 3),
            "x_one_stream": round(throughput / one_stream, 2) if one_stream else None,
            "refused_429": report["refused_429"], "errors": report["failed"] - report["refused_429"],
            "elapsed_s": round(report["elapsed_s"], 2)}


def where_time_went(cpu_s: float | None, elapsed_s: float, codec_s: float | None) -> dict:
    """The server's CPU seconds over a level, the cores they kept busy over its `elapsed_s` and the codec's
    share of them (`codec_s`: the growth of its codec seconds; None: not counted); None where unknown."""
    if cpu_s is None:
        return {"cpu_s": None, "cores_busy": None, "codec_share": None}
    return {"cpu_s": round(cpu_s, 2), "cores_busy": round(cpu_s / elapsed_s, 2) if elapsed_s > 0 else None,
            "codec_share": round(codec_s / cpu_s, 3) if codec_s is not None and cpu_s > 0 else None}


def run_configuration(config: Configuration, args, deadline: float, workdir: Path) -> dict:
    """Start the server, run the levels while time is left, read its memory and metrics, stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = server_command(config, port, args.policy, args.server_arg)
    log = workdir / f"{config.name}.log"
    print(f"[{config.name}] starting: {' '.join(command[1:])}", file=sys.stderr)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    result = {"name": config.name, "about": config.about, "server_flags": list(command[len(SERVER):]), "levels": []}
    try:
        started = time.monotonic()
        health = wait_healthy(url, process, min(args.startup_seconds, max(deadline - time.monotonic(), 1)), log)
        result["startup_s"] = round(time.monotonic() - started, 1)
        result["streams"] = health.get("streams")
        print(f"[{config.name}] ready in {result['startup_s']} s ({health.get('workers')} workers, "
              f"{health.get('streams')} streams)", file=sys.stderr)
        result["rss_mib_loaded"] = resident_mib(process.pid)
        one_stream = None
        for clients in args.levels:
            left = deadline - time.monotonic()
            if left < 5:
                print(f"[{config.name}] --max-minutes reached: levels from {clients} left out", file=sys.stderr)
                result["cut_short"] = True
                break
            print(f"[{config.name}] {clients} clients x {args.requests} requests", file=sys.stderr)
            ns = argparse.Namespace(url=url, requests=args.requests, api_key=None, sample_rate=24000,
                                    max_seconds=min(left, args.level_seconds))
            cpu_before, codec_before = cpu_seconds(process.pid), read_metrics(url).get(CODEC_SECONDS)
            started_level = time.perf_counter()
            report = asyncio.run(load_serve.main_async(ns, clients))
            elapsed = time.perf_counter() - started_level
            cpu_after, codec_after = cpu_seconds(process.pid), read_metrics(url).get(CODEC_SECONDS)
            if clients == 1:
                one_stream = report["throughput_audio_s_per_s"] or None
            cpu_s = cpu_after - cpu_before if cpu_before is not None and cpu_after is not None else None
            codec_s = codec_after - codec_before if codec_before is not None and codec_after is not None else None
            result["levels"].append({**level_row(report, one_stream), **where_time_went(cpu_s, elapsed, codec_s)})
        result["rss_mib"] = resident_mib(process.pid)
        result["metrics"] = read_metrics(url)
    except RuntimeError as err:
        result["error"] = str(err)
        print(f"[{config.name}] {err}", file=sys.stderr)
    finally:
        stop(process)
    return result


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


COLUMNS = (("clients", "clients", "{}"), ("ttfa_p50_ms", "TTFA p50 ms", "{:.0f}"),
           ("ttfa_p99_ms", "TTFA p99 ms", "{:.0f}"), ("underruns", "underruns", "{}"),
           ("streams_behind", "behind", "{}"), ("audio_s_per_s", "audio s/s", "{:.2f}"),
           ("x_one_stream", "x 1 stream", "{:.2f}"), ("refused_429", "429s", "{}"), ("errors", "errors", "{}"),
           ("cores_busy", "cores busy", "{:.2f}"), ("codec_share", "codec share", "{:.2f}"))


def table_lines(doc: dict) -> list[str]:
    """The report as a readable table per configuration."""
    lines = []
    for config in doc["configurations"]:
        rss = config.get("rss_mib")
        lines += ["", f"{config['name']}: {config['about']}" + (f"; server RSS {rss:.0f} MiB" if rss else "")]
        if config.get("error"):
            lines.append(f"  failed: {config['error']}")
            continue
        lines.append("  " + " ".join(f"{header:>12}" for _, header, _ in COLUMNS))
        for row in config["levels"]:
            cells = [("-" if row.get(key) is None else fmt.format(row[key])) for key, _, fmt in COLUMNS]
            lines.append("  " + " ".join(f"{cell:>12}" for cell in cells))
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--levels", type=load_serve.concurrency_levels, default=[1, 2, 4, 8, 16],
                        help="concurrent clients, one level after another (default 1,2,4,8,16)")
    parser.add_argument("--requests", type=int, default=2, help="requests per client at each level (default 2)")
    parser.add_argument("--configs", type=config_names, default=list(CONFIGS),
                        help=f"which servers, in order; the first is the one the others are compared with "
                             f"(default {','.join(CONFIGS)})")
    parser.add_argument("--max-batch", type=int, default=16, help="the batched server's --max-batch (default 16)")
    parser.add_argument("--workers", type=int, default=2, help="the per-worker server's --workers (default 2)")
    parser.add_argument("--policy", choices=POLICIES,
                        help="every server's --policy (default: none given, each server's own default policy)")
    parser.add_argument("--max-minutes", type=float, default=30,
                        help="the whole run stops after this long, levels not reached left out (default 30)")
    parser.add_argument("--level-seconds", type=float, default=300, help="one level stops after this long")
    parser.add_argument("--startup-seconds", type=float, default=300, help="how long a server may take to load")
    parser.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                        help="a further `pcgtts serve` flag for every server (repeat; e.g. --server-arg=--threads=2)")
    parser.add_argument("--json", type=Path, help=f"write the report here ({RESULT} for the results pages)")
    args = parser.parse_args(argv)
    if not 1 <= args.requests <= 100:
        parser.error("--requests must lie in [1, 100]")
    if not (0 < args.max_minutes <= 600 and 0 < args.level_seconds <= 3600 and 0 < args.startup_seconds <= 3600):
        parser.error("--max-minutes must lie in (0, 600], --level-seconds and --startup-seconds in (0, 3600]")
    if not (1 <= args.workers <= 64 and 2 <= args.max_batch <= 256):
        parser.error("--workers must lie in [1, 64], --max-batch in [2, 256]")
    if args.json is not None and (args.json.is_dir() or any(p.exists() and not p.is_dir() for p in args.json.parents)):
        parser.error(f"--json {args.json}: not a file that can be written (a folder, or under a file)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.max_minutes * 60
    known = configurations(args.max_batch, args.workers)
    doc = {"benchmark": "many_streams", "machine": machine(), "date": datetime.date.today().isoformat(),
           "commit": commit(),
           "command": " ".join(["python benchmarks/bench_many_streams.py",
                                *(argv if argv is not None else sys.argv[1:])]),
           "requests_per_client": args.requests, "policy": args.policy, "configurations": []}
    with tempfile.TemporaryDirectory(prefix="pcgtts-many-streams-") as workdir:
        for name in args.configs:
            doc["configurations"].append(run_configuration(known[name], args, deadline, Path(workdir)))
    print("\n".join(table_lines(doc)))
    print(json.dumps(doc))
    if args.json:
        load_serve.write_json(args.json, doc)
        print(f"wrote {args.json}", file=sys.stderr)
    ok = all(not c.get("error") and c["levels"] and all(r["completed"] for r in c["levels"])
             for c in doc["configurations"])
    return 0 if ok else 1


if __name__ == "__main__":
    # Stopped with SIGTERM (kill, a timeout): unwind, so that the servers started here are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    sys.exit(main())
