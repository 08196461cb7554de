"""`pcgtts prepare`: make a voice's models ready once, in resumable stages, into one folder that
`--prepared DIR` (or `Synthesizer.from_pretrained(prepared=DIR)`) loads. With no --checkpoint: the
built-in voice, into the cache folder its first use reads (or --out)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pcgtts.cli.flags import non_negative_int, positive


def _layers(text: str) -> int | list[int]:
    """--draft-layers: a count ("4") or indices ("0,5,11")."""
    try:
        return [int(x) for x in text.split(",") if x.strip()] if "," in text else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a layer count or comma list of layer indices, got {text!r}") from None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="make models ready once (checkpoints, group table, draft, onnxruntime "
                                       "exports) into a folder --prepared loads; resumable, skips what is done")
    p.add_argument("--checkpoint", help="a LLaSA-format checkpoint folder (Hugging Face LlamaForCausalLM + tokenizer) "
                                        "to prepare (default: the built-in voice)")
    p.add_argument("--codec", help="its X-codec2 folder, Hugging Face format (needs --checkpoint)")
    p.add_argument("--clone-codec", help="an X-codec2 folder with --codec's encoder and another decoder, which "
                                         "renders voices with a reference (presets, cloned voices; needs --checkpoint)")
    p.add_argument("--clone-target", help="a LLaSA-format checkpoint with --checkpoint's tokenizer, a model that follows "
                                          "voice prompts, which speaks voices with a reference (needs --checkpoint)")
    p.add_argument("--out", help="the prepared folder (needed with --checkpoint; default for the built-in voice: "
                                 "the cache folder it is loaded from)")
    p.add_argument("--group-size", type=positive(float),
                   help="mean size of the target's acoustic groups, θ chosen for it (default 48; needs --checkpoint)")
    p.add_argument("--draft-layers", type=_layers,
                   help="the draft's layers: a count spread over the target's depth, or indices like 0,7,15 "
                        "(default: a quarter of them; needs --checkpoint)")
    p.add_argument("--eagle-steps", type=non_negative_int,
                   help="train an EAGLE draft for the target this many steps (default 0: none; needs --checkpoint)")
    p.add_argument("--no-onnx", action="store_true",
                   help="skip the onnxruntime exports (int8 LM graphs and the codec decoder)")
    p.set_defaults(func=_prepare)


def _prepare(args) -> int:
    from pcgtts.cli.interrupt import Interrupted, stop_on_signals

    try:
        with stop_on_signals():
            out, report = _run(args)
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: the stages done are kept; the next run resumes
        print("pcgtts: interrupted; run again to resume", file=sys.stderr)
        return stop.exit_code if isinstance(stop, Interrupted) else 130
    for stage, what in report.items():
        print(f"pcgtts: {stage}: {'already done, skipped' if what == 'skipped' else 'done'}", file=sys.stderr)
    print(json.dumps({"prepared": str(out), "stages": report}))
    return 0


def _run(args) -> tuple[Path, dict[str, str]]:
    """(the prepared folder, {stage: "made" or "skipped"}), every flag checked before any work."""
    from pcgtts.runtime.files import check_output_dir

    if args.checkpoint is None:
        given = [flag for flag, value in (("--codec", args.codec), ("--clone-codec", args.clone_codec),
                                          ("--clone-target", args.clone_target),
                                          ("--group-size", args.group_size),
                                          ("--draft-layers", args.draft_layers), ("--eagle-steps", args.eagle_steps))
                 if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need --checkpoint (the built-in voice has its own)")
        from pcgtts.builtin import VOICE_DIR, voice_cache
        from pcgtts.tools.prepare import prepare_builtin

        if not (VOICE_DIR / "voice.json").is_file():
            raise ValueError("no trained voice ships with this install; give --checkpoint and --codec to "
                             "prepare a checkpoint of your own")
        out = Path(args.out) if args.out else voice_cache()
        if not args.out:
            out.parent.mkdir(parents=True, exist_ok=True)  # the cache folder, made as its first use would
        check_output_dir(out)
        report = prepare_builtin(out, VOICE_DIR, onnx=not args.no_onnx)
    else:
        if args.codec is None or args.out is None:
            raise ValueError("--checkpoint needs --codec and --out")
        from pcgtts.tools.prepare import DEFAULT_GROUP_SIZE, CheckpointPreparation, check_checkpoint, prepare_checkpoint

        check_output_dir(args.out)
        prep = CheckpointPreparation(Path(args.checkpoint), Path(args.codec),
                                     group_size=args.group_size if args.group_size is not None else DEFAULT_GROUP_SIZE,
                                     draft_layers=args.draft_layers, eagle_steps=args.eagle_steps or 0,
                                     onnx=not args.no_onnx,
                                     clone_codec=Path(args.clone_codec) if args.clone_codec is not None else None,
                                     clone_target=Path(args.clone_target) if args.clone_target is not None else None)
        check_checkpoint(prep)  # a one-line error before any work
        out = Path(args.out)
        report = prepare_checkpoint(prep, out)
    return out, report
