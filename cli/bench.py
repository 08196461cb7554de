"""`pcgtts bench`: the latency harness (`tools/bench.py`) as a command, with sweeps and plots.

    pcgtts bench                                   # the built-in voice, every rule, built-in sentences
    pcgtts bench --policy ar,pcg --theta 0.2,0.3 --draft-length 1,3,5 --json out.json --plot out.png

Models are loaded once; each configuration of the sweep (rule x draft_length x theta for pcg x
beta for ssd) runs the same texts with the same seeds after its warm-up. `ar` is always run
as the baseline the speed-ups are measured against.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import platform
import sys
import time
from pathlib import Path

from pcgtts.cli import flags
from pcgtts.cli.flags import comma_list, deprecated_alias, non_negative_int, positive, quiet_logger
from pcgtts.cli.groups import add_sweep_options, check_sweep_options, group_table, sweep_thetas
from pcgtts.runtime.config import POLICIES
from pcgtts.runtime.decode.policy import Rule, names
from pcgtts.runtime.decode.policy import policy as policy_spec

DEFAULT_POLICIES = list(names(lambda p: not p.reads_states))  # mtp-*, eagle-* need trained heads: asked for by name

log = logging.getLogger(__name__)


def _policies(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in POLICIES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown policy {bad}; choose from {', '.join(POLICIES)}")
    return names


def register(sub: argparse._SubParsersAction) -> None:
    from pcgtts.cli.commands import add_model_args

    bench = sub.add_parser("bench", help="latency harness: TTFA, RTF, acceptance, underruns, sweeps, plots")
    add_model_args(bench, policy=False)
    bench.add_argument("--policy", type=_policies, default=DEFAULT_POLICIES,
                       help=f"comma list (default: {','.join(DEFAULT_POLICIES)}; the mtp-* policies need the "
                            "target's heads, `pcgtts train heads`, the eagle-* ones its EAGLE draft, `pcgtts train eagle`)")
    add_sweep_options(bench)
    bench.add_argument("--draft-length", type=comma_list(flags.draft_length), default=[3],
                       help="comma list of draft lengths L, each 1 to 16")
    deprecated_alias(bench, "--lookahead", "draft_length", "--draft-length", type=comma_list(flags.draft_length))
    bench.add_argument("--codec-thread", choices=("on", "off", "both"),
                       help="decode codec windows on their own thread (on, the default), in line with the LM "
                            "(off), or run every case both ways, side by side")
    bench.add_argument("--adaptive", action="store_true",
                       help="also run each speculative rule with the adaptive draft length (L <= the longest --draft-length)")
    bench.add_argument("--beta", type=comma_list(float), help="comma list of SSD betas")
    bench.add_argument("--texts", help="text file, one utterance per line (default: built-in sentences)")
    bench.add_argument("--runs", type=positive(int), default=1, help="measured runs over the text set")
    bench.add_argument("--warmup", type=non_negative_int, default=1, help="warm-up utterances per configuration (excluded)")
    bench.add_argument("--max-tokens", type=flags.max_tokens, help="cap speech tokens per sentence (default: 150 on the random-weight demo pair)")
    bench.add_argument("--temperature", type=flags.temperature, default=0.8, help="sampling temperature, 0 to 10")
    bench.add_argument("--speed", type=positive(float), default=1.0, help="simulated playback speed (< 1: a slower listener)")
    bench.add_argument("--seed", type=flags.seed, default=0)
    bench.add_argument("--json", help="write every record and summary here")
    bench.add_argument("--plot", help="write a PNG: one utterance's timeline and the sweep")
    bench.set_defaults(func=_bench)


def cases(args) -> list:
    from pcgtts.tools.bench import BenchCase

    out = [BenchCase("ar")]
    for policy, draft_length in itertools.product(args.policy, args.draft_length):
        spec = policy_spec(policy)
        if spec.plain:
            continue
        if spec.draft_alone:
            if draft_length == args.draft_length[0]:
                out.append(BenchCase("draft"))
        elif spec.needs_groups:
            out += [BenchCase(policy, draft_length, theta) for theta in (args.theta or [None])]
        elif spec.rule is Rule.SSD:
            out += [BenchCase("ssd", draft_length, ssd_beta=beta) for beta in (args.beta or [None])]
        else:
            out.append(BenchCase(policy, draft_length))
    if getattr(args, "adaptive", False):
        longest = max(args.draft_length)
        out += [BenchCase(policy, longest, adaptive=True) for policy in args.policy if policy_spec(policy).speculative]
    threading = {None: [None], "on": [True], "off": [False], "both": [True, False]}[getattr(args, "codec_thread", None)]
    return [dataclasses.replace(case, codec_thread=t) for t in threading for case in out]


def check_state_policies(policies, args) -> None:
    """Before any model loads: the heads, transitions and EAGLE draft the mtp-* / eagle-* policies asked for exist."""
    mtp = sorted({p for p in policies if policy_spec(p).reads_states})
    if not mtp or args.target is None:  # the built-in voice's own proposers are checked as it loads
        return
    from pcgtts.runtime.config import ModelPaths
    from pcgtts.cli.commands import resolve_settings_from_flags
    from pcgtts.runtime.config import check_policy
    from pcgtts.runtime.loading import check_proposers

    from pcgtts.runtime.lm.loader import concrete_backend

    backend = concrete_backend(resolve_settings_from_flags(args, policy="ar").device.backend,  # flag, --config or default
                               args.target)
    models = ModelPaths(target=args.target, heads=args.heads, transitions=args.transitions, eagle=args.eagle)
    for policy in mtp:
        heads, transitions, eagle = check_proposers(models, policy, backend)
        check_policy(policy, draft=True, groups=True, heads=heads is not None, transitions=transitions is not None,
                     eagle=eagle is not None)


# The harness caps tokens on purpose; each utterance's finish reason is in the JSON instead.
@quiet_logger("pcgtts.runtime.stream_worker")
def _bench(args) -> int:
    from dataclasses import replace

    from tqdm import tqdm

    from pcgtts.tools.bench import DEFAULT_TEXTS, add_speedups, case_config, case_synthesizer, measure, summarize
    from pcgtts.cli.commands import load_synthesizer

    from pcgtts.runtime.files import check_output_file

    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            check_output_file(path, flag)
    if args.texts and not Path(args.texts).is_file():
        raise ValueError(f"--texts {args.texts}: file not found")
    texts = list(DEFAULT_TEXTS)
    if args.texts:
        texts = [line.strip() for line in Path(args.texts).read_text().splitlines() if line.strip()]
        if not texts:
            raise ValueError(f"{args.texts} holds no text")
    from pcgtts.builtin import runs_demo_models

    demo = runs_demo_models(args.target or args.prepared)
    max_tokens = args.max_tokens if args.max_tokens is not None else (150 if demo else None)
    args.max_tokens = max_tokens or 2000  # the synthesizer's own cap when none is given
    todo = cases(args)
    policies = args.policy
    needs_draft = any(policy_spec(c.policy).needs_draft for c in todo)
    args.policy = "pcg" if any(c.policy == "pcg" for c in todo) else ("sd" if needs_draft else "ar")
    sizing = check_sweep_options(args)
    check_state_policies([c.policy for c in todo], args)
    base, settings = load_synthesizer(args)
    models = dataclasses.asdict(settings.models)
    if args.mean_size:  # each target mean group size becomes the theta that gives it on this target
        args.theta = sweep_thetas(args, models["target"], sizing["top_k"])
        todo = cases(argparse.Namespace(**{**vars(args), "policy": policies}))

    synths = [case_synthesizer(base, case, lambda theta: group_table(models["target"], base.target, theta, **sizing)
                                                .to_device(base.target.device))
              for case in todo]
    records: list[list[dict]] = [[] for _ in todo]
    total = len(todo) * (args.warmup + args.runs * len(texts))
    with tqdm(total=total, desc="bench", unit="utt", file=sys.stderr, disable=None) as bar:  # a bar on a terminal only
        for case, synth in zip(todo, synths):
            for i in range(args.warmup):
                measure(synth, texts[i % len(texts)], case_config(base.config, case, args.seed, max_tokens), args.speed)
                bar.update()
        # Interleaved: each utterance is run by every case in turn, so a machine that slows down
        # or speeds up mid-run moves every case alike and the ratios stay paired.
        for run in range(args.runs):
            for j, text in enumerate(texts):
                for case, synth, kept in zip(todo, synths, records):
                    config = case_config(base.config, case, args.seed + 1000 * run + j, max_tokens)
                    kept.append({"case": case.label, "run": run, **measure(synth, text, config, args.speed)})
                    bar.update()
    summaries = [summarize(case, kept) for case, kept in zip(todo, records)]
    utterances = [record for kept in records for record in kept]
    add_speedups(summaries)
    report = {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "device": str(base.target.device), "backend": settings.device.backend,
                    "dtype": settings.device.dtype},
        "date": time.strftime("%Y-%m-%d"),
        "models": {k: (str(v) if v else None) for k, v in models.items()},
        "demo_models": demo,
        "texts": texts, "runs": args.runs, "warmup": args.warmup, "max_tokens": max_tokens, "speed": args.speed,
        "summaries": summaries,
        "utterances": utterances,
    }
    print_table(summaries, demo)
    if args.json:
        from pcgtts.runtime.files import atomic_output

        with atomic_output(args.json) as tmp:
            tmp.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        from pcgtts.tools.bench_plots import plot_report

        plot_report(report, args.plot)
    print(json.dumps({"summaries": summaries}))
    return 0


def print_table(summaries: list[dict], demo: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(value, spec=".2f"):
        return "-" if value is None else format(value, spec)

    table = Table(title="pcgtts bench" + (" (demo models: random weights, not speech)" if demo else ""))
    def paired(s, key):  # the step model's figure, and with AR's per-token overhead
        plain, more = s.get(key), s.get(key + "_with_overhead")
        return fmt(plain) if more is None else f"{fmt(plain)} ({fmt(more)})"

    for name in ("case", "tok/s", "×ar", "pred (+o)", "eff (+o)", "draft/verify/rule/other %", "TTFA50 ms", "TTFA90 ms", "RTF", "accept", "len",
                 "fw/tok", "underruns", "late99 ms"):
        table.add_column(name, justify="left" if name == "case" else "right")
    for s in summaries:
        late = s["chunk_lateness"]["p99"]
        table.add_row(
            s["case"], fmt(s["tokens_per_second"], ".1f"), fmt(s["speedup_vs_ar"]), paired(s, "predicted_speedup"),
            paired(s, "efficiency"), "/".join(f"{100 * s['time_share'][k]:.0f}" for k in ("draft", "verify", "rule", "other")),
            fmt(s["time_to_first_audio"]["p50"] and 1000 * s["time_to_first_audio"]["p50"], ".0f"),
            fmt(s["time_to_first_audio"]["p90"] and 1000 * s["time_to_first_audio"]["p90"], ".0f"),
            fmt(s["real_time_factor"]), fmt(s["acceptance_rate"]), fmt(s["mean_accepted_length"]),
            fmt(s["target_forwards_per_token"]), str(s["underruns"]),
            fmt(None if late is None else 1000 * late, ".0f"),
        )
    console = Console(stderr=True)
    if not console.is_terminal:
        console = Console(stderr=True, width=140)  # a log file: do not squeeze the table to 80 columns
    console.print(table)
