"""Step time of exported LM folders side by side: 1- and 4-token forwards (a plain step and an L = 3
verify) after the same prefill, the folders interleaved round by round on one thread, so two exports of
the same weights (another graph form, another onnxruntime setting) compare on this noisy machine.

    python benchmarks/bench_graph_step.py EXPORT_DIR [EXPORT_DIR ...] [--rounds 30] [--context 180] [--taps]

--taps: each folder whose step graph returns an EAGLE draft's taps beside a plain one is timed twice,
through the plain graph and through the tapped one (`OrtLM.use_taps`).

Prints each folder's median step time per token count and, against the first folder, the median of the
per-round ratios (paired) with its quartiles.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pcgtts.runtime.lm.onnxruntime import OrtLM

TOKEN_COUNTS = (1, 4)
REPEATS = 20  # forwards per folder, token count and round (their median is the round's figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--context", type=int, default=180, help="prompt tokens prefilled first")
    parser.add_argument("--taps", action="store_true", help="also time each folder's tapped step graph")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    lms, names = [], []
    for folder in args.folders:
        lms.append(OrtLM.load(folder, max_length=1024, threads=1))
        names.append(folder)
        if args.taps and lms[-1].meta.extra.get("plain_graph"):
            tapped = OrtLM.load(folder, max_length=1024, threads=1)
            tapped.use_taps()
            lms.append(tapped)
            names.append(f"{folder} (tapped)")
    prompt = torch.randint(300, 60000, (args.context,), generator=gen)
    for lm in lms:
        lm.prefill(prompt)
    times = {(i, t): [] for i in range(len(lms)) for t in TOKEN_COUNTS}
    for _ in range(args.rounds):
        for i, lm in enumerate(lms):
            start = lm.length
            for t in TOKEN_COUNTS:
                ids = torch.randint(300, 60000, (t,), generator=gen)
                samples = []
                step = lm.forward_scores if lm.head_digits else lm.forward
                for _ in range(REPEATS):
                    started = time.perf_counter()
                    step(ids)
                    samples.append(time.perf_counter() - started)
                    lm.rollback(start)
                times[i, t].append(statistics.median(samples))
    for t in TOKEN_COUNTS:
        first = np.array(times[0, t])
        for i, folder in enumerate(names):
            ratio = np.array(times[i, t]) / first
            print(f"T={t}  {statistics.median(times[i, t]) * 1e3:7.3f} ms  x first {np.median(ratio):.3f} "
                  f"(quartiles {np.quantile(ratio, 0.25):.3f}-{np.quantile(ratio, 0.75):.3f})  {folder}")


if __name__ == "__main__":
    main()
