"""Group-table build time, peak memory and table size at LLaSA-1B's embedding width.

Synthetic but structured embeddings stand in for the real ones: X-codec2 tokens are points
of an 8-dim, 4-level FSQ lattice, so each of the 65,536 rows is a random-Fourier-feature
embedding of its lattice coordinates (cosine similarity falls off with lattice distance)
plus per-token noise. A theta sweep first finds the theta giving a mean group of ~140 (the
paper's largest setting) from 256 sampled rows against all tokens (an unbiased estimate of the
mean |G(t)|), then the full table is built at that theta.

    python benchmarks/bench_groups.py                 # CPU, 65,536 x 2,048
    python benchmarks/bench_groups.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from pcgtts.groups.build import build_groups
from pcgtts.groups.table import GroupTable
from pcgtts.tools.demo import structured_speech_embeddings


def embeddings(n: int, width: int, noise: float, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = structured_speech_embeddings(n, width, kernel_length=1.0, scale=1.0, generator=gen)
    return rows + noise * torch.randn(n, width, generator=gen) / width**0.5


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--noise", type=float, default=0.5)
    ap.add_argument("--target-mean", type=float, default=140.0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    emb = embeddings(args.tokens, args.width, args.noise)
    # Mean |G(t)| estimated from sampled rows against every token.
    unit = torch.nn.functional.normalize(emb.to(args.device), dim=1)
    rows = torch.randperm(args.tokens, generator=torch.Generator().manual_seed(1))[:256].to(args.device)
    sims = unit[rows] @ unit.T
    sweep = [{"theta": theta, "mean_group_size_est": float((sims > theta).sum(1).float().mean())}
             for theta in [round(0.10 + 0.01 * i, 2) for i in range(36)]]
    del unit, sims
    best = min(sweep, key=lambda r: abs(r["mean_group_size_est"] - args.target_mean))["theta"]

    rss_before = peak_rss_mb()
    start = time.perf_counter()
    table = build_groups(emb, best, device=args.device, progress=True)
    seconds = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        path = table.save(Path(tmp) / "t.pcg")
        file_bytes = path.stat().st_size
        t0 = time.perf_counter()
        GroupTable.load(path)
        load_s = time.perf_counter() - t0
    result = {
        "tokens": args.tokens, "width": args.width, "device": args.device, "theta": best,
        "build_s": round(seconds, 1), "load_s": round(load_s, 2), "peak_rss_mb": round(peak_rss_mb(), 0),
        "rss_before_build_mb": round(rss_before, 0), "file_mb": round(file_bytes / 1e6, 2),
        "device_mb": round(table.stats["device_bytes"] / 1e6, 2), **table.stats, "sweep": sweep,
    }
    print(f"{'theta':>6s} {'est. mean group':>16s}")
    for r in sweep:
        print(f"{r['theta']:6.2f} {r['mean_group_size_est']:16.1f}")
    print(f"\nbuilt {table.num_groups} groups (mean {table.stats['mean_group_size']:.1f}, max "
          f"{table.stats['max_group_size']}) for {args.tokens} x {args.width} on {args.device} in {seconds:.1f} s; "
          f"peak RSS {result['peak_rss_mb']:.0f} MB; file {result['file_mb']} MB; both directions on device "
          f"{result['device_mb']} MB; load {load_s:.2f} s")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
