"""Sub-commands of the runtime: `models demo`, `models scale`, `speak`.

Handlers import the heavy machinery lazily so `pcgtts --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pcgtts.cli import flags
from pcgtts.cli.flags import deprecated_alias
from pcgtts.runtime.audio.chunk import SAMPLE_RATE
from pcgtts.runtime.config import (BACKENDS, DRAFT_LENGTH_POLICIES, DTYPES, EAGLE_POLICIES, MTP_POLICIES, PCG_POLICIES,
                                   POLICIES, QUANTIZE, check_compute_device)
from pcgtts.runtime.decode.policy import Proposer, names


def register(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser("models", help="built-in demo models").add_subparsers(dest="models_cmd", required=True)
    demo = models.add_parser("demo", help="write the demo target, draft and codec (random weights, not speech)")
    demo.add_argument("--out", required=True, help="output directory")
    demo.add_argument("--seed", type=flags.seed, default=0)
    demo.set_defaults(func=_models_demo)
    scale = models.add_parser("scale", help="the built-in voice computed at a LLaSA shape's cost, logits unchanged "
                                            "(a stand-in for released weights)")
    scale.add_argument("--from", dest="source", default="builtin",
                       help="builtin (default) or a voice folder (voice.json, or one expanded with target/ draft/ codec/)")
    scale.add_argument("--shape", required=True, help="llasa-1b, llasa-3b, llasa-8b or custom (then every size "
                       "flag); the memory and disk it needs are estimated and checked before any work")
    for name in ("hidden", "layers", "heads", "kv-heads", "head-dim", "ffn"):
        scale.add_argument(f"--{name}", type=int, help=f"custom shape: {name.replace('-', ' ')}"
                           + (" (default: hidden / heads)" if name == "head-dim" else ""))
    scale.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights' dtype (default float32)")
    scale.add_argument("--seed", type=flags.seed, default=0, help="seed of the weights that carry no function")
    scale.add_argument("--out", required=True, help="a new folder: target/ (with its EAGLE draft), draft/, "
                                                    "draft-subset/, codec/, groups.pcg")
    scale.set_defaults(func=_models_scale)

    speak = sub.add_parser("speak", help="synthesise text and play it in real time (or write an audio file)")
    speak.add_argument("text", nargs="?", help="the text to speak; - reads it from standard input")
    speak.add_argument("--text-file", help="read the text to speak from this UTF-8 file (instead of the argument)")
    voice = speak.add_mutually_exclusive_group()
    voice.add_argument("--voice", help="a preset voice's name (`pcgtts voices` lists them), default (the model's own "
                                       "voice) or a voice file made by `pcgtts voice add`")
    voice.add_argument("--ref-audio", help="reference recording to clone (needs --ref-text)")
    speak.add_argument("--ref-text", help="transcript of --ref-audio")
    add_model_args(speak)
    speak.add_argument("--out", help="write an audio file instead of playing: .wav, .flac, .ogg (Vorbis) or .mp3, "
                                     "the format its suffix names")
    speak.add_argument("--audio-device", help="playback device name or index; 'null' discards the audio")
    deprecated_alias(speak, "--device", "audio_device", "--audio-device")
    speak.add_argument("--seed", type=flags.seed, help="seed of the sampling, 0 to 2**63-1 (default: a fresh one)")
    speak.add_argument("--draft-length", type=flags.draft_length, help="draft proposals per step, 1 to 16 (default 3)")
    speak.add_argument("--adaptive-draft", action=argparse.BooleanOptionalAction, default=None,
                       help="choose the draft length per step from measured costs (up to --draft-length), and "
                            "decode without the draft when speculation cannot win (default on; --no-adaptive-draft: "
                            "always --draft-length, for output that repeats across processes with --seed)")
    speak.add_argument("--temperature", type=flags.temperature,
                       help="sampling temperature, 0 to 10 (default 0.8, or the built-in voice's own; 0 = greedy)")
    speak.add_argument("--top-p", type=flags.top_p,
                       help="nucleus sampling: keep the most likely tokens holding this much mass, in (0, 1] "
                            "(default 1: all of them)")
    speak.add_argument("--max-tokens", type=flags.max_tokens,
                       help="speech tokens per sentence at most, 1 to 60000 (50 per s; default 2000)")
    speak.set_defaults(func=_speak)


def add_model_args(parser: argparse.ArgumentParser, policy: bool = True) -> None:
    """Model and device selection shared by `speak`, `bench`, `eval` and `serve`. Defaults are None
    so that a --config file's values stand unless a flag is given (see `resolve_cli_settings`)."""
    parser.add_argument("--config", help="TOML settings file (runtime/config.py names); flags override it")
    parser.add_argument("--target", help="target LLaSA checkpoint directory (default: the built-in voice)")
    parser.add_argument("--prepared", help="a folder `pcgtts prepare` made: its models (instead of --target, --draft, ...)")
    parser.add_argument("--draft", help="draft checkpoint directory (needs --target)")
    parser.add_argument("--codec", help="X-codec2 directory, Hugging Face format (needs --target)")
    parser.add_argument("--clone-codec", help="X-codec2 directory (or its exported decoder) that decodes speech in a "
                                              "voice with a reference: presets, cloned voices, --ref-audio; same "
                                              "encoder as --codec (default: --codec decodes every voice)")
    parser.add_argument("--clone-target", help="LLaSA checkpoint directory (or its export) that speaks voices with a "
                                               "reference: presets, cloned voices, --ref-audio; loaded on first use; "
                                               "same tokenizer as --target (default: --target speaks every voice)")
    parser.add_argument("--groups", help="group table (.pcg) for policy pcg (needs --target)")
    parser.add_argument("--heads", help="multi-token heads for the mtp-* policies (default: <target>/mtp_heads.safetensors)")
    parser.add_argument("--transitions", help="code transitions (.pct) for mtp-viterbi (default: <target>/transitions.pct)")
    parser.add_argument("--eagle", help="EAGLE draft for the eagle-* policies (default: <target>/eagle_draft.safetensors)")
    parser.add_argument("--presets", help="folder of preset voices, voices.json + .voice files (default: <target>/voices; "
                                          "the built-in voice's own)")
    if policy:
        parser.add_argument("--policy", choices=POLICIES, help="decoding rule (default: pcg)")
    parser.add_argument("--backend", choices=BACKENDS,
                        help="auto (default: onnxruntime for an exported --target, torch for a checkpoint; the "
                             "built-in voice on a CPU runs on onnxruntime, int8), torch, onnxruntime or tensorrt")
    parser.add_argument("--compute-device", help="cpu (default), cuda or cuda:N")
    parser.add_argument("--dtype", choices=DTYPES, help="float32 (default), bfloat16 or float16")
    parser.add_argument("--quantize", choices=QUANTIZE,
                        help="int8: int8 linear layers for the LM (torch backend, CPU); default none")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="the LM's steps through torch.compile (torch backend, CPU, float32; needs a C++ "
                             "compiler; about a minute per model at load the first time, less from the cache)")
    parser.add_argument("--threads", type=flags.cpu_threads(), help="CPU threads per stage (LM, codec); default: half the cores "
                                                     "with the codec on its own thread, unless OMP_NUM_THREADS is set")


