"""Sub-commands of the runtime: `models demo`, `draft init`, `speak`.

Handlers import the heavy machinery lazily so `pcgtts --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import sys

from pcgtts.runtime.config import POLICIES


def register(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser("models", help="built-in demo models").add_subparsers(dest="models_cmd", required=True)
    demo = models.add_parser("demo", help="write the demo target, draft and codec (random weights, not speech)")
    demo.add_argument("--out", required=True, help="output directory")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_models_demo)

    draft = sub.add_parser("draft", help="draft models").add_subparsers(dest="draft_cmd", required=True)
    init = draft.add_parser("init", help="make a draft from a subset of the target's layers")
    init.add_argument("--target", required=True, help="target checkpoint directory")
    init.add_argument("--layers", required=True, help="a count (spread over the depth) or indices like 0,7,15")
    init.add_argument("--out", required=True)
    init.set_defaults(func=_draft_init)

    speak = sub.add_parser("speak", help="synthesise text and play it in real time (or write a WAV)")
    speak.add_argument("text")
    voice = speak.add_mutually_exclusive_group()
    voice.add_argument("--voice", help="a voice file made by `pcgtts voice add`")
    voice.add_argument("--ref-audio", help="reference recording to clone (needs --ref-text)")
    speak.add_argument("--ref-text", help="transcript of --ref-audio")
    add_model_args(speak)
    speak.add_argument("--out", help="write a WAV file instead of playing")
    speak.add_argument("--device", help="playback device name or index; 'null' discards the audio")
    speak.add_argument("--seed", type=int)
    speak.add_argument("--temperature", type=float, default=0.8)
    speak.add_argument("--max-tokens", type=int, default=2000, help="speech tokens per sentence at most (50 per s)")
    speak.set_defaults(func=_speak)

    from pcgtts.runtime import cli_bench, cli_voice

    cli_voice.register(sub)
    cli_bench.register(sub)


def add_model_args(parser: argparse.ArgumentParser, policy: bool = True) -> None:
    """Model selection shared by `speak` and `bench`; no model given -> the demo models."""
    parser.add_argument("--target", help="target LLaSA checkpoint directory (default: built-in demo)")
    parser.add_argument("--draft", help="draft checkpoint directory")
    parser.add_argument("--codec", help="X-codec2 directory (Hugging Face format)")
    parser.add_argument("--groups", help="group table (.pcg) for policy pcg")
    if policy:
        parser.add_argument("--policy", choices=POLICIES, default="pcg")
    parser.add_argument("--backend", choices=("torch", "onnxruntime", "tensorrt"), default="torch")
    parser.add_argument("--compute-device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")


def resolve_models(args: argparse.Namespace, quiet: bool = False) -> dict:
    """Paths of the models to load, falling back to the demo (with a notice on stderr)."""
    if args.target:
        return {"target": args.target, "draft": args.draft, "codec": args.codec, "groups": args.groups}
    from pcgtts.runtime.demo import NOT_SPEECH_NOTICE, ensure_demo

    if not quiet:
        print(f"note: no --target given, using the built-in demo models; {NOT_SPEECH_NOTICE}", file=sys.stderr)
    paths = ensure_demo()
    return {k: str(v) for k, v in paths.items()}


def load_synthesizer(args: argparse.Namespace, **config_overrides):
    from dataclasses import replace

    from pcgtts.runtime.config import DecodeConfig, SamplingConfig
    from pcgtts.runtime.synthesizer import SynthesisConfig, Synthesizer

    models = resolve_models(args)
    sampling = SamplingConfig(temperature=getattr(args, "temperature", 0.8))
    config = SynthesisConfig(decode=DecodeConfig(sampling=sampling, max_new_tokens=getattr(args, "max_tokens", 2000)),
                             seed=getattr(args, "seed", None))
    config = replace(config, **config_overrides)
    return Synthesizer.from_pretrained(models["target"], models["draft"], models["codec"],
                                       models["groups"] if args.policy == "pcg" else None,
                                       policy=args.policy, device=args.compute_device, dtype=args.dtype,
                                       backend=args.backend, config=config)


def _models_demo(args) -> int:
    from pcgtts.runtime.demo import NOT_SPEECH_NOTICE, write_demo

    paths = write_demo(args.out, seed=args.seed)
    print(f"demo models written ({NOT_SPEECH_NOTICE}):")
    for name, path in paths.items():
        print(f"  {name:7s} {path}")
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0


def _draft_init(args) -> int:
    from pcgtts.runtime.draft import make_layer_subset_draft

    spec = args.layers.strip()
    layers = [int(x) for x in spec.split(",")] if "," in spec else int(spec)
    out = make_layer_subset_draft(args.target, args.out, layers)
    print(json.dumps({"draft": str(out), "layers": json.loads((out / "config.json").read_text())["pcgtts_draft"]["layers"]}))
    return 0


def _speak(args) -> int:
    from pcgtts.runtime.playback import open_sink

    synth = load_synthesizer(args)
    sink = open_sink(args.device, out_path=args.out)
    stream = synth.stream(args.text, ref_audio=args.ref_audio, ref_text=args.ref_text, voice=args.voice)
    try:
        with sink:
            for chunk in stream:
                sink.write(chunk)
    finally:
        stream.close()
    report = speak_report(stream.stats, sink.stats())
    print_report(report)
    return 0


def speak_report(stats, playback) -> dict:
    totals = stats.totals()
    return {
        "time_to_first_audio_s": stats.time_to_first_audio,
        "real_time_factor": stats.real_time_factor,
        "audio_s": stats.audio_seconds,
        "tokens": totals.emitted,
        "acceptance_rate": totals.acceptance_rate,
        "mean_accepted_length": totals.mean_accepted_length,
        "target_forwards_per_token": totals.target_forwards / max(totals.emitted, 1),
        "underruns": playback.underruns,
        "underrun_s": playback.underrun_seconds,
        "truncated_sentences": stats.truncated,
        "cancelled": stats.cancelled,
    }


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="pcgtts speak")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in report.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    Console(stderr=True).print(table)
    print(json.dumps(report))
