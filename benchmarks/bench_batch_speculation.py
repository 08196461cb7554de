"""Speculation per stream in a batch: each policy's tokens/s alone (today's one-stream loop) and with B
streams decoded together over one model copy (`runtime/decode/batch.py`), LM only (no codec).

For every policy of --policies, B streams (different sentences, seeded, the voice's sampling settings,
exactly --tokens speech tokens each: the stop token is held off) are decoded first one at a time through
`loop.decode` on the loaded target, then all at once, each in a batch slot (`SlotSeat.decode`, its
adaptive draft length planned with the batch's shared passes). A stream alone is timed from its first
tokens to its last (its prefill left out); streams together over the window in which all B decode
together: from the last stream's first tokens (every prefill done: they run one after another, and a
window that overlapped them would charge the faster policy's shorter decode a larger share of them)
to the first stream's last. Reported per policy and B: tokens/s per stream and B times it (aggregate), and its speed-up over plain decoding (`ar`) in the same setting; the
question it answers is whether a speculative policy keeps its one-stream speed-up per stream when B
streams share the passes (the ratio of the two speed-ups). A table on stderr, then one JSON line in the
form of `pcgtts bench --json` (`summaries`: one case per policy and setting, `speedup_vs_ar` against
plain decoding alone), which `tools/results_pages.py --add` imports into a results table.

    pcgtts models scale --shape llasa-1b --out S
    python benchmarks/bench_batch_speculation.py --voice S --quantize int8 --streams 4 \\
        --policies ar,eagle-pcg --tokens 48 --json /tmp/spec.json
    python benchmarks/bench_batch_speculation.py --voice S --compute-device cuda --dtype bfloat16 \\
        --streams 8 --policies ar,pcg,eagle-pcg --tokens 128          # a GPU (benchmarks/GPU.md)
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

SENTENCES = ("The birch canoe slid on the smooth planks.", "Glue the sheet to the dark blue background.",
             "It is easy to tell the depth of a well.", "These days a chicken leg is a rare dish.",
             "Rice is often served in round bowls.", "The juice of lemons makes fine punch.",
             "The box was thrown beside the parked truck.", "The hogs were fed chopped corn and garbage.")


def policies(text: str) -> list[str]:
    """"ar,eagle-pcg" -> the names, each a known policy, `ar` first (the baseline)."""
    from pcgtts.runtime.decode.policy import policy as policy_spec

    names = [p.strip() for p in text.split(",") if p.strip()]
    for name in names:
        try:
            policy_spec(name)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    if not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"distinct policy names, got {text!r}")
    return ["ar"] + [n for n in names if n != "ar"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--voice", type=Path, help="a model folder with target/ draft/ codec/ groups.pcg "
                                               "(`pcgtts models scale --out`); default: the built-in voice")
    ap.add_argument("--quantize", choices=("none", "int8"), default="none", help="the torch target's weights")
    ap.add_argument("--compute-device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--streams", type=int, default=4, help="B: streams decoded together (2-16, default 4)")
    ap.add_argument("--policies", type=policies, default=["ar", "eagle-pcg"],
                    help="comma-separated policies (ar is always run: the baseline); default ar,eagle-pcg")
    ap.add_argument("--tokens", type=int, default=48, help="speech tokens per stream (8-1000, default 48)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds over the policies, in turn forward and backward (1-10, default 2)")
    ap.add_argument("--json", type=Path, help="write the report here too")
    args = ap.parse_args(argv)
    if not 2 <= args.streams <= 16:
        ap.error("--streams must lie in [2, 16]")
    if not 8 <= args.tokens <= 1000:
        ap.error("--tokens must lie in [8, 1000]")
    if not 1 <= args.rounds <= 10:
        ap.error("--rounds must lie in [1, 10]")
    if args.voice is not None and not (args.voice / "target").is_dir():
        ap.error(f"--voice {args.voice}: no target/ folder in it")
    if args.json is not None and (args.json.is_dir() or not args.json.parent.is_dir()):
        ap.error(f"--json {args.json}: not a file in an existing folder")
    return args


def load(args):
    import pcgtts
    from pcgtts.runtime.synthesizer import Synthesizer

    settings = dict(backend="torch", max_batch=args.streams, quantize=None if args.quantize == "none" else "int8",
                    compute_device=args.compute_device, dtype=args.dtype)
    if args.voice is None:
        return pcgtts.Synthesizer.from_pretrained(**settings)
    v = args.voice
    groups = v / "groups.pcg"
    return Synthesizer.from_pretrained(v / "target", v / "draft" if (v / "draft").is_dir() else None, v / "codec",
                                       groups if groups.is_file() else None, **settings)


def timed_tokens(bursts) -> tuple[int, float]:
    """(tokens after the first burst, seconds from the first burst to the last): the decode's own pace,
    its prefill left out."""
    first_at, tokens, last_at = None, 0, None
    for burst in bursts:
        last_at = time.perf_counter()
        if first_at is None:
            first_at = last_at
        else:
            tokens += len(burst)
    return tokens, (last_at - first_at) if first_at is not None else 0.0


def decode_alone(synth, prompt, config, seed: int, stats=None) -> tuple[int, float]:
    """(tokens, seconds) of one stream through today's loop on the loaded target (`timed_tokens`)."""
    import torch

    from pcgtts.runtime.decode.loop import decode

    route = synth.route(False)
    plan = route.planner.loop_arguments(config, seeded=True)
    generator = torch.Generator(device=route.target.device).manual_seed(seed)
    return timed_tokens(decode(route.target, synth.draft, prompt, config, generator, synth.groups, stats, **plan))


