"""How the adaptive draft length fares from different starting acceptances: a simulation in model time.

Takes a `pcgtts bench --adaptive --json` report and one policy in it: the costs its adaptive case
planned with, and the per-position acceptance its fixed-length case measured (exact for a fixed L).
Runs `DraftLengthPolicy` over utterances whose steps accept i.i.d. at those rates, starting each
utterance's counter from a given prior (0.5, the draft's recorded rate, or the true rates: what
`measure_acceptance` gives at load) at a given weight, and reports the speed-up over AR that the
cost model charges (`counted_seconds`), next to fixed L = 1 .. L_max. No models, no timing noise:
what the policy does with the evidence, and nothing else.

    python benchmarks/simulate_length_policy.py REPORT.json --policy eagle-pcg --weights 2,6,10
"""

from __future__ import annotations

import argparse
import json
import random

from pcgtts.runtime.decode.cost_model import (AcceptanceCounter, DraftLengthPolicy, StepCosts, counted_seconds,
                                              predict)


def simulate(costs: StepCosts, rates: list[float], prior: tuple[float, ...], weight: float, utterances: int,
             tokens: int) -> tuple[float, list[int]]:
    """Model-time speed-up over AR and the steps run at each L, over `utterances` of `tokens` tokens."""
    max_length = len(rates)
    counts, emitted = [0] * (max_length + 1), 0
    for utterance in range(utterances):
        policy = DraftLengthPolicy(costs, max_length, learn=False,
                                   counter=AcceptanceCounter(max_length, prior=prior, prior_weight=weight))
        rng, done = random.Random(utterance), 0
        while done < tokens:
            length = policy.choose()
            accepted = 0
            while accepted < length and rng.random() < rates[accepted]:
                accepted += 1
            policy.record(length, accepted)
            counts[length] += 1
            done += accepted + 1
        emitted += done
    return emitted * costs.ar_step / counted_seconds(costs, counts, 0), counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a `pcgtts bench --adaptive --json` report")
    parser.add_argument("--policy", required=True, help="a policy with a fixed and an auto case in the report")
    parser.add_argument("--weights", default="2,6,10", help="prior weights (in steps) to try")
    parser.add_argument("--utterances", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=140, help="tokens per utterance")
    args = parser.parse_args()

    summaries = json.load(open(args.report))["summaries"]
    auto = next(s for s in summaries if s["policy"] == args.policy and s.get("planned_costs"))
    fixed = next(s for s in summaries if s["policy"] == args.policy and not s.get("planned_costs"))
    costs, rates = StepCosts(**auto["planned_costs"]), fixed["conditional_acceptance"]
    per_length = predict(costs, rates, len(rates))
    print(f"{args.policy}: true rates {' / '.join(f'{r:.3f}' for r in rates)}; fixed L = 1..{len(rates)}: "
          + ", ".join(f"{v / per_length[0]:.3f}x" for v in per_length[1:]))
    priors = {"0.5": (0.5,), "true rates": tuple(rates)}
    rows = []
    for name, prior in priors.items():
        for weight in (float(w) for w in args.weights.split(",")):
            speedup, counts = simulate(costs, rates, prior, weight, args.utterances, args.tokens)
            rows.append({"prior": name, "weight": weight, "speedup": speedup, "steps_by_length": counts})
            print(f"  start {name:>10}, weight {weight:>4g}: {speedup:.3f}x AR, steps by L {counts}")
    print(json.dumps({"policy": args.policy, "rates": rates, "rows": rows}))


if __name__ == "__main__":
    main()