def resolve_cli_settings(args: argparse.Namespace, **overrides):
    """The settings in force for a command: flags > --config file > defaults; the built-in voice
    when no --target is given. One resolution per command (so every notice appears once)."""
    from pcgtts.builtin import with_builtin_models

    return with_builtin_models(resolve_settings_from_flags(args, **overrides))


def _explicit(args: argparse.Namespace, overrides: dict) -> dict:
    names = ("target", "prepared", "draft", "codec", "clone_codec", "clone_target", "groups", "heads", "transitions", "eagle", "presets", "policy", "backend", "compute_device", "dtype", "quantize", "compile", "threads",
             "temperature", "top_p", "seed", "adaptive_draft")
    explicit = {name: getattr(args, name, None) for name in names}
    explicit["max_new_tokens"] = getattr(args, "max_tokens", None)
    if isinstance(getattr(args, "draft_length", None), int):  # bench's --draft-length is a sweep list
        explicit["draft_length"] = args.draft_length
    explicit.update(overrides)
    return explicit


def load_synthesizer(args: argparse.Namespace, **overrides):
    """(Synthesizer, Settings) for a command's flags; the built-in voice knows the scripts it reads."""
    from pcgtts.builtin import with_builtin_models
    from pcgtts.front import Synthesizer
    from pcgtts.runtime.checks import voice_scripts

    named = resolve_settings_from_flags(args, **overrides)
    settings = with_builtin_models(named)
    return Synthesizer.load(settings.models, settings.device, settings.synthesis,
                            scripts=voice_scripts(named.models.target)), settings