def burst_times(bursts) -> list[tuple[float, int]]:
    """(perf_counter() when it arrived, tokens) of each burst of one stream."""
    return [(time.perf_counter(), len(burst)) for burst in bursts]


def together_window(streams: list[list[tuple[float, int]]]) -> list[tuple[int, float]]:
    """(tokens, seconds) of each stream over the window in which all decode together: from the last
    stream's first burst (every prefill done) to the first stream's last burst."""
    start = max(times[0][0] for times in streams)
    end = min(times[-1][0] for times in streams)
    window = [(sum(n for at, n in times if start < at <= end), end - start) for times in streams]
    if end <= start or not any(tokens for tokens, _ in window):
        raise ValueError("the streams never decoded together: raise --tokens")
    return window


def decode_together(synth, prompts, config, seeds, stats=None, timed: bool = True) -> list[tuple[int, float]] | None:
    """(tokens, seconds) of each stream decoded at once, each in a batch slot, over the window in which
    all of them decode together (`together_window`); None when not `timed` (a warm-up)."""
    import torch

    route = synth.route(False)
    seats = [synth.batch.seat() for _ in prompts]
    paces: list = [None] * len(prompts)
    errors: list[BaseException] = []

    def run(i):
        try:
            plan = route.planner.loop_arguments(config, seeded=True, batched=True)
            generator = torch.Generator(device=route.target.device).manual_seed(seeds[i])
            paces[i] = burst_times(seats[i].decode(prompts[i], config, generator, stats[i] if stats else None,
                                                   **plan))
        except BaseException as err:  # reported after the join
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for seat in seats:
        seat.close()
    if errors:
        raise errors[0]
    return together_window(paces) if timed else None


def tokens_a_step(stats) -> float:
    """Speech tokens a target forward gave, over the streams' decodes (1 for plain decoding)."""
    return sum(s.emitted for s in stats) / max(sum(s.target_forwards for s in stats), 1)


def pace(runs: list[tuple[int, float]]) -> float:
    """Tokens per second of one stream, over the streams' decodes (their tokens / their seconds)."""
    return sum(t for t, _ in runs) / sum(s for _, s in runs)


LONGEST_VERIFY = 4  # tokens a stream's verify carries at most in the pass curve (L = 3)


