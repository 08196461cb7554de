"""What the adaptive draft length's planning costs on the host: a `DraftLengthPolicy`'s start (once per
utterance, so on the time to first audio) and its choose + record (every decode step), with the step
costs a `pcgtts bench --adaptive --json FILE` run planned with (its adaptive rows' `planned_costs`).
Pure Python arithmetic, no models: run it with two trees (PYTHONPATH) to compare them.

    python benchmarks/bench_policy_overhead.py BENCH.json [MORE.json ...]
"""

from __future__ import annotations

import json
import sys
import time

from pcgtts.runtime.decode.cost_model import DraftLengthPolicy, StepCosts, starting_counter

STARTS, STEPS = 200, 5000


def measure(costs: StepCosts, acceptance: tuple[float, ...], max_length: int = 3) -> tuple[int | None, float, float]:
    """(the probe interval, seconds per policy start, seconds per choose + record). Each step records
    the costs the plan expects for the length it chose, so the estimates stay where they started."""
    t0 = time.perf_counter()
    for _ in range(STARTS):
        policy = DraftLengthPolicy(costs, max_length, counter=starting_counter(max_length, acceptance, None))
    start = (time.perf_counter() - t0) / STARTS
    t0 = time.perf_counter()
    for _ in range(STEPS):
        length = policy.choose()
        parts = {"time_target": costs.target(length + 1), "time_verify": costs.rule if length else costs.sample}
        if length:
            parts["time_draft"] = costs.propose(length)
        policy.record(length, 0, parts)
    return policy.probe_interval, start, (time.perf_counter() - t0) / STEPS


def main(paths: list[str]) -> None:
    for path in paths:
        for row in json.load(open(path))["summaries"]:
            planned = row.get("planned_costs")
            if not planned:
                continue
            costs = StepCosts(planned["target_forward"], planned["draft_forward"], planned["rule"], planned["sample"],
                              planned.get("proposals", ()))
            interval, start, step = measure(costs, tuple(row["starting_acceptance"] or (0.5,)))
            print(f"{row['case']:22s} probe interval {interval}  policy start {start * 1e3:.3f} ms  "
                  f"choose + record {step * 1e6:.1f} us/step")


if __name__ == "__main__":
    main(sys.argv[1:])