def _models_scale(args) -> int:
    from pcgtts.tools.scale import STANDIN_NOTICE, scale_voice, shape_from_flags

    custom = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn")}
    shape = shape_from_flags(args.shape, custom)
    # scale_voice refuses an existing --out, a missing parent folder, and a shape too large for the
    # memory or the disk before it reads the voice
    source = args.source
    if source == "builtin":  # its committed folder, expanded by scale_voice once the shape is checked
        from pcgtts.builtin import VOICE_DIR

        if not (VOICE_DIR / "voice.json").is_file():
            raise ValueError("this install has no trained built-in voice to scale (pcgtts/voice is empty)")
        source = str(VOICE_DIR)
    out = scale_voice(source, shape, Path(args.out), args.dtype, args.seed,
                      progress=lambda what: print(f"scaling: {what}", file=sys.stderr))
    print(f"scaled voice written to {out} ({STANDIN_NOTICE})")
    print(json.dumps({name: str(out / name) for name in ("target", "draft", "draft-subset", "codec", "groups.pcg")}))
    return 0


def _models_demo(args) -> int:
    from pcgtts.runtime.files import check_output_dir
    from pcgtts.tools.demo import NOT_SPEECH_NOTICE, write_demo

    check_output_dir(args.out)
    paths = write_demo(args.out, seed=args.seed)
    print(f"demo models written ({NOT_SPEECH_NOTICE}):")
    for name, path in paths.items():
        print(f"  {name:7s} {path}")
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0


def _speak(args) -> int:
    from pcgtts.cli.interrupt import Interrupted, stop_on_signals
    from pcgtts.runtime.audio.playback import open_sink

    args.text = speak_text(args)
    check_speak_args(args)  # everything checkable is checked before a model loads
    sink = None
    try:
        with stop_on_signals():
            synth, _ = load_synthesizer(args)
            sink = open_sink(args.audio_device, out_path=args.out)
            stream = synth.stream(args.text, ref_audio=args.ref_audio, ref_text=args.ref_text, voice=args.voice)
            with sink, stream:  # the stream stops first, then the sink ends: complete, kept partial, or discarded
                for chunk in stream:
                    sink.write(chunk)
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: what was made is kept, said in one line
        print(f"pcgtts: interrupted; {_what_was_kept(sink, args.out)}", file=sys.stderr)
        return stop.exit_code if isinstance(stop, Interrupted) else 130
    report = speak_report(stream.stats, sink.stats())
    print_report(report, json_line=not _is_stdout(args.out))  # the audio went to stdout: keep it clean
    return 0


def _is_stdout(out: str | None) -> bool:
    """Whether --out names this process's standard output (`/dev/stdout`, `/dev/fd/1`)."""
    if out is None:
        return False
    try:
        a, b = os.stat(out), os.fstat(sys.stdout.fileno())
    except (OSError, ValueError):
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _what_was_kept(sink, out: str | None) -> str:
    """The interrupted run's output, in words."""
    if out is None:
        return "playback stopped"
    untouched = f"; {out} is as it was" if Path(out).exists() else ""
    kept = getattr(sink, "kept", None)
    if kept is None:
        return "no audio was made yet" + (untouched or f"; {out} was not written")
    if kept == Path(out):  # the signal came as the finished file was moved into place
        return f"{out} was already complete"
    seconds = sink.stats().samples_written / SAMPLE_RATE
    return f"kept the {seconds:.1f} s made so far in {kept}{untouched}"


def speak_text(args) -> str:
    """The text `speak` was given: the argument, standard input (`-`) or --text-file; one line of error
    for none, both, or a file that cannot be read as text."""
    if (args.text is None) == (args.text_file is None):
        raise ValueError("give the text to speak as an argument (- reads standard input) or with --text-file, "
                         "one of them")
    if args.text == "-":
        return sys.stdin.read()
    if args.text is not None:
        return args.text
    path = Path(args.text_file)
    if path.is_dir():
        raise ValueError(f"--text-file {path} is a directory")
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"--text-file {path}: file not found") from None
    except UnicodeDecodeError:
        raise ValueError(f"--text-file {path}: not UTF-8 text") from None
    except OSError as err:
        raise ValueError(f"--text-file {path}: cannot read it ({err.strerror or err})") from None


