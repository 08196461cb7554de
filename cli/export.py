"""`pcgtts export onnx | codec | tensorrt`: compile models for the onnxruntime / tensorrt backends.

Every export checks itself numerically against the model it came from and prints the figure
(a human line on stderr, JSON on stdout); a mismatch beyond tolerance fails the command.
"""

from __future__ import annotations

import argparse
import json
import sys

from pcgtts.cli import flags
from pcgtts.cli.flags import deprecated_alias
from pcgtts.runtime.config import QUANTIZE


def register(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser("export", help="export models to ONNX / TensorRT").add_subparsers(
        dest="export_cmd", required=True)

    onnx = export.add_parser("onnx", help="LLaSA-format LM (target or draft) -> one ONNX step graph with KV-cache I/O")
    onnx.add_argument("--model", required=True, help="LlamaForCausalLM checkpoint directory")
    onnx.add_argument("--out", required=True, help="output directory")
    onnx.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    onnx.add_argument("--quantize", default="none", choices=QUANTIZE,
                      help="int8: replace the checked float32 graph by a weight-only int8 one "
                           "(1.5-1.9x faster on a CPU: BENCHMARKS.md; quality cost in QUALITY.md)")
    onnx.add_argument("--max-length", type=flags.setting(int, "max_length"), default=4096,
                      help="default KV cache capacity for the runtime (at least 64)")
    onnx.add_argument("--no-check", action="store_true", help="skip the numeric comparison with PyTorch")
    onnx.add_argument("--eagle", help="the target's EAGLE draft, exported with it for the eagle-* policies "
                                      "(default: eagle_draft.safetensors beside the model, if there)")
    onnx.add_argument("--no-eagle", action="store_true", help="do not export the EAGLE draft found beside the model")
    onnx.add_argument("--heads", help="the target's multi-token heads, exported with it for the mtp-* policies "
                                      "(default: mtp_heads.safetensors beside the model, if there)")
    onnx.add_argument("--no-heads", action="store_true", help="do not export the heads found beside the model")
    onnx.set_defaults(func=_onnx)

    codec = export.add_parser("codec", help="X-codec2 decoder (codes -> waveform) -> ONNX")
    codec.add_argument("--codec", required=True, help="X-codec2 directory (Hugging Face format)")
    codec.add_argument("--out", required=True, help="output directory")
    codec.add_argument("--no-check", action="store_true", help="skip the numeric comparison with PyTorch")
    codec.set_defaults(func=_codec)

    trt = export.add_parser("tensorrt", help="ONNX step graph -> TensorRT engine (NVIDIA GPU + TensorRT)")
    trt.add_argument("--onnx", required=True, help="directory written by `pcgtts export onnx`")
    trt.add_argument("--out", required=True, help="output directory")
    trt.add_argument("--precision", default="fp16", choices=("fp16", "bf16", "fp32"))
    trt.add_argument("--draft-length", type=flags.draft_length, default=3,
                     help="draft tokens per step the engine is tuned for, 1 to 16")
    deprecated_alias(trt, "--lookahead", "draft_length", "--draft-length", type=flags.draft_length)
    trt.add_argument("--max-length", type=flags.setting(int, "max_length"), default=2048,
                     help="fixed KV cache capacity of the engine (at least 64)")
    trt.add_argument("--no-check", action="store_true", help="skip the comparison with the ONNX graph")
    trt.set_defaults(func=_tensorrt)


def _check_paths(source: str, out: str) -> None:
    from pathlib import Path

    from pcgtts.runtime.files import check_output_dir

    if not Path(source).is_dir():
        raise ValueError(f"{source}: directory not found")
    check_output_dir(out)


def _report(record: dict, line: str) -> None:
    print(line, file=sys.stderr)
    print(json.dumps(record))


def _onnx(args) -> int:
    from pcgtts.export.onnx_lm import export_lm
    from pcgtts.runtime.config import ModelPaths
    from pcgtts.runtime.loading import proposer_files

    heads, _, eagle = proposer_files(ModelPaths(target=args.model))  # those beside the checkpoint
    beside = {"eagle": eagle, "heads": heads}
    found = {}
    for name in ("eagle", "heads"):
        given, skip = getattr(args, name), getattr(args, f"no_{name}")
        if given and skip:
            raise ValueError(f"give --{name} or --no-{name}, not both")
        found[name] = given if given is not None or skip else beside[name]
    _check_paths(args.model, args.out)

    meta, check = export_lm(args.model, args.out, dtype=args.dtype, max_length=args.max_length,
                            check=not args.no_check, quantize=args.quantize, **found)
    diff = "not checked" if check is None else f"max |logit diff| vs PyTorch {check.max_abs_diff:.2e} " \
                                               f"(tolerance {check.tolerance:.0e})"
    checks = {}
    for name, what in (("eagle", "EAGLE draft"), ("heads", "multi-token heads")):
        record = meta.extra.get(name)
        if record is not None:
            checks[name] = record.get("check")
            diff += f"; {what} {record['source']}: " + (
                "not checked" if checks[name] is None else f"max |diff| {checks[name]['max_abs_diff']:.2e}")
    if "int8" in meta.extra:
        diff += f"; int8 graph: max |logit diff| {meta.extra['int8']['max_abs_diff']:.2e} (recorded)"
    _report({"out": args.out, "layers": meta.num_layers, "check": meta.extra.get("check"),
             "quantize": meta.extra.get("quantize", "none"), "int8": meta.extra.get("int8"), **checks},
            f"exported {args.model} -> {args.out}: {meta.num_layers} layers, {diff}")
    return 0


def _codec(args) -> int:
    _check_paths(args.codec, args.out)
    from pcgtts.export.codec_graph import export_codec

    meta = export_codec(args.codec, args.out, check=not args.no_check)
    check = meta.get("check")
    diff = "not checked" if check is None else f"max |sample diff| vs PyTorch {check['max_abs_diff']:.2e}"
    _report({"out": args.out, "check": check}, f"exported codec decoder {args.codec} -> {args.out}: {diff}")
    return 0


def _tensorrt(args) -> int:
    _check_paths(args.onnx, args.out)
    from pcgtts.export.onnx_common import staged_output
    from pcgtts.export.tensorrt import build_engine, check_engine_against_onnx

    with staged_output(args.out) as stage:  # an engine that fails its check is never published
        meta = build_engine(args.onnx, stage, precision=args.precision, draft_length=args.draft_length,
                            max_length=args.max_length)
        diff = None if args.no_check else check_engine_against_onnx(args.onnx, stage)
    _report({"out": args.out, "built_for": meta.extra["built_for"], "max_abs_diff": diff},
            f"built TensorRT engine {args.out} ({args.precision}) for {meta.extra['built_for']['gpu']}; "
            + ("not checked" if diff is None else f"max |logit diff| vs ONNX {diff:.2e}"))
    return 0
