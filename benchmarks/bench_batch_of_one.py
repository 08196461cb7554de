"""A batch of one against today's loop: one stream through the batch's decode beside the one-stream loop.

One process loads the built-in voice (or the models named) on the torch backend twice: with
`max_batch` 1, today's loop (one stream at a time on the Synthesizer's own lane), and with
`max_batch` 8, the batch (`runtime/decode/batch.py`), through which a single stream then runs alone.
For each policy of `--policies` (default: ar, the voice's own default policy as configured, pcg with
its adaptive draft length, and eagle-pcg), after one untimed stream on each, `--rounds` rounds speak
the same four sentences as one stream on each Synthesizer, seeded per round (both alike), which one
goes first alternating (A B, B A, A B, ...). Per stream: speech tokens per second (emitted speech
tokens / the wall time of the whole stream, from `stream()` to its last chunk) and the time to first
audio. Per policy: the median tokens/s of each, the paired ratio batch / today (the median of the
rounds' ratios, and their range) and the TTFA medians. A table on stdout, then one JSON line;
`--json PATH` writes it (benchmarks/results/batch_of_one.json is what BENCHMARKS.md's "Many streams
at once" shows it from).

    python benchmarks/bench_batch_of_one.py --json benchmarks/results/batch_of_one.json
    python benchmarks/bench_batch_of_one.py --policies ar --rounds 2      # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_many_streams import commit, machine  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)

from pcgtts.cli import flags  # noqa: E402
from pcgtts.cli.commands import add_model_args  # noqa: E402
from pcgtts.runtime.config import MAX_BATCH, POLICIES  # noqa: E402

RESULT = Path("benchmarks/results/batch_of_one.json")
SENTENCES = ("The birch canoe slid on the smooth planks.", "Glue the sheet to the dark blue background.",
             "It is easy to tell the depth of a well.", "These days a chicken leg is a rare dish.")
TEXT = " ".join(SENTENCES)  # one stream: the four sentences, one after another
OTHER_POLICIES = ("ar", "eagle-pcg")  # beside the voice's own default policy, by default


def policy_names(text: str) -> list[str]:
    """"ar,pcg" -> ["ar", "pcg"]: names of `POLICIES`, no repeats."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"distinct policies out of {', '.join(POLICIES)}, got {text!r}")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    add_model_args(parser, policy=False)
    parser.add_argument("--policies", type=policy_names,
                        help="comma list (default: ar, the voice's own default policy, eagle-pcg)")
    parser.add_argument("--rounds", type=int, default=6, help="measured rounds per policy, 1 to 100 (default 6)")
    parser.add_argument("--max-batch", type=int, default=8,
                        help=f"the batch's slots, 2 to {MAX_BATCH} (default 8); one stream runs in it")
    parser.add_argument("--seed", type=flags.seed, default=0, help="round r is seeded seed + r (default 0)")
    parser.add_argument("--max-tokens", type=flags.max_tokens, help="speech tokens per sentence at most")
    parser.add_argument("--json", type=Path, help=f"write the report here ({RESULT} for the results pages)")
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= 100:
        parser.error("--rounds must lie in [1, 100]")
    if not 2 <= args.max_batch <= MAX_BATCH:
        parser.error(f"--max-batch must lie in [2, {MAX_BATCH}]")
    if args.backend not in (None, "torch"):
        parser.error(f"--backend {args.backend}: this benchmark runs the torch backend (a batch decodes on it)")
    try:
        args.policies = resolve(args)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    return args


def resolve(args: argparse.Namespace) -> list[str]:
    """The policies of the flags (default: ar, the voice's own, eagle-pcg), each checked against the models
    it needs, and --json: before anything loads."""
    from dataclasses import replace

    from pcgtts.cli.commands import resolve_cli_settings
    from pcgtts.runtime.files import check_output_file
    from pcgtts.runtime.lm.loader import resolve_backend
    from pcgtts.runtime.loading import check_models

    if args.json is not None:
        check_output_file(args.json, "--json")
    settings = resolve_cli_settings(args, backend="torch", max_batch=args.max_batch)
    policies = args.policies or list(dict.fromkeys([OTHER_POLICIES[0], settings.synthesis.decode.policy,
                                                    *OTHER_POLICIES[1:]]))
    device = resolve_backend(settings.device, settings.models.target)
    for policy in policies:
        check_models(settings.models, replace(settings.synthesis.decode, policy=policy), device)
    return policies


def load(args: argparse.Namespace, max_batch: int, policy: str):
    from pcgtts.cli.commands import load_synthesizer

    synth, _ = load_synthesizer(args, backend="torch", max_batch=max_batch, policy=policy)
    return synth


def one_stream(synth, policy: str, seed: int, max_tokens: int | None) -> dict:
    """The four sentences as one stream, read to its end: tokens, wall time, tokens/s, TTFA."""
    started = time.perf_counter()
    stream = synth.stream(TEXT, policy=policy, seed=seed, max_new_tokens=max_tokens)
    with stream:
        for _ in stream:
            pass
    wall = time.perf_counter() - started
    tokens = stream.stats.totals().emitted
    ttfa = stream.stats.time_to_first_audio
    return {"tokens": tokens, "wall_s": round(wall, 4), "tok_s": round(tokens / wall, 2) if wall > 0 else None,
            "ttfa_ms": None if ttfa is None else round(ttfa * 1000, 1)}


