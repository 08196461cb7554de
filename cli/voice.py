"""`pcgtts voice add`: encode a reference recording once into a small voice file."""

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