def acceptance(stats) -> list[float]:
    """Per-position conditional acceptance over the decodes' speculative steps (`cost_model`)."""
    from pcgtts.runtime.decode.cost_model import conditional_acceptance

    longest = max((len(s.per_position_accepted) for s in stats), default=0)
    accepted = [sum(s.per_position_accepted[i] for s in stats if i < len(s.per_position_accepted))
                for i in range(longest)]
    speculative = sum(sum(s.length_counts[1:]) for s in stats)
    return conditional_acceptance(accepted, speculative)


def pass_curve(synth, prompts, longest: int, repeats: int = 5) -> dict[int, list[float]]:
    """{n: [seconds of the batch's target pass carrying n streams' T tokens each, T = 1..longest]} for
    n = 1 and every stream (median of `repeats`; the head's scores of every row included, as the gate
    computes them), each slot holding its prompt."""
    import torch

    lm, streams = synth.batch.lm, len(prompts)
    lm.ensure_cache()
    for slot, prompt in enumerate(prompts):
        lm.prefill(slot, prompt[:-1])
    held = list(lm.lengths)
    curve = {}
    for n in sorted({1, streams}):
        curve[n] = []
        for tokens in range(1, longest + 1):
            ids = torch.stack([p[-1:].expand(tokens) for p in prompts[:n]])
            times = []
            for _ in range(repeats):
                lm.lengths[:] = held
                started = time.perf_counter()
                with torch.inference_mode():
                    lm.model.head_scores(lm.hidden(list(range(n)), ids))
                if lm.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - started)
            curve[n].append(sorted(times)[repeats // 2])
    lm.lengths[:] = held
    return curve


def bound(acceptance: list[float], seconds: list[float]) -> float:
    """The most a proposer that cost nothing could speed plain decoding up by, at draft length L = 1 ..
    len(seconds) - 1: its expected tokens a verify at `acceptance` over what the verify's pass costs
    against a plain step's (`seconds`: a pass carrying 1 .. L + 1 tokens a stream)."""
    from pcgtts.runtime.decode.cost_model import expected_tokens

    if not acceptance:
        return 1.0
    return max(1.0, *(expected_tokens(acceptance, k) * seconds[0] / seconds[k] for k in range(1, len(seconds))))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pcgtts.runtime.decode.steps import DecodeStats
    from pcgtts.runtime.text.prompt import build_prompt

    synth = load(args)
    target = synth.route(False).target
    prompts = [build_prompt(target.tokenizer, target.vocab, SENTENCES[i % len(SENTENCES)]).view(-1)
               for i in range(args.streams)]
    seeds = list(range(args.streams))
    configs, runs = {}, {name: {"alone": [], "batch": [], "alone_stats": [], "batch_stats": []}
                         for name in args.policies}
    for name in args.policies:
        config = replace(synth.config.decode, policy=name, max_new_tokens=args.tokens, min_new_tokens=args.tokens)
        synth.route(False).planner.plan(config)  # calibration and warm-up before timing
        decode_alone(synth, prompts[0], replace(config, max_new_tokens=8, min_new_tokens=8), 0)
        decode_together(synth, prompts, replace(config, max_new_tokens=8, min_new_tokens=8), seeds,
                        timed=False)  # slots warm
        configs[name] = config
    for turn in range(args.rounds):  # ABBA: drifts of the machine's pace fall on every policy alike
        for name in (args.policies if turn % 2 == 0 else args.policies[::-1]):
            r, config = runs[name], configs[name]
            alone_stats, batch_stats = [DecodeStats() for _ in prompts], [DecodeStats() for _ in prompts]
            r["alone"] += [decode_alone(synth, p, config, s, st) for p, s, st in zip(prompts, seeds, alone_stats)]
            r["batch"] += decode_together(synth, prompts, config, seeds, batch_stats)
            r["alone_stats"] += alone_stats
            r["batch_stats"] += batch_stats
    results = {}
    for name, r in runs.items():
        results[name] = {"alone_tok_s": pace(r["alone"]), "batch_tok_s": pace(r["batch"]) * args.streams,
                         "alone_tokens_a_step": tokens_a_step(r["alone_stats"]),
                         "batch_tokens_a_step": tokens_a_step(r["batch_stats"]),
                         "alone_acceptance": acceptance(r["alone_stats"])}
        print(f"  {name}: alone {results[name]['alone_tok_s']:.1f} tok/s "
              f"({results[name]['alone_tokens_a_step']:.2f} tokens a target forward), {args.streams} together "
              f"{results[name]['batch_tok_s']:.1f} tok/s in all ({results[name]['batch_tokens_a_step']:.2f})",
              file=sys.stderr)
    curve = pass_curve(synth, prompts, LONGEST_VERIFY)
    base = results["ar"]
    summaries, rows = [], []
    for name, r in results.items():
        per_stream = r["batch_tok_s"] / args.streams
        alone_x, batch_x = r["alone_tok_s"] / base["alone_tok_s"], r["batch_tok_s"] / base["batch_tok_s"]
        label = "plain decoding" if name == "ar" else name
        summaries += [
            {"case": f"B = 1 stream, {label}", "policy": name, "tokens_per_second": r["alone_tok_s"],
             "speedup_vs_ar": alone_x, "tokens_per_target_forward": r["alone_tokens_a_step"]},
            {"case": f"B = {args.streams} streams, {label}", "policy": name, "tokens_per_second": r["batch_tok_s"],
             "speedup_vs_ar": r["batch_tok_s"] / base["alone_tok_s"], "per_stream_tokens_per_second": per_stream,
             "per_stream_speedup_vs_ar_in_batch": batch_x, "speedup_kept": batch_x / alone_x,
             "tokens_per_target_forward": r["batch_tokens_a_step"]}]
        if name != "ar":
            ceiling_alone, ceiling_batch = (bound(r["alone_acceptance"], curve[n]) for n in (1, args.streams))
            summaries[-2]["predicted_at_most"] = ceiling_alone
            summaries[-1]["predicted_at_most"] = ceiling_batch
            summaries[-1]["speedup_kept_at_most"] = ceiling_batch / ceiling_alone
            print(f"  {name}: a proposer that cost nothing, at the acceptance measured alone, would give at most "
                  f"{ceiling_alone:.2f}x alone and {ceiling_batch:.2f}x in the batch (kept {ceiling_batch / ceiling_alone:.2f}): "
                  f"a pass of {args.streams} streams' verifies costs {curve[args.streams][-1] / curve[args.streams][0]:.2f}x "
                  f"their plain step, one stream's {curve[1][-1] / curve[1][0]:.2f}x", file=sys.stderr)
        rows.append((name, r["alone_tok_s"], alone_x, r["batch_tok_s"], per_stream, batch_x, batch_x / alone_x))
    print(f"\n{'policy':>12} {'alone tok/s':>12} {'x ar alone':>11} {f'B={args.streams} tok/s':>12} "
          f"{'per stream':>11} {'x ar in B':>10} {'kept':>6}", file=sys.stderr)
    for row in rows:
        print(f"{row[0]:>12} {row[1]:12.1f} {row[2]:11.2f} {row[3]:12.1f} {row[4]:11.1f} {row[5]:10.2f} "
              f"{row[6]:6.2f}", file=sys.stderr)
    report = {"benchmark": "batch_speculation", "date": datetime.date.today().isoformat(),
              "command": " ".join(["python benchmarks/bench_batch_speculation.py",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "streams": args.streams, "tokens": args.tokens, "quantize": args.quantize,
              "compute_device": args.compute_device, "dtype": args.dtype,
              "voice": str(args.voice) if args.voice else "built-in", "rounds": args.rounds,
              "pass_seconds": {str(n): times for n, times in curve.items()}, "summaries": summaries}
    print(json.dumps(report))
    if args.json:
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
