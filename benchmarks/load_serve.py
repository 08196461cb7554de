"""Load test of a running `pcgtts serve`: N concurrent clients x M requests each, bounded in count
and time (stops by itself). Reports p50/p99 time to first audio (client side: request sent ->
first audio byte), real-time factor (request wall time / audio duration), underruns (pieces that
arrived after a real-time player started at the first audio byte had run dry), aggregate audio
seconds per second, 429s and other errors, as a table per level of concurrency, and writes them
all as JSON (`--out`, default benchmarks/results/load_serve.json).

    pcgtts serve --port 8000 --max-batch 16 &
    python benchmarks/load_serve.py --url http://127.0.0.1:8000 --concurrency 1,2,4,8,16 --requests 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

TEXTS = ("Hello there, this is a short test.", "The quick brown fox jumps over the lazy dog.",
         "Streaming speech should start quickly.", "One more sentence for the load test.")


async def one_request(client, url: str, text: str, key: str | None, sample_rate: int) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    sent = time.perf_counter()
    first, size, underruns, stalled, rate = None, 0, 0, 0.0, sample_rate
    try:
        async with client.stream("POST", f"{url}/v1/audio/speech", headers=headers,
                                 json={"input": text, "response_format": "pcm"}) as r:
            if r.status_code != 200:
                body = await r.aread()
                return {"ok": False, "status": r.status_code, "error": body[:200].decode(errors="replace")}
            rate = int(r.headers.get("x-sample-rate", sample_rate))
            async for piece in r.aiter_raw():
                now = time.perf_counter() - sent
                if piece and first is None:
                    first = now
                elif piece:  # a player started at the first byte has played `size` bytes' worth by now
                    late = now - (first + stalled + size / 2 / rate)
                    if late > 0:
                        underruns += 1
                        stalled += late
                size += len(piece)
    except Exception as err:  # counted, reported, never fatal to the run
        return {"ok": False, "status": None, "error": f"{type(err).__name__}: {err}"}
    wall = time.perf_counter() - sent
    audio = size / 2 / rate
    return {"ok": True, "status": 200, "ttfa": first, "wall": wall, "audio": audio,
            "rtf": wall / audio if audio else None, "underruns": underruns, "stalled": stalled}


async def client_loop(client, args, index: int, results: list, stop_at: float) -> None:
    for i in range(args.requests):
        if time.monotonic() > stop_at:
            return
        results.append(await one_request(client, args.url, TEXTS[(index + i) % len(TEXTS)], args.api_key,
                                         args.sample_rate))
        print(f"  client {index} request {i + 1}/{args.requests}: {results[-1].get('status')}", file=sys.stderr)


def pct(values, q):
    return float(np.percentile(values, q)) if values else None


async def main_async(args, clients: int) -> dict:
    import httpx

    stop_at = time.monotonic() + args.max_seconds
    results: list[dict] = []
    timeout = httpx.Timeout(args.max_seconds, connect=10)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=clients)) as client:
        started = time.perf_counter()
        tasks = [asyncio.create_task(client_loop(client, args, c, results, stop_at)) for c in range(clients)]
        done, pending = await asyncio.wait(tasks, timeout=args.max_seconds + 5)
        for task in pending:  # past the time bound: stop whatever is still running
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        elapsed = time.perf_counter() - started
    ok = [r for r in results if r["ok"]]
    ttfa = [r["ttfa"] for r in ok if r["ttfa"] is not None]
    rtf = [r["rtf"] for r in ok if r["rtf"] is not None]
    errors: dict[str, int] = {}
    for r in results:
        if not r["ok"]:
            key = str(r["status"] or r["error"].split(":")[0])
            errors[key] = errors.get(key, 0) + 1
    return {"url": args.url, "clients": clients, "requests_per_client": args.requests,
            "completed": len(ok), "failed": len(results) - len(ok), "errors": errors,
            "refused_429": errors.get("429", 0),
            "elapsed_s": elapsed, "ttfa_p50_s": pct(ttfa, 50), "ttfa_p99_s": pct(ttfa, 99),
            "rtf_p50": pct(rtf, 50), "rtf_p99": pct(rtf, 99),
            "underruns": sum(r["underruns"] for r in ok),
            "streams_with_underruns": sum(1 for r in ok if r["underruns"]),
            "stalled_s": sum(r["stalled"] for r in ok),
            "audio_s": sum(r["audio"] for r in ok), "throughput_audio_s_per_s": sum(r["audio"] for r in ok) / elapsed}


def concurrency_levels(text: str) -> list[int]:
    """"1,2,4,8,16" -> [1, 2, 4, 8, 16]; each in [1, 64]."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not levels or not all(1 <= n <= 64 for n in levels):
        raise argparse.ArgumentTypeError(f"each level must lie in [1, 64], got {text!r}")
    return levels


def write_json(path: Path, data: dict) -> None:
    """Write `data` to `path` through a temporary file, so a stopped run never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--clients", type=int, default=2, help="concurrent clients (1-64); one level")
    parser.add_argument("--concurrency", type=concurrency_levels,
                        help="levels of concurrent clients run one after another, e.g. 1,2,4,8,16 (replaces --clients)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "load_serve.json",
                        help="the JSON report (every level)")
    parser.add_argument("--requests", type=int, default=3, help="requests per client (1-100)")
    parser.add_argument("--max-seconds", type=float, default=300, help="the whole run stops after this long")
    parser.add_argument("--api-key")
    parser.add_argument("--sample-rate", type=int, default=24000, help="if the server does not say")
    args = parser.parse_args(argv)
    if not (1 <= args.clients <= 64 and 1 <= args.requests <= 100 and 0 < args.max_seconds <= 3600):
        parser.error("--clients must lie in [1, 64], --requests in [1, 100], --max-seconds in (0, 3600]")
    if not args.url.startswith(("http://127.0.0.1", "http://localhost", "http://[::1]")):
        print("warning: load-testing a non-loopback server", file=sys.stderr)
    from pcgtts.cli.commands import print_report

    levels = args.concurrency or [args.clients]
    reports = []
    for clients in levels:
        report = asyncio.run(main_async(args, clients))
        reports.append(report)
        print_report(report, title=f"pcgtts serve load: {clients} clients x {args.requests} requests")
        command = " ".join(["python benchmarks/load_serve.py", *(argv if argv is not None else sys.argv[1:])])
        write_json(args.out, {"command": command, "levels": reports})
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if all(report["completed"] for report in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