def route(synth, policy: str) -> dict:
    """How `synth` (the batch's) runs `policy`: in the batch or on its lane, at an adaptive draft length or not."""
    from pcgtts.runtime.checks import call_config
    from pcgtts.runtime.decode.batch import check_batchable
    from pcgtts.runtime.decode.cost_model import plans_draft_length

    decode = call_config(synth.config, {"policy": policy}).decode
    try:
        check_batchable(decode, draft=synth.batch.draft is not None)
        in_batch = True
    except ValueError:
        in_batch = False
    return {"adaptive": plans_draft_length(decode), "in_batch": in_batch}


def _median(values: list, digits: int = 2) -> float | None:
    kept = [v for v in values if v is not None]
    return round(statistics.median(kept), digits) if kept else None


def summarize(policy: str, how: dict, rounds: list[dict]) -> dict:
    """A policy's rounds as its medians and the paired ratio batch / today."""
    ratios = [r["ratio"] for r in rounds if r["ratio"] is not None]
    return {"policy": policy, **how,
            "today_tok_s": _median([r["today"]["tok_s"] for r in rounds]),
            "batch_tok_s": _median([r["batch"]["tok_s"] for r in rounds]),
            "ratio": _median(ratios, 4), "ratio_min": min(ratios) if ratios else None,
            "ratio_max": max(ratios) if ratios else None,
            "today_ttfa_ms": _median([r["today"]["ttfa_ms"] for r in rounds]),
            "batch_ttfa_ms": _median([r["batch"]["ttfa_ms"] for r in rounds]), "rounds": rounds}


def measure_policy(today, batch, policy: str, args: argparse.Namespace) -> dict:
    """One untimed stream on each, then the rounds, alternating which goes first."""
    lanes = {"today": today, "batch": batch}
    for synth in lanes.values():
        one_stream(synth, policy, args.seed, args.max_tokens)
    rounds = []
    for r in range(args.rounds):
        seed = args.seed + r
        order = ("today", "batch") if r % 2 == 0 else ("batch", "today")
        figures = {name: one_stream(lanes[name], policy, seed, args.max_tokens) for name in order}
        today_s, batch_s = figures["today"]["tok_s"], figures["batch"]["tok_s"]
        rounds.append({"seed": seed, "first": order[0], "today": figures["today"], "batch": figures["batch"],
                       "ratio": round(batch_s / today_s, 4) if today_s and batch_s is not None else None})
        print(f"[{policy}] round {r + 1}/{args.rounds}: today {today_s} tok/s, batch {batch_s} tok/s",
              file=sys.stderr)
    return summarize(policy, route(batch, policy), rounds)


def label(row: dict) -> str:
    """A policy as the table names it: "pcg (adaptive)", with "not batched" when it ran on the lane."""
    notes = [n for n, on in (("adaptive", row.get("adaptive")), ("not batched", row.get("in_batch") is False)) if on]
    return row["policy"] + (f" ({', '.join(notes)})" if notes else "")


def table_lines(doc: dict) -> list[str]:
    """The report as a readable table, a policy a row."""
    def cell(value, fmt="{:.2f}") -> str:
        return "-" if value is None else fmt.format(value)

    lines = [f"one stream through a batch of {doc['max_batch']} against today's loop, {doc['rounds']} rounds, "
             "medians", f"{'policy':>26} {'today tok/s':>12} {'batch tok/s':>12} {'batch/today':>12} "
             f"{'range':>12} {'TTFA today':>11} {'TTFA batch':>11}"]
    for row in doc["policies"]:
        spread = f"{cell(row['ratio_min'])}-{cell(row['ratio_max'])}"
        lines.append(f"{label(row):>26} {cell(row['today_tok_s'], '{:.1f}'):>12} {cell(row['batch_tok_s'], '{:.1f}'):>12} "
                     f"{cell(row['ratio']):>12} {spread:>12} {cell(row['today_ttfa_ms'], '{:.0f}'):>11} "
                     f"{cell(row['batch_ttfa_ms'], '{:.0f}'):>11}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"loading the models twice (max_batch 1 and {args.max_batch}), torch backend", file=sys.stderr)
    today = load(args, 1, args.policies[0])
    batch = load(args, args.max_batch, args.policies[0])
    doc = {"benchmark": "batch_of_one", "machine": machine(), "date": datetime.date.today().isoformat(),
           "commit": commit(),
           "command": " ".join(["python benchmarks/bench_batch_of_one.py",
                                *(argv if argv is not None else sys.argv[1:])]),
           "backend": "torch", "max_batch": args.max_batch, "rounds": args.rounds, "seed": args.seed,
           "sentences": list(SENTENCES), "policies": [measure_policy(today, batch, p, args) for p in args.policies]}
    print("\n".join(table_lines(doc)))
    print(json.dumps(doc))
    if args.json:
        from pcgtts.runtime.files import atomic_output

        with atomic_output(args.json) as tmp:
            tmp.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