def check_speak_args(args) -> None:
    """One-line errors for bad input, before any model is loaded or made."""
    from pcgtts.runtime.text.prompt import check_text

    check_text(args.text)
    if args.ref_text is not None and args.ref_audio is None:
        raise ValueError("--ref-text is the transcript of --ref-audio, which is missing")
    if args.ref_audio is not None:
        from pcgtts.runtime.audio.io import load_audio

        if not args.ref_text:
            raise ValueError("--ref-audio needs --ref-text: the transcript of the recording")
        check_text(args.ref_text)
        load_audio(args.ref_audio)  # readable, long enough, not silent
    if args.voice is not None:
        check_voice_arg(args.voice, resolve_settings_from_flags(args).models)
    if args.out is not None:
        if args.audio_device is not None:
            raise ValueError("give either --out (write a file) or --audio-device (play), not both")
        from pcgtts.runtime.audio.playback import check_output

        check_output(args.out)  # a file whose suffix names a format this machine writes, a device or a FIFO
    else:
        from pcgtts.runtime.audio.playback import check_output_device

        check_output_device(args.audio_device)
    settings = resolve_settings_from_flags(args)
    check_flags_apply(args, settings.synthesis.decode.policy)
    check_compute_device(settings.device.compute_device)


def check_voice_arg(voice: str, models) -> None:
    """--voice: `default` (the model's own voice), an existing path (a voice file, read and checked), or
    else a preset's name of the models `models` name (the built-in voice's without a target); a
    one-line error otherwise (an empty name, a folder, a recording: that is --ref-audio's)."""
    from pcgtts.builtin import named_presets

    named_presets(models).find(voice, "use --ref-audio and --ref-text to clone from a recording")


# The flags that only some policies read: (argparse dest, the policies that read it).
POLICY_FLAGS = {
    "--draft": ("draft", names(lambda p: p.needs_draft)),
    "--groups": ("groups", PCG_POLICIES),
    "--heads": ("heads", MTP_POLICIES),
    "--transitions": ("transitions", names(lambda p: p.proposer is Proposer.VITERBI)),
    "--eagle": ("eagle", EAGLE_POLICIES),
    "--draft-length": ("draft_length", DRAFT_LENGTH_POLICIES),
    "--adaptive-draft / --no-adaptive-draft": ("adaptive_draft", DRAFT_LENGTH_POLICIES),
}


def check_flags_apply(args, policy: str) -> None:
    """A one-line error for a flag given on the command line that `policy` would ignore."""
    for flag, (dest, readers) in POLICY_FLAGS.items():
        if getattr(args, dest, None) is not None and policy not in readers:
            raise ValueError(f"{flag} is not used by policy {policy!r}: leave it out, or choose a policy that "
                             f"uses it ({', '.join(readers)})")


def resolve_settings_from_flags(args, **overrides):
    """The flags' settings without filling in the built-in voice (cheap: validates names and values)."""
    from pcgtts.builtin import voice_settings
    from pcgtts.runtime.config import resolve_settings

    return resolve_settings(_explicit(args, overrides), getattr(args, "config", None), voice=voice_settings())


PLAIN_DECODING = "— (plain decoding)"  # the table's acceptance when nothing was proposed


def speak_report(stats, playback) -> dict:
    """A speak run's figures; acceptance_rate None when nothing was proposed (the route decoded plainly)."""
    totals = stats.totals()
    return {
        "time_to_first_audio_s": stats.time_to_first_audio,
        "real_time_factor": stats.real_time_factor,
        "audio_s": stats.audio_seconds,
        "tokens": totals.emitted,
        "acceptance_rate": totals.acceptance_rate if totals.drafted else None,
        "mean_accepted_length": totals.mean_accepted_length,
        "target_forwards_per_token": totals.target_forwards / max(totals.emitted, 1),
        "underruns": playback.underruns,
        "underrun_s": playback.underrun_seconds,
        "truncated_sentences": stats.truncated,
        "cancelled": stats.cancelled,
    }


def read_code_sequences(paths) -> list:
    """Speech code sequences from .npz (one array per entry, e.g. the lab's codes.npz) or .npy
    files, each flattened to 1-D; empty arrays are left out."""
    import numpy as np

    sequences = []
    for path in paths:
        data = np.load(path, allow_pickle=False)
        arrays = [data[k] for k in data.files] if hasattr(data, "files") else [data]
        sequences += [np.asarray(a).reshape(-1) for a in arrays if np.asarray(a).size]
    return sequences


def print_report(report: dict, title: str = "pcgtts speak", json_line: bool = True) -> None:
    """A metric/value table on stderr, then (`json_line`) the same report as one JSON line on stdout."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in report.items():
        if value is None:
            shown = PLAIN_DECODING if key == "acceptance_rate" else "—"
        else:
            shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        table.add_row(key, shown)
    Console(stderr=True).print(table)
    if json_line:
        print(json.dumps(report))
