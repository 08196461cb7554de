"""The first `pcgtts speak` after install, and the ones after it: wall time from the command's start to its
first audio, and in all, from an empty cache (`PCGTTS_CACHE` a new folder each run).

    python benchmarks/bench_first_speak.py --runs 3 --json first_speak.json

Each run: `speak` on the empty cache (the built-in voice expanded, its shipped group table copied, its
onnxruntime graphs exported in the background while this one runs on torch); `speak` again at once (the
export still at work, on torch); then, once the export is done, `speak` again (its int8 graphs). The
command runs in a fresh interpreter, its output written to a file (`--out`); its first audio is when the
stream hands over its first chunk. Prints the median and the range of each figure over the runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the CLI in a fresh interpreter, saying when its stream handed over the first chunk
SPEAK = """import sys, time
from pcgtts.runtime import stream_worker
step = stream_worker.SynthesisStream.__next__
def first(self, seen=[]):
    chunk = step(self)
    if not seen:
        seen.append(time.time())
        print(f"FIRST_AUDIO_AT {seen[0]!r}", file=sys.stderr, flush=True)
    return chunk
stream_worker.SynthesisStream.__next__ = first
from pcgtts.cli import main
raise SystemExit(main(sys.argv[1:]))
"""
TEXT = "Hello world"


def speak(cache: Path, out: Path) -> dict:
    """One `pcgtts speak` with the cache `cache`: seconds to first audio and in all, and its route."""
    start = time.time()
    run = subprocess.run([sys.executable, "-c", SPEAK, "speak", TEXT, "--out", str(out)], capture_output=True,
                         text=True, env={**os.environ, "PCGTTS_CACHE": str(cache)}, timeout=900)
    total = time.time() - start
    if run.returncode != 0:
        raise RuntimeError(f"speak failed: {run.stderr[-2000:]}")
    first = next(float(line.split()[1]) for line in run.stderr.splitlines() if line.startswith("FIRST_AUDIO_AT"))
    route = "torch" if "runs on torch" in run.stderr else "onnxruntime int8"
    return {"first_audio_s": round(first - start, 2), "total_s": round(total, 2), "route": route}


def wait_for_export(cache: Path, timeout: float = 900) -> float:
    """Seconds until the built-in voice's onnxruntime graphs are made in `cache` (the background export)."""
    from pcgtts.runtime.prepared import ONNX_STAGE, is_prepared

    start = time.time()
    while time.time() - start < timeout:
        folders = [p for p in cache.glob("voice-*") if p.is_dir()]
        if folders and is_prepared(folders[0], (ONNX_STAGE,)):
            return time.time() - start
        time.sleep(1)
    raise RuntimeError(f"no export in {cache} after {timeout:.0f} s")


def one_run(root: Path) -> dict:
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=root))
    first = speak(cache, root / "first.wav")
    again = speak(cache, root / "again.wav")
    export_s = wait_for_export(cache)
    later = speak(cache, root / "later.wav")
    return {"first": first, "second": again, "export_left_s": round(export_s, 1), "later": later}


def summary(runs: list[dict]) -> dict:
    """{figure: {"median", "min", "max"}} over the runs."""
    figures = {f"{run}_{figure}": [r[run][figure] for r in runs]
               for run in ("first", "second", "later") for figure in ("first_audio_s", "total_s")}
    return {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in figures.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="write the runs and their summary here")
    parser.add_argument("--machine", default="cpu", help="the machine's key in benchmarks/results/speed.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="first-speak-") as root:
        runs = []
        for i in range(args.runs):
            runs.append(one_run(Path(root)))
            print(f"run {i + 1}: {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    report = {"command": f"python benchmarks/bench_first_speak.py --runs {args.runs} --json benchmarks/results/first_speak.json",
              "machine": args.machine, "date": datetime.date.today().isoformat(), "commit": commit or "unknown",
              "about": f"Each run: `pcgtts speak \"{TEXT}\" --out OUT.wav` on an empty cache, again at once, and "
                       "again once the background export is done.",
              "host": f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}",
              "runs": runs, "summary": summary(runs)}
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
