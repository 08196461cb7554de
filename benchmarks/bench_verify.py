"""Cost of one verify step per acceptance rule (L = 3, V = 65,537), side by side in one run.

Distributions are realistic: peaked target rows, a draft that is the target plus noise (so
proposals are partly rejected), and a group table built from structured FSQ-lattice
embeddings (mean group ~40-140). Also reports a reject-heavy case, where PCG's residual
sampler does the most work, and an all-accepted case (uniforms 0), where no residual is
needed. Median and minimum per call: on a shared CPU the minimum is the steadier figure. On a
CPU each rule runs twice: the tensor rules at batch 1 and the one-sequence lane the decode loops
call there (the host lane, `acceptance.verify_one`).

    python benchmarks/bench_verify.py [--device cuda] [--theta 0.30 | --groups TABLE.pcg]

`--groups` uses a real group table (e.g. the trained voice's) instead of the structured one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from pcgtts.groups.build import build_groups
from pcgtts.groups.table import GroupTable
from pcgtts.runtime.decode.acceptance import draw_uniforms, verify
from pcgtts.runtime.decode.acceptance import verify_one
from pcgtts.tools.demo import structured_speech_embeddings

L, V = 3, 65537


def timed(fn, device, repeats: int) -> tuple[float, float]:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6, min(times) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--theta", type=float, default=0.30)
    ap.add_argument("--groups", help="a .pcg table over 65,536 codes (instead of building one at --theta)")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    if args.groups:
        groups = GroupTable.load(args.groups)
    else:
        emb = structured_speech_embeddings(65536, 256, 1.0, 1.0, gen)
        groups = build_groups(emb, args.theta, device=args.device, progress=False)
    table = groups.to_device(device)

    logits = 6 * torch.randn(1, L + 1, V, generator=gen)
    target = torch.softmax(logits, -1).to(device)
    cases = {
        "typical": torch.softmax(logits[:, :L] + 1.0 * torch.randn(1, L, V, generator=gen), -1).to(device),
        "reject-heavy": torch.softmax(6 * torch.randn(1, L, V, generator=gen), -1).to(device),
    }
    rng = torch.Generator(device=device).manual_seed(1)
    rows = []
    runs = [(case, draft, False) for case, draft in cases.items()] + [("all-accepted", cases["typical"], True)]
    paths = ("tensor", "lane") if device.type == "cpu" else ("tensor",)  # lane: the host backend
    for case, draft, accept_all in runs:
        tokens = torch.multinomial(draft[0], 1, generator=rng).view(1, L)
        for path in paths:
            for rule in ("sd", "ssd", "pcg"):
                def step():
                    u = torch.zeros(1, L, device=device) if accept_all else draw_uniforms(1, L, rng, device)
                    if path == "lane":
                        verify_one(rule, tokens[0], draft[0], target[0], u[0], rng, groups=table, ssd_beta=0.4)
                    else:
                        verify(rule, tokens, draft, target, u, rng, groups=table, ssd_beta=0.4)
                median, best = timed(step, device, args.repeats)
                rows.append({"case": case, "path": path, "rule": rule, "us": median, "min_us": best})
    sd = {(r["case"], r["path"]): r["us"] for r in rows if r["rule"] == "sd"}
    sd_min = {(r["case"], r["path"]): r["min_us"] for r in rows if r["rule"] == "sd"}
    print(f"one verify step, L={L}, V={V}, device={args.device}, {groups.num_groups} groups "
          f"(mean {groups.stats['mean_group_size']:.1f}, max {groups.stats['max_group_size']})")
    print(f"{'case':13s} {'path':6s} {'rule':5s} {'median us':>10s} {'x sd':>6s} {'min us':>8s} {'x sd':>6s}")
    for r in rows:
        r["x_sd"] = r["us"] / sd[r["case"], r["path"]]
        r["x_sd_min"] = r["min_us"] / sd_min[r["case"], r["path"]]
        print(f"{r['case']:13s} {r['path']:6s} {r['rule']:5s} {r['us']:10.0f} {r['x_sd']:6.2f} {r['min_us']:8.0f} "
              f"{r['x_sd_min']:6.2f}")
    print(json.dumps({"device": args.device, "theta": args.theta, "groups": groups.stats, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
