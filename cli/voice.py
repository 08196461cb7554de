"""`pcgtts voice add`: encode a reference recording once into a small voice file;
`pcgtts voices`: the preset voices a model ships with (the built-in voice's by default)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    voice = sub.add_parser("voice", help="voices for cloning").add_subparsers(dest="voice_cmd", required=True)
    add = voice.add_parser("add", help="encode a recording and its transcript into a voice file")
    add.add_argument("wav", help="reference recording (any format soundfile reads)")
    add.add_argument("--text", required=True, help="transcript of the recording")
    add.add_argument("--codec", help="X-codec2 directory (default: the built-in voice's codec)")
    add.add_argument("--out", required=True, help="voice file to write")
    add.set_defaults(func=_add)

    listing = sub.add_parser("voices", help="list the preset voices (`speak --voice NAME`)")
    listing.add_argument("--target", help="target checkpoint directory whose presets to list (default: the "
                                          "built-in voice)")
    listing.add_argument("--presets", help="a folder of preset voices (voices.json + .voice files)")
    listing.add_argument("--json", action="store_true", help="print only a JSON list of {name, ...} objects")
    listing.set_defaults(func=_list)


def _list(args) -> int:
    from pcgtts.builtin import named_presets
    from pcgtts.quality.stats import format_table
    from pcgtts.runtime.config import ModelPaths

    if args.target is not None and not Path(args.target).is_dir():
        raise ValueError(f"--target {args.target}: directory not found")
    if args.presets is not None and not Path(args.presets).is_dir():
        raise ValueError(f"--presets {args.presets}: directory not found")
    presets = named_presets(ModelPaths(target=args.target, presets=args.presets))
    rows = presets.listing()
    if args.json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print("this model has no preset voices (give a voice file, or --ref-audio and --ref-text)")
        return 0
    aliases: dict[str, list[str]] = {}
    for row in rows:
        if "alias_of" in row:
            aliases.setdefault(row["alias_of"], []).append(row["name"])
    table = [[row["name"] + (" (default)" if row["default"] else ""),
              f"{row['seconds']:.1f}" if "seconds" in row else "-", _made(row.get("transform")),
              ", ".join(aliases.get(row["name"], [])), row["description"]] for row in rows if "alias_of" not in row]
    print(format_table(["voice", "reference s", "transform", "aliases", "description"], table))
    print(json.dumps(rows))
    return 0


def _made(transform: dict | None) -> str:
    """A preset's transform in a table cell: "formant x0.90, pitch x0.80", or "-"."""
    return f"formant x{transform['formant']:.2f}, pitch x{transform['pitch']:.2f}" if transform else "-"


def _add(args) -> int:
    from pcgtts.runtime.audio.codec import Codec
    from pcgtts.runtime.audio.voice import Voice

    from pcgtts.runtime.audio.io import load_audio
    from pcgtts.runtime.files import check_output_file
    from pcgtts.runtime.text.prompt import check_text

    check_text(args.text)
    load_audio(args.wav)  # readable, long enough, not silent: before the codec loads
    check_output_file(args.out)
    if args.codec is not None and not Path(args.codec).is_dir():
        raise ValueError(f"--codec {args.codec}: directory not found")
    codec_dir = args.codec
    if codec_dir is None:
        from pcgtts.builtin import builtin_models

        codec_dir = builtin_models().codec
    voice = Voice.from_audio(args.wav, args.text, Codec.from_pretrained(codec_dir, decode_only=False))
    path = voice.save(args.out)
    print(f"voice written to {path}: {len(voice.codes)} tokens ({len(voice.codes) / 50:.2f} s)")
    print(json.dumps({"voice": str(path), "tokens": int(len(voice.codes)), "text": voice.text}))
    return 0
