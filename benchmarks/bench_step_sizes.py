"""What a verify pass costs next to one step: a target forward of k tokens vs one, after a cached prefix.

Speculation with draft length L replaces L + 1 plain steps by one (L + 1)-token forward (plus the
draft and the rule), so the ratio forward(L + 1) / forward(1) is the ceiling on what it can gain:
it pays only when the tokens emitted per verify exceed that ratio by the draft's and the rule's
share. Memory-bound steps (a large model at batch 1 on a GPU) keep the ratio near 1; on a CPU the
small matmuls of a few rows cost more than one. Rounds alternate the token counts so that drift
on a shared machine falls on all of them alike.

    OMP_NUM_THREADS=1 python benchmarks/bench_step_sizes.py --model demo,wide
    OMP_NUM_THREADS=1 python benchmarks/bench_step_sizes.py --target LAB/v1/target
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pcgtts.runtime.lm.torch_lm import TorchLM


def forward_ms(lm: TorchLM, counts: list[int], cached: int, rounds: int, repeats: int) -> dict[int, float]:
    """Median milliseconds of a forward of each token count after `cached` tokens."""
    token = lm.vocab.restricted_to_token_ids(torch.tensor([5]))[0].item()
    ids = torch.full((cached + max(counts),), token)
    times: dict[int, list[float]] = {k: [] for k in counts}
    with torch.inference_mode():
        lm.prefill(ids[:cached])
        for _ in range(rounds):
            for k in counts:
                for _ in range(2):  # warm this size
                    lm.rollback(cached)
                    lm.forward(ids[:k])
                start = time.perf_counter()
                for _ in range(repeats):
                    lm.rollback(cached)
                    lm.forward(ids[:k])
                times[k].append((time.perf_counter() - start) / repeats * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="comma list of bench_lm.py shapes (demo, wide, llasa1b)")
    ap.add_argument("--target", action="append", default=[], help="a target checkpoint directory (repeatable)")
    ap.add_argument("--tokens", default="1,2,3,4,5", help="token counts to time")
    ap.add_argument("--cached", type=int, default=200, help="tokens already in the cache")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "pcgtts-bench-models"),
                    help="where the --model shapes are written once (shared with bench_lm.py)")
    args = ap.parse_args()
    counts = sorted({int(k) for k in args.tokens.split(",")} | {1})
    targets = [(t, Path(t)) for t in args.target]
    if args.model:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_lm import make_models

        targets += [(name, make_models(name, Path(args.cache))[0]) for name in args.model.split(",")]
    if not targets:
        ap.error("give --model and/or --target")
    rows = []
    for name, path in targets:
        lm = TorchLM.load(path, max_length=args.cached + max(counts) + 8)
        ms = forward_ms(lm, counts, args.cached, args.rounds, args.repeats)
        rows.append({"model": name, "hidden": lm.model.args.hidden_size, "layers": lm.model.args.num_layers,
                     "digit_head": bool(lm.model.digits), "ms": ms, "ratio": {k: ms[k] / ms[1] for k in counts}})
        del lm
    print(f"forward of k tokens after {args.cached} cached, ms (x one token); torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s)")
    for r in rows:
        cells = "  ".join(f"k={k}: {r['ms'][k]:6.2f} ({r['ratio'][k]:.2f}x)" for k in counts)
        print(f"{r['model']:>12} (hidden {r['hidden']}, {r['layers']} layers, digit head {r['digit_head']}): {cells}")
    print(json.dumps({"cached": args.cached, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
