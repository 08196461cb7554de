"""`pcgtts train ...`: every training command in one group.

    train corpus | codec | lm                  the speech lab's voice, step by step (cli/lab.py)
    train draft init | distill | finetune      drafts: layers of the target; distilled on the target's
                                               own samples; the lab's fine-tune on its training codes
    train eagle | eagle-temperatures           an EAGLE draft for the eagle-* policies (train/eagle.py)
    train heads                                multi-token heads for the mtp-* policies (train/heads.py)
    train transitions                          the code transition table of mtp-viterbi
    train package | all                        the committed voice; the lab's steps in order

The former spellings `pcgtts lab ...`, `pcgtts draft ...` and `pcgtts heads ...` still parse, to the
same handlers, with a deprecation warning (`DEPRECATED`); they are left out of `pcgtts --help`.
All commands validate their arguments before any model loads, show progress, print a readable
table and then one JSON line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pcgtts.cli import flags
from pcgtts.cli.commands import print_report, read_code_sequences
from pcgtts.cli.flags import positive
from pcgtts.runtime.config import check_compute_device
from pcgtts.cli import lab

# The former command groups, each {old sub-command: the new spelling after `pcgtts train`}.
DEPRECATED = {
    "lab": {"corpus": "corpus", "codec": "codec", "lm": "lm", "draft": "draft finetune", "package": "package",
            "all": "all"},
    "draft": {"init": "draft init", "train": "draft distill"},
    "heads": {"train": "heads", "eagle": "eagle", "eagle-temperatures": "eagle-temperatures",
              "transitions": "transitions"},
}


def register(sub: argparse._SubParsersAction) -> None:
    """`pcgtts train ...`, and the former spellings as hidden deprecated aliases."""
    train = sub.add_parser("train", help="training: the lab's voice (corpus, codec, lm, package), drafts, EAGLE "
                                         "drafts, multi-token heads, code transitions")
    cmds = train.add_subparsers(dest="train_cmd", required=True)
    lab.add_command(cmds, "corpus")
    lab.add_command(cmds, "codec")
    lab.add_command(cmds, "lm")
    draft = cmds.add_parser("draft", help="drafts: init (a subset of the target's layers), distill (towards the "
                                          "target on its own samples), finetune (the lab's draft step)")
    drafts = draft.add_subparsers(dest="draft_cmd", required=True)
    _add_draft_init(drafts, "init")
    _add_draft_distill(drafts, "distill")
    lab.add_command(drafts, "draft", "finetune")
    _add_eagle(cmds, "eagle")
    _add_eagle_temperatures(cmds, "eagle-temperatures")
    _add_heads(cmds, "heads")
    _add_transitions(cmds, "transitions")
    lab.add_command(cmds, "package")
    lab.add_command(cmds, "presets")
    lab.add_command(cmds, "all")
    _register_deprecated(sub)


def _register_deprecated(sub: argparse._SubParsersAction) -> None:
    """The former groups, added without help= so `pcgtts --help` does not list them; each command
    records its new spelling (`replaced_by`), which `pcgtts` warns about before it runs."""
    added = {}
    for group, renames in DEPRECATED.items():
        where = f"`pcgtts train {' | '.join(dict.fromkeys(n.split()[0] for n in renames.values()))}`"
        parser = sub.add_parser(group, description=f"Deprecated: use {where}; this spelling will be removed "
                                                    "in the next release.")
        cmds = parser.add_subparsers(dest=f"{group}_cmd", required=True)
        added[group] = cmds
    lab_cmds, draft_cmds, heads_cmds = added["lab"], added["draft"], added["heads"]
    for job in lab.LAB_JOBS:
        if job in DEPRECATED["lab"]:
            lab.add_command(lab_cmds, job)
    _add_draft_init(draft_cmds, "init")
    _add_draft_distill(draft_cmds, "train")
    _add_heads(heads_cmds, "train")
    _add_eagle(heads_cmds, "eagle")
    _add_eagle_temperatures(heads_cmds, "eagle-temperatures")
    _add_transitions(heads_cmds, "transitions")
    for group, cmds in added.items():
        for old, new in DEPRECATED[group].items():
            cmds.choices[old].set_defaults(replaced_by=f"pcgtts train {new}")


def deprecation_notice(args: argparse.Namespace) -> str | None:
    """The warning for a command given in a former spelling, or None."""
    new = getattr(args, "replaced_by", None)
    if new is None:
        return None
    old = f"pcgtts {args.command} {getattr(args, args.command + '_cmd')}"
    return f"`{old}` is deprecated and will be removed in the next release: use `{new}`"


def _add_heads(cmds, name: str) -> argparse.ArgumentParser:
    train = cmds.add_parser(name, help="train k multi-token heads (mtp-* policies) on the frozen target, on "
                                         "sequences it samples itself")
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
    return train


def _add_eagle(cmds, name: str) -> argparse.ArgumentParser:
    eagle = cmds.add_parser(name, help="train an EAGLE draft (one block on the target's states) on sequences "
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
                       help="start from this trained EAGLE draft (same --block, --mlp-size and --feature-layers; "
                            "trained for this target or an earlier version of it) instead of the target's last "
                            "block: more training on new sequences")
    eagle.add_argument("--end-by", type=positive(float), metavar="EPOCH_SECONDS",
                       help="end training by this wall-clock time (`date +%%s`), as --max-minutes does: a "
                            "deadline that sampling the sequences counts against")
    eagle.set_defaults(func=_eagle)
    return eagle


def _add_eagle_temperatures(cmds, name: str) -> argparse.ArgumentParser:
    temps = cmds.add_parser(name,
                            help="fit a trained EAGLE draft's own temperature on held-out sequences the target samples "
                                 "(the draft's weights are kept; `pcgtts train eagle` fits it after training)")
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
    return temps


def _add_transitions(cmds, name: str) -> argparse.ArgumentParser:
    trans = cmds.add_parser(name, help="code transition table for mtp-viterbi, from code sequences")
    trans.add_argument("--codes", required=True, nargs="+",
                       help=".npz / .npy files of speech code sequences (e.g. the lab's codes.npz)")
    trans.add_argument("--num-speech", type=positive(int), default=65536, help="speech codes in the vocabulary")
    trans.add_argument("--top-k", type=positive(int), default=64, help="successors stored per code")
    trans.add_argument("--out", required=True, help="the .pct file (runtime default: <target>/transitions.pct)")
    trans.set_defaults(func=_transitions)
    return trans


def _add_draft_init(cmds, name: str) -> argparse.ArgumentParser:
    init = cmds.add_parser(name, help="make a draft from a subset of the target's layers")
    init.add_argument("--target", required=True, help="target checkpoint directory")
    init.add_argument("--layers", required=True, help="a count (spread over the depth) or indices like 0,7,15")
    init.add_argument("--out", required=True)
    init.add_argument("--used-codes", help=".npz/.npy of speech code sequences (e.g. the lab's codes.npz): give the draft "
                                           "a head over only the codes that occur (cheaper steps; still exact)")
    init.set_defaults(func=_draft_init)
    return init


def _add_draft_distill(cmds, name: str) -> argparse.ArgumentParser:
    train = cmds.add_parser(name, help="distil a draft towards the target on the target's own samples "
                                           "(resumes from --out)")
    train.add_argument("--target", required=True, help="target checkpoint directory")
    train.add_argument("--draft", required=True,
                       help="draft checkpoint directory to start from (e.g. `pcgtts train draft init`)")
    train.add_argument("--out", required=True, help="output directory: sequences, checkpoint, log, export/")
    train.add_argument("--groups", help="the target's group table (.pcg): needed by --loss tv+group; "
                                        "adds PCG's expected acceptance to the summary")
    train.add_argument("--sentences", help="training sentences, one per line (default: the lab corpus's "
                                           "template sentences; never the quality test set)")
    train.add_argument("--steps", type=positive(int), default=500, help="optimizer steps (default 500)")
    train.add_argument("--sequences", type=positive(int), default=64,
                       help="training sequences the target generates (default 64)")
    train.add_argument("--heldout", type=positive(int), default=8,
                       help="held-out sequences the acceptance is measured on (default 8)")
    train.add_argument("--loss", choices=("tv", "kl", "tv+group"), default="tv",
                       help="tv: total variation (= 1 - SD acceptance, default); kl: KL(target || draft); "
                            "tv+group: tv + the group-level TV PCG accepts on (needs --groups)")
    train.add_argument("--max-tokens", type=flags.max_tokens, default=500,
                       help="speech tokens per generated sequence at most (50 per s; default 500)")
    train.add_argument("--temperature", type=flags.setting(positive(float), "temperature"), default=0.8,
                       help="sampling temperature of the target and of the matched distributions (default 0.8)")
    train.add_argument("--seed", type=flags.seed, default=0)
    train.add_argument("--lr", type=positive(float), default=1e-4, help="AdamW peak learning rate (default 1e-4)")
    train.add_argument("--batch-size", type=positive(int), default=4, help="sequences per step (default 4)")
    train.add_argument("--compute-device", default="cpu", help="cpu (default), cuda or cuda:N")
    train.add_argument("--threads", type=flags.cpu_threads(1), help="CPU threads (default: torch's)")
    train.set_defaults(func=_draft_distill)
    return train


def _draft_init(args) -> int:
    from pcgtts.runtime.files import check_output_dir
    from pcgtts.train.subset_draft import make_layer_subset_draft

    check_output_dir(args.out)
    if args.used_codes is not None and not Path(args.used_codes).is_file():
        raise ValueError(f"--used-codes {args.used_codes}: file not found")
    spec = args.layers.strip()
    layers = [int(x) for x in spec.split(",")] if "," in spec else int(spec)
    out = make_layer_subset_draft(args.target, args.out, layers)
    report = {"draft": str(out), "layers": json.loads((out / "config.json").read_text())["pcgtts_draft"]["layers"]}
    if args.used_codes is not None:
        import numpy as np

        from pcgtts.runtime.lm.checkpoint import load_tokenizer, write_head_codes
        from pcgtts.runtime.text.vocab import SpeechVocab

        codes = np.concatenate(read_code_sequences([args.used_codes]))
        num_speech = SpeechVocab.from_tokenizer(load_tokenizer(out)).num_speech
        report["head_rows"] = int(np.load(write_head_codes(out, codes, num_speech)).size)
    print(json.dumps(report))
    return 0


def _draft_distill(args) -> int:
    from pcgtts.runtime.files import check_output_dir

    # Everything checkable is checked before a model loads (the library checks the numbers again).
    for flag, path in (("--target", args.target), ("--draft", args.draft)):
        if not Path(path).is_dir():
            raise ValueError(f"{flag} {path}: directory not found")
        if not (Path(path) / "config.json").is_file():
            raise ValueError(f"{flag} {path} is not a checkpoint directory: no config.json")
    if args.loss == "tv+group" and args.groups is None:
        raise ValueError("--loss tv+group needs the target's group table: give --groups")
    if args.groups is not None and not Path(args.groups).is_file():
        raise ValueError(f"--groups {args.groups}: group table not found")
    check_output_dir(args.out)
    check_compute_device(args.compute_device)
    from pcgtts.train.distill import DistillConfig, read_sentences, train_distill

    if args.sentences is not None:
        read_sentences(Path(args.sentences))  # exists, readable, every line speakable
    cfg = DistillConfig(target=args.target, draft=args.draft, out_dir=args.out, groups=args.groups,
                        sentences=args.sentences, steps=args.steps, sequences=args.sequences, heldout=args.heldout,
                        loss=args.loss, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                        lr=args.lr, batch_size=args.batch_size, compute_device=args.compute_device,
                        threads=args.threads)
    summary = train_distill(cfg, progress=lab.ProgressBar("distill", "step"), generation_progress=lab.ProgressBar("sequences", "seq"))
    _print_distill_summary(summary)
    return 0


def _print_distill_summary(summary: dict) -> None:
    """Before/after acceptance first, then every other field; then the whole summary as one JSON line."""
    rows = [("expected SD acceptance (1 - TV)", "acceptance"), ("TV", "tv")]
    if "group_tv_before" in summary:
        rows += [("expected PCG acceptance (1 - group TV)", "pcg_acceptance"), ("group TV", "group_tv")]
    width = max(len(r[0]) for r in rows)
    print(f"held-out ({summary['heldout_sequences']} sequences, {summary['heldout_tokens']} tokens)"
          .ljust(width) + f"  {'before':>8}  {'after':>8}")
    for label, key in rows:
        print(f"{label:<{width}}  {summary[key + '_before']:8.4f}  {summary[key + '_after']:8.4f}")
    rest = {k: v for k, v in summary.items() if not k.endswith(("_before", "_after"))}
    width = max(len(k) for k in rest)
    for key, value in rest.items():
        print(f"{key:<{width}}  {f'{value:.4f}' if isinstance(value, float) else value}")
    print(json.dumps(summary, default=str))


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
    from pcgtts.train.heads import HeadsTrainConfig, train_heads

    cfg = HeadsTrainConfig(target=Path(args.target), out=out, work_dir=work, sentences=sentences,
                           num_heads=args.num_heads, sequences=args.sequences, heldout=args.heldout, steps=args.steps,
                           temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    summary = train_heads(cfg, progress=lab.ProgressBar("heads", "step"), generation_progress=lab.ProgressBar("sequences", "seq"))
    print_report(summary, "pcgtts train heads")
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
    summary = train_eagle(cfg, progress=lab.ProgressBar("eagle", "step"), generation_progress=lab.ProgressBar("sequences", "seq"))
    print_report(summary, "pcgtts train eagle")
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
    from pcgtts.train.eagle import EagleTrainConfig, fit_draft_temperatures

    # one training sequence is sampled too (the split's cache holds both), then left unused
    cfg = EagleTrainConfig(target=Path(args.target), out=out, work_dir=work, sentences=sentences, sequences=1,
                           heldout=args.heldout, temperature=args.temperature, max_tokens=args.max_tokens,
                           seed=args.seed, sample_batch=args.sample_batch, block=block, intermediate_size=width,
                           feature_layers=layers)
    summary = fit_draft_temperatures(cfg, eagle, progress=lab.ProgressBar("sequences", "seq"))
    print_report(summary, "pcgtts train eagle-temperatures")
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
                  "top_k": args.top_k}, "pcgtts train transitions")
    return 0
