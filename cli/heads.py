"""`pcgtts heads train | eagle | eagle-temperatures | transitions`: proposers on the target's hidden states.

`train`: multi-token heads for the mtp-* policies (train/heads.py); `eagle`: an EAGLE draft for
the eagle-* policies (train/eagle.py); `eagle-temperatures`: a trained draft's own temperature,
fitted on held-out sequences; `transitions`: the code transition table of mtp-viterbi.
All validate their arguments before any model loads, show progress, print a readable table and
then one JSON line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pcgtts.cli.commands import print_report, read_code_sequences
from pcgtts.cli.flags import positive


def register(sub: argparse._SubParsersAction) -> None:
    heads = sub.add_parser("heads", help="proposers on the target's states: multi-token heads (mtp-*), EAGLE draft (eagle-*)")
    cmds = heads.add_subparsers(dest="heads_cmd", required=True)

    train = cmds.add_parser("train", help="train k heads on the frozen target, on sequences it samples itself")
    train.add_argument("--target", required=True, help="target checkpoint directory (torch format)")
    train.add_argument("--out", help="heads file (default: <target>/mtp_heads.safetensors, found there by the runtime)")
    train.add_argument("--work-dir", help="generated sequences, checkpoint, loss log (default: <out>.work)")
    train.add_argument("--sentences", help="training sentences, one per line (default: the lab's template sentences)")
    train.add_argument("--num-heads", type=positive(int), default=4)
    train.add_argument("--sequences", type=positive(int), default=48, help="on-policy training sequences")
    train.add_argument("--heldout", type=positive(int), default=8, help="sequences for the before/after figures")
    train.add_argument("--steps", type=positive(int), default=400)
    train.add_argument("--temperature", type=positive(float), default=0.8, help="of the on-policy sampling")
    train.add_argument("--max-tokens", type=positive(int), default=400, help="speech tokens per sequence at most")
    train.add_argument("--seed", type=int, default=0)
    train.set_defaults(func=_train)

    eagle = cmds.add_parser("eagle", help="train an EAGLE draft (one block on the target's states) on sequences "
                                          "the frozen target samples itself")
    eagle.add_argument("--target", required=True, help="target checkpoint directory (torch format)")
    eagle.add_argument("--out", help="draft file (default: <target>/eagle_draft.safetensors, found there by the runtime)")
    eagle.add_argument("--work-dir", help="generated sequences, checkpoint, loss log (default: <out>.work)")
    eagle.add_argument("--sentences", help="training sentences, one per line (default: the lab's template sentences)")
    # None: train/eagle.py's EagleTrainConfig default (resolved there, not imported here: no torch at parse time)
    eagle.add_argument("--sequences", type=positive(int), help="on-policy training sequences (default 500)")
    eagle.add_argument("--heldout", type=positive(int), help="sequences for the before/after figures (default 12)")
    eagle.add_argument("--steps", type=positive(int), help="optimiser steps (default 3,000)")
    eagle.add_argument("--temperature", type=positive(float), default=0.8, help="of the on-policy sampling")
    eagle.add_argument("--max-tokens", type=positive(int), default=400, help="speech tokens per sequence at most")
    eagle.add_argument("--mlp-size", type=positive(int), help="the block's MLP width (default: the target's; "
                       "narrower = cheaper proposals)")
    eagle.add_argument("--block", choices=["attention", "mlp"], default="attention",
                       help="the draft's block: a LLaMA block with its own cache, or its MLP half alone "
                            "(no attention, no cache: half the ops a proposal)")
    eagle.add_argument("--feature-layers", type=_layer_list, default=(),
                       help="target layers (0-based, comma-separated) the draft reads besides the last, "
                            "fused by the draft (EAGLE-3's features; the target's steps then return them)")
    eagle.add_argument("--passes", type=positive(int),
                       help="proposal positions trained: pass k feeds the draft k - 1 of its own states (default 3)")
    eagle.add_argument("--batch-sequences", type=positive(int), help="sequences per optimiser step (default 8)")
    eagle.add_argument("--lr", type=positive(float), help="peak learning rate (default 1e-3; lower with --init-from)")
    eagle.add_argument("--loss", choices=["kl", "tv", "tv+group"], default="kl",
                       help="kl: KL at temperature 1 on every row; tv / tv+group: what SD / PCG lose, at --temperature")
    eagle.add_argument("--groups", help="the target's .pcg group table (for --loss tv+group)")
    eagle.add_argument("--seed", type=int, default=0)
    eagle.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                       help="where the target samples and the draft trains")
    eagle.add_argument("--sample-batch", type=positive(int), default=1,
                       help="on-policy sequences sampled at once (shorter prompts padded; other draws than "
                            "one at a time, so a cache made one way is not reused the other)")
    eagle.add_argument("--max-minutes", type=positive(float),
                       help="end training after this long if --steps take longer, the learning rate's "
                            "decay following the clock (a time budget on a shared or rented machine)")
    eagle.add_argument("--state-dtype", choices=["float32", "float16"], default="float32",
                       help="the target's states as kept for training: float16 halves their memory (the built-in "
                            "voice's target with five layers read: ~7 KB a code in float32), for more sequences")
    eagle.add_argument("--init-from", metavar="DRAFT",
                       help="start from this trained EAGLE draft (same target, --block, --mlp-size and "
                            "--feature-layers) instead of the target's last block: more training on new sequences")
    eagle.add_argument("--end-by", type=positive(float), metavar="EPOCH_SECONDS",
                       help="end training by this wall-clock time (`date +%%s`), as --max-minutes does: a "
                            "deadline that sampling the sequences counts against")
    eagle.set_defaults(func=_eagle)

    temps = cmds.add_parser("eagle-temperatures",
                            help="fit a trained EAGLE draft's own temperature on held-out sequences the target samples "
                                 "(the draft's weights are kept; `pcgtts heads eagle` fits it after training)")
    temps.add_argument("--target", required=True, help="target checkpoint directory (torch format)")
    temps.add_argument("--eagle", required=True, help="the trained draft file")
    temps.add_argument("--out", help="where the draft is written with its fitted temperatures (default: --eagle itself)")
    temps.add_argument("--work-dir", help="the held-out sequences sampled (default: <out>.temperatures)")
    temps.add_argument("--sentences", help="sentences, one per line, split as the draft's training split them "
                                           "(default: the lab's template sentences)")
    temps.add_argument("--heldout", type=positive(int), default=48, help="held-out sequences sampled")
    temps.add_argument("--temperature", type=positive(float), default=0.8, help="of the held-out sampling")
    temps.add_argument("--max-tokens", type=positive(int), default=400, help="speech tokens per sequence at most")
    temps.add_argument("--seed", type=int, default=0, help="the sentence split's seed (the draft's training seed)")
    temps.add_argument("--sample-batch", type=positive(int), default=16, help="held-out sequences sampled at once")
    temps.set_defaults(func=_eagle_temperatures)

    trans = cmds.add_parser("transitions", help="code transition table for mtp-viterbi, from code sequences")
    trans.add_argument("--codes", required=True, nargs="+",
                       help=".npz / .npy files of speech code sequences (e.g. the lab's codes.npz)")
    trans.add_argument("--num-speech", type=positive(int), default=65536, help="speech codes in the vocabulary")
    trans.add_argument("--top-k", type=positive(int), default=64, help="successors stored per code")
    trans.add_argument("--out", required=True, help="the .pct file (runtime default: <target>/transitions.pct)")
    trans.set_defaults(func=_transitions)


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer indices like 1,3, got {text!r}") from None
    return layers


def _checked_paths(args, default_name: str) -> tuple[Path, Path, tuple[str, ...]]:
    """(out file, work dir, sentences), validated before any model loads."""
    from pcgtts.runtime.files import check_output_dir, check_output_file

    target = Path(args.target)
    if not (target / "config.json").is_file():
        raise ValueError(f"no target checkpoint at {target} (config.json missing)")
    if args.sentences is not None and not Path(args.sentences).is_file():
        raise ValueError(f"sentences file not found: {args.sentences}")
    out = Path(args.out) if args.out else target / default_name
    work = Path(args.work_dir) if args.work_dir else out.with_name(out.name + ".work")
    check_output_file(out)
    check_output_dir(work, "--work-dir")
    from pcgtts.train.distill import read_sentences

    return out, work, tuple(read_sentences(args.sentences))


def _train(args) -> int:
    from pcgtts.runtime.lm.heads import HEADS_FILE

    out, work, sentences = _checked_paths(args, HEADS_FILE)
    from pcgtts.train.cli import _Bar
    from pcgtts.train.heads import HeadsTrainConfig, train_heads

    cfg = HeadsTrainConfig(target=Path(args.target), out=out, work_dir=work, sentences=sentences,
                           num_heads=args.num_heads, sequences=args.sequences, heldout=args.heldout, steps=args.steps,
                           temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    summary = train_heads(cfg, progress=_Bar("heads", "step"), generation_progress=_Bar("sequences", "seq"))
    print_report(summary, "pcgtts heads train")
    return 0


def _eagle(args) -> int:
    from pcgtts.runtime.lm.eagle import EAGLE_FILE, checked_feature_layers

    out, work, sentences = _checked_paths(args, EAGLE_FILE)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device here")
    config = json.loads((Path(args.target) / "config.json").read_text())
    try:
        checked_feature_layers(args.feature_layers, config.get("num_hidden_layers", 0))
    except ValueError as err:
        raise ValueError(f"--feature-layers: {err}") from None
    if args.init_from:  # checked before any model loads: an hour of sampling is not lost to a wrong flag
        from pcgtts.train.eagle import check_init_draft

        if not Path(args.init_from).is_file():
            raise ValueError(f"--init-from: no draft file {args.init_from}")
        check_init_draft(Path(args.init_from), args.block, args.mlp_size or config.get("intermediate_size"),
                         args.feature_layers)
    from pcgtts.train.cli import _Bar
    from pcgtts.train.eagle import EagleTrainConfig, train_eagle

    if args.groups is not None and not Path(args.groups).is_file():
        raise ValueError(f"--groups: no group table {args.groups}")
    given = {name: getattr(args, name) for name in ("sequences", "heldout", "steps", "passes", "batch_sequences", "lr")
             if getattr(args, name) is not None}
    cfg = EagleTrainConfig(target=Path(args.target), out=out, work_dir=work, sentences=sentences,
                           temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                           intermediate_size=args.mlp_size, block=args.block, feature_layers=args.feature_layers,
                           device=args.device, sample_batch=args.sample_batch, max_minutes=args.max_minutes,
                           end_by=args.end_by, state_dtype=args.state_dtype, init_from=args.init_from,
                           loss=args.loss, groups=args.groups, **given)
    summary = train_eagle(cfg, progress=_Bar("eagle", "step"), generation_progress=_Bar("sequences", "seq"))
    print_report(summary, "pcgtts heads eagle")
    return 0


def _eagle_temperatures(args) -> int:
    from pcgtts.runtime.lm.eagle import EagleDraft

    eagle = Path(args.eagle)
    if not eagle.is_file():
        raise ValueError(f"--eagle: no draft file {eagle}")
    block, width, layers = EagleDraft.stored_shape(eagle)  # a readable draft, checked before any model loads
    out = Path(args.out or eagle)
    out, work, sentences = _checked_paths(argparse.Namespace(  # the work folder checked is the one used
        target=args.target, sentences=args.sentences, out=str(out),
        work_dir=args.work_dir or str(out.with_name(out.name + ".temperatures"))), eagle.name)
    from pcgtts.train.cli import _Bar
    from pcgtts.train.eagle import EagleTrainConfig, fit_draft_temperatures

    # one training sequence is sampled too (the split's cache holds both), then left unused
    cfg = EagleTrainConfig(target=Path(args.target), out=out, work_dir=work, sentences=sentences, sequences=1,
                           heldout=args.heldout, temperature=args.temperature, max_tokens=args.max_tokens,
                           seed=args.seed, sample_batch=args.sample_batch, block=block, intermediate_size=width,
                           feature_layers=layers)
    summary = fit_draft_temperatures(cfg, eagle, progress=_Bar("sequences", "seq"))
    print_report(summary, "pcgtts heads eagle-temperatures")
    return 0


def _transitions(args) -> int:
    from pcgtts.runtime.files import check_output_file

    for path in args.codes:
        if not Path(path).is_file():
            raise ValueError(f"codes file not found: {path}")
    check_output_file(Path(args.out))
    from pcgtts.runtime.decode.transitions import TransitionTable

    sequences = read_code_sequences(args.codes)
    table = TransitionTable.build(sequences, vocab_size=args.num_speech + 1, top_k=args.top_k)  # + the stop index
    table.save(args.out)
    print_report({"out": args.out, "sequences": len(sequences), "codes": int(sum(len(s) for s in sequences)),
                  "top_k": args.top_k}, "pcgtts heads transitions")
    return 0
