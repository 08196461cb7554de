"""Load test of a running `pcgtts serve`: N concurrent clients x M requests each, bounded in count
and time (stops by itself). Reports p50/p99 time to first audio (client side: request sent ->
first audio byte), real-time factor (request wall time / audio duration) and errors, as a table
and one JSON line.

    pcgtts serve --port 8000 &
    python benchmarks/load_serve.py --url http://127.0.0.1:8000 --clients 2 --requests 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import numpy as np

TEXTS = ("Hello there, this is a short test.", "The quick brown fox jumps over the lazy dog.",
         "Streaming speech should start quickly.", "One more sentence for the load test.")


async def one_request(client, url: str, text: str, key: str | None, sample_rate: int) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    sent = time.perf_counter()
    first, size = None, 0
    try:
        async with client.stream("POST", f"{url}/v1/audio/speech", headers=headers,
                                 json={"input": text, "response_format": "pcm"}) as r:
            if r.status_code != 200:
                body = await r.aread()
                return {"ok": False, "status": r.status_code, "error": body[:200].decode(errors="replace")}
            rate = int(r.headers.get("x-sample-rate", sample_rate))
            async for piece in r.aiter_raw():
                if piece and first is None:
                    first = time.perf_counter() - sent
                size += len(piece)
    except Exception as err:  # counted, reported, never fatal to the run
        return {"ok": False, "status": None, "error": f"{type(err).__name__}: {err}"}
    wall = time.perf_counter() - sent
    audio = size / 2 / rate
    return {"ok": True, "status": 200, "ttfa": first, "wall": wall, "audio": audio,
            "rtf": wall / audio if audio else None}


async def client_loop(client, args, index: int, results: list, stop_at: float) -> None:
    for i in range(args.requests):
        if time.monotonic() > stop_at:
            return
        results.append(await one_request(client, args.url, TEXTS[(index + i) % len(TEXTS)], args.api_key,
                                         args.sample_rate))
        print(f"  client {index} request {i + 1}/{args.requests}: {results[-1].get('status')}", file=sys.stderr)


def pct(values, q):
    return float(np.percentile(values, q)) if values else None


async def main_async(args) -> dict:
    import httpx

    stop_at = time.monotonic() + args.max_seconds
    results: list[dict] = []
    timeout = httpx.Timeout(args.max_seconds, connect=10)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=args.clients)) as client:
        started = time.perf_counter()
        tasks = [asyncio.create_task(client_loop(client, args, c, results, stop_at)) for c in range(args.clients)]
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
    return {"url": args.url, "clients": args.clients, "requests_per_client": args.requests,
            "completed": len(ok), "failed": len(results) - len(ok), "errors": errors,
            "elapsed_s": elapsed, "ttfa_p50_s": pct(ttfa, 50), "ttfa_p99_s": pct(ttfa, 99),
            "rtf_p50": pct(rtf, 50), "rtf_p99": pct(rtf, 99),
            "audio_s": sum(r["audio"] for r in ok), "throughput_audio_s_per_s": sum(r["audio"] for r in ok) / elapsed}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--clients", type=int, default=2, help="concurrent clients (1-64)")
    parser.add_argument("--requests", type=int, default=3, help="requests per client (1-100)")
    parser.add_argument("--max-seconds", type=float, default=300, help="the whole run stops after this long")
    parser.add_argument("--api-key")
    parser.add_argument("--sample-rate", type=int, default=24000, help="if the server does not say")
    args = parser.parse_args(argv)
    if not (1 <= args.clients <= 64 and 1 <= args.requests <= 100 and 0 < args.max_seconds <= 3600):
        parser.error("--clients must lie in [1, 64], --requests in [1, 100], --max-seconds in (0, 3600]")
    if not args.url.startswith(("http://127.0.0.1", "http://localhost", "http://[::1]")):
        print("warning: load-testing a non-loopback server", file=sys.stderr)
    report = asyncio.run(main_async(args))
    from pcgtts.cli.commands import print_report

    print_report(report, title=f"pcgtts serve load: {args.clients} clients x {args.requests} requests")
    return 0 if report["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
