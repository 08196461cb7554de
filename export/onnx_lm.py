"""`pcgtts export onnx`: a LLaSA-format LM (target or draft) to one ONNX step graph.

    export_lm(model_dir, out_dir) writes out_dir/model.onnx (+ model.onnx.data for large
    weights), the tokenizer, and pcgtts-lm.json, then loads the graph with the onnxruntime
    backend and compares it with the torch backend (`check_lm`); a mismatch fails the export.

torch.onnx.export(dynamo=True) traces `export/lm_graph.py` with the token count and the cache
capacity dynamic, so one graph serves prefill, the 1-token draft step and the (L+1)-token
verify step, for any cache size the runtime allocates.

With `eagle=FILE` (the CLI finds `eagle_draft.safetensors` beside the model by default) the
target's EAGLE draft is exported too, as `eagle.onnx` (`export/proposer_graphs.py`), checked the same
way against the torch draft, and listed under "eagle" in pcgtts-lm.json. A draft that reads more of
the target's layers (EAGLE-3's features) makes the step graph return them with the last state
(`extra["taps"]`, `extra["state_size"]`) and leaves its fuse map beside the graphs (`eagle_fuse.npy`).
onnxruntime runs every node of a graph whatever outputs are asked for, so such an export also holds the
step without the taps (`model_plain.onnx`, `extra["plain_graph"]`): what plain decoding runs, the
tapped graph being loaded only once an eagle-* policy attaches the draft (`OrtLM.use_taps`).

With `quantize="int8"` the checked float32 step graph is then replaced by `model.int8.onnx`:
weight-only int8 (onnxruntime's MatMulNBits, block-wise scales; see `quantize_int8`). Its logits
differ from PyTorch's by far more than the float check allows, so that difference is recorded
(`extra["int8"]`), not enforced; what it costs in speech is measured by `pcgtts eval` (QUALITY.md).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pcgtts.export.lm_graph import StepGraph, io_names
from pcgtts.export.noise import held_back
from pcgtts.export.onnx_common import OPSET, copy_tokenizer, export_graph, staged_output
from pcgtts.runtime.lm.graph_meta import PENDING_CHECK, GraphMeta
from pcgtts.runtime.config import QUANTIZE
from pcgtts.runtime.lm.checkpoint import load_tokenizer, read_config, resolve_dtype
from pcgtts.runtime.lm.eagle import eagle_feature_layers
from pcgtts.runtime.text.vocab import SpeechVocab

log = logging.getLogger(__name__)

GRAPH_FILE = "model.onnx"
EAGLE_GRAPH_FILE = "eagle.onnx"
EAGLE_FUSE_FILE = "eagle_fuse.npy"  # a draft that reads several layers: its map from a target row to its input
HEADS_GRAPH_FILE = "mtp_heads.onnx"
INT8_GRAPH_FILE = "model.int8.onnx"
PLAIN_GRAPH_FILE = "model_plain.onnx"  # beside a tapped step graph: the same step without the taps


@dataclass(frozen=True)
class CheckResult:
    max_abs_diff: float
    tolerance: float
    steps: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance


def export_lm(model_dir: str | Path, out_dir: str | Path, *, dtype: str = "float32", max_length: int = 4096,
              check: bool = True, tolerance: float | None = None, eagle: str | Path | None = None,
              heads: str | Path | None = None, quantize: str = "none") -> tuple[GraphMeta, CheckResult | None]:
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, got {quantize!r}")
    if quantize == "int8" and dtype != "float32":
        raise ValueError("--quantize int8 quantizes a float32 graph; leave --dtype at float32")
    read_config(model_dir)  # a clear error for a folder that is not a LLaMA checkpoint
    for what, path in (("EAGLE draft", eagle), ("multi-token heads", heads)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{what} file not found: {path}")
    tokenizer = load_tokenizer(model_dir)
    vocab = SpeechVocab.from_tokenizer(tokenizer)
    torch_dtype = resolve_dtype(dtype)
    if torch_dtype == torch.bfloat16:
        raise ValueError("export in float32 or float16 (bfloat16 engines are built from a float32 graph)")
    taps = eagle_feature_layers(eagle) if eagle is not None else ()  # the states such a draft reads
    with held_back("export"), staged_output(out_dir) as stage:
        meta, result = _export_into(stage, model_dir, tokenizer, vocab, torch_dtype, max_length, check, tolerance,
                                    taps)
        if eagle is not None:
            meta = _export_eagle(stage, meta, model_dir, Path(eagle), torch_dtype, check, tolerance)
        if heads is not None:
            meta = _export_heads(stage, meta, model_dir, Path(heads), torch_dtype, check, tolerance)
        if quantize == "int8":
            meta = quantize_int8(stage, model_dir if check else None)
        if not check:
            meta = _recorded_unchecked(stage, meta)
    if result is not None:
        log.info("exported %s: max |logit diff| vs PyTorch %.2g (tolerance %.2g)", out_dir, result.max_abs_diff,
                 result.tolerance)
    return meta, result


def _recorded_unchecked(stage: Path, meta: GraphMeta) -> GraphMeta:
    """`meta` without a check recorded, saved: an export made without one says so where it is loaded."""
    meta = GraphMeta(**{**meta.__dict__, "extra": {k: v for k, v in meta.extra.items() if k != "check"}})
    meta.save(stage)
    return meta


def _export_into(stage: Path, model_dir: Path, tokenizer, vocab: SpeechVocab, torch_dtype: torch.dtype,
                 max_length: int, check: bool, tolerance: float | None,
                 taps: tuple[int, ...] = ()) -> tuple[GraphMeta, CheckResult | None]:
    from pcgtts.runtime.lm.torch_lm import TorchLM

    lm = TorchLM.load(model_dir, dtype=torch_dtype, max_length=16, tokenizer=tokenizer)
    model = lm.model
    args = model.args
    model.taps = taps  # last_hidden_state carries these layers too (an EAGLE draft that reads them)

    graph = StepGraph(model).eval()
    t, slots = 3, 8  # example sizes; both are exported as dynamic dimensions
    past = [torch.zeros(1, args.num_kv_heads, slots, args.head_dim, dtype=torch_dtype)
            for _ in range(2 * args.num_layers)]
    example = (torch.zeros(1, t, dtype=torch.long), torch.arange(t).view(1, -1), torch.arange(t).view(1, -1), *past)
    inputs, outputs = io_names(args.num_layers, scores=model.samples_digits)
    tokens, keep, cache = torch.export.Dim("tokens", min=1), torch.export.Dim("logits", min=1), torch.export.Dim("cache", min=2)
    # *past is one variadic argument: its shapes go in as one tuple.
    dynamic = ({1: tokens}, {1: tokens}, {1: keep}, tuple({2: cache} for _ in past))
    export_graph(graph, example, stage / GRAPH_FILE, inputs, outputs, dynamic)
    if taps:
        model.taps = ()
        export_graph(graph, example, stage / PLAIN_GRAPH_FILE, inputs, outputs, dynamic)

    copy_tokenizer(model_dir, stage)
    meta = GraphMeta(
        graph=GRAPH_FILE, kind="onnx", dtype=str(torch_dtype).removeprefix("torch."), num_layers=args.num_layers,
        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, vocab=vocab,
        max_length=max_length, opset=OPSET, fingerprint=lm.fingerprint, source=str(model_dir),
        extra={"hidden_size": args.hidden_size, "torch": torch.__version__,
               "head_digits": model.digits if model.samples_digits else 0,
               "check": PENDING_CHECK,  # until the check's result replaces it, or an unchecked export drops it
               **({"taps": list(taps), "state_size": (len(taps) + 1) * args.hidden_size,
                   "plain_graph": PLAIN_GRAPH_FILE} if taps else {})},
    )
    meta.save(stage)
    result = None
    if check:
        result = check_lm(model_dir, stage, dtype=torch_dtype, tolerance=tolerance)
        meta = GraphMeta(**{**meta.__dict__, "extra": {**meta.extra, "check": result.__dict__ | {"ok": result.ok}}})
        meta.save(stage)
        if not result.ok:
            raise RuntimeError(f"exported graph differs from PyTorch by {result.max_abs_diff:.3g} "
                               f"(tolerance {result.tolerance:.3g}); nothing was written")
    return meta, result


def _export_eagle(stage: Path, meta: GraphMeta, model_dir: Path, eagle: Path, torch_dtype: torch.dtype,
                  check: bool, tolerance: float | None) -> GraphMeta:
    """Export the target's EAGLE draft beside its step graph and record it in the metadata."""
    from pcgtts.export.proposer_graphs import INPUTS, MLP_INPUTS, MLP_OUTPUTS, OUTPUTS, EagleGraph, EagleMlpGraph
    from pcgtts.runtime.lm.eagle import EagleDraft
    from pcgtts.runtime.lm.torch_lm import TorchLM

    lm = TorchLM.load(model_dir, dtype=torch_dtype, max_length=16)
    model, vocab = lm.model, lm.vocab
    draft = EagleDraft.load(eagle, model, fingerprint=lm.fingerprint)
    graph = (EagleGraph if draft.attention else EagleMlpGraph)(
        draft, model, vocab.restricted_to_token_ids(torch.arange(vocab.restricted_size))).eval()
    args, t = draft.args, 3
    tokens = torch.export.Dim("tokens", min=1)
    example = (torch.zeros(1, t, args.hidden_size), torch.zeros(1, t, dtype=torch.long))
    if draft.attention:
        cache = torch.export.Dim("cache", min=2)
        past = [torch.zeros(1, args.num_kv_heads, 8, args.head_dim, dtype=torch_dtype) for _ in range(2)]
        example = (*example, torch.arange(t).view(1, -1), *past)
        dynamic = ({1: tokens}, {1: tokens}, {1: tokens}, {2: cache}, {2: cache})
        export_graph(graph, example, stage / EAGLE_GRAPH_FILE, INPUTS, OUTPUTS, dynamic)
    else:
        export_graph(graph, example, stage / EAGLE_GRAPH_FILE, MLP_INPUTS, MLP_OUTPUTS, ({1: tokens}, {1: tokens}))
    record = {"graph": EAGLE_GRAPH_FILE, "source": str(eagle), "dtype": str(torch_dtype).removeprefix("torch."),
              "block": draft.block_kind,
              "hidden_size": args.hidden_size, "num_kv_heads": args.num_kv_heads, "head_dim": args.head_dim,
              "intermediate_size": args.intermediate_size, "head_width": model.head.out_features,
              "digits": model.digits if model.samples_digits else 0, "acceptance": draft.acceptance,
              "temperature_scales": [list(pair) for pair in draft.temperature_scales]}
    if draft.feature_layers:  # the graph reads fused rows; the runtime fuses a target's row with this map
        np.save(stage / EAGLE_FUSE_FILE, draft.fuse.weight.detach().float().numpy())
        record |= {"fuse": EAGLE_FUSE_FILE, "feature_layers": list(draft.feature_layers),
                   "state_size": draft.state_size}
    checker = (lambda: check_eagle(model_dir, eagle, stage, tolerance=tolerance)) if check else None
    return _record_proposer(stage, meta, "eagle", record, checker)


def _export_heads(stage: Path, meta: GraphMeta, model_dir: Path, heads_file: Path, torch_dtype: torch.dtype,
                  check: bool, tolerance: float | None) -> GraphMeta:
    """Export the target's multi-token heads beside its step graph (and its transition table, if any)."""
    from pcgtts.export.proposer_graphs import HEADS_INPUTS, HEADS_OUTPUTS, HeadsGraph
    from pcgtts.runtime.lm.heads import TRANSITIONS_FILE, MTPHeads
    from pcgtts.runtime.lm.torch_lm import TorchLM

    lm = TorchLM.load(model_dir, dtype=torch_dtype, max_length=16)
    model = lm.model
    heads = MTPHeads.load(heads_file, fingerprint=lm.fingerprint, hidden_size=model.head.in_features,
                          dtype=torch_dtype)
    example = (torch.zeros(1, model.head.in_features),)
    export_graph(HeadsGraph(heads, model).eval(), example, stage / HEADS_GRAPH_FILE, HEADS_INPUTS, HEADS_OUTPUTS, None)
    if (heads_file.parent / TRANSITIONS_FILE).is_file():
        shutil.copy2(heads_file.parent / TRANSITIONS_FILE, stage / TRANSITIONS_FILE)
    record = {"graph": HEADS_GRAPH_FILE, "source": str(heads_file), "num_heads": heads.num_heads,
              "hidden_size": heads.hidden_size}
    checker = (lambda: check_heads(model_dir, heads_file, stage, tolerance=tolerance)) if check else None
    return _record_proposer(stage, meta, "heads", record, checker)


def _record_proposer(stage: Path, meta: GraphMeta, kind: str, record: dict, checker) -> GraphMeta:
    """List a proposer graph in the metadata; with `checker`, run and record its check (a failure
    raises, so the staged export is dropped)."""
    meta = GraphMeta(**{**meta.__dict__, "extra": {**meta.extra, kind: record}})
    meta.save(stage)
    if checker is not None:
        result = checker()
        record["check"] = result.__dict__ | {"ok": result.ok}
        meta.save(stage)
        if not result.ok:
            raise RuntimeError(f"exported {kind} graph differs from PyTorch by {result.max_abs_diff:.3g} "
                               f"(tolerance {result.tolerance:.3g}); nothing was written")
        log.info("exported %s graph: max |diff| vs PyTorch %.2g", kind, result.max_abs_diff)
    return meta


def check_eagle(model_dir: str | Path, eagle: str | Path, onnx_dir: str | Path, *, tolerance: float | None = None,
                seed: int = 0) -> CheckResult:
    """The torch draft step and the exported one side by side: rows fed in chunks, a slot
    overwritten (the loop's rollback), states and head scores compared."""
    from pcgtts.runtime.decode.proposers import EagleProposer
    from pcgtts.runtime.lm.onnxruntime import OrtLM
    from pcgtts.runtime.lm.torch_lm import TorchLM

    reference = EagleProposer.for_target(TorchLM.load(model_dir, dtype=torch.float32, max_length=64), eagle).step
    target = OrtLM.load(onnx_dir, max_length=64, force=True)
    candidate = target.eagle_step()
    gen = torch.Generator().manual_seed(seed)
    worst, start = 0.0, 0
    for rows, back in ((5, 0), (1, 0), (3, 2), (1, 0)):
        start -= back
        states = torch.randn(rows, reference.hidden_size, generator=gen)
        tokens = torch.randint(0, target.vocab.restricted_size, (rows,), generator=gen)
        expected = reference.run(states, tokens, start)
        for a, b in zip(expected, candidate.run(states, tokens, start)):
            worst = max(worst, (a.float() - b.float()).abs().max().item())
        start += rows
        f = expected[0][None]  # the draft's own state fed back (width D)
        for a, b in zip(reference.run(f, tokens[-1:], start), candidate.run(f, tokens[-1:], start)):
            worst = max(worst, (a.float() - b.float()).abs().max().item())
        start += 1
    if tolerance is None:
        tolerance = 2e-3 if target.cache_dtype == torch.float32 else 1e-1
    return CheckResult(max_abs_diff=worst, tolerance=tolerance, steps=("5 rows", "1", "back 2, 3", "1"))


def check_heads(model_dir: str | Path, heads_file: str | Path, onnx_dir: str | Path, *,
                tolerance: float | None = None, seed: int = 0) -> CheckResult:
    """The torch heads and the exported ones on the same random target states."""
    from pcgtts.runtime.decode.proposers import HeadProposer
    from pcgtts.runtime.lm.heads import MTPHeads
    from pcgtts.runtime.lm.onnxruntime import OrtLM
    from pcgtts.runtime.lm.torch_lm import TorchLM

    target = TorchLM.load(model_dir, dtype=torch.float32, max_length=16)
    heads = MTPHeads.load(heads_file, fingerprint=target.fingerprint, hidden_size=target.model.head.in_features)
    reference = HeadProposer.from_heads(heads, target).step
    exported = OrtLM.load(onnx_dir, max_length=16, force=True)
    candidate = exported.heads_step()
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for _ in range(3):
        hidden = torch.randn(reference.hidden_size, generator=gen)
        a, b = reference.logits(hidden, heads.num_heads), candidate.logits(hidden, heads.num_heads)
        worst = max(worst, (a.float() - b.float()).abs().max().item())
    if tolerance is None:
        tolerance = 2e-3 if exported.cache_dtype == torch.float32 else 1e-1
    return CheckResult(max_abs_diff=worst, tolerance=tolerance, steps=("3 states",))


def quantize_int8(folder: str | Path, model_dir: str | Path | None = None) -> GraphMeta:
    """Replace an exported float32 step graph in `folder` by its weight-only int8 quantization
    (`INT8_GRAPH_FILE`: onnxruntime's MatMulNBits, 8 bits, symmetric, one scale per 32 weights,
    int8 compute), and the plain step beside a tapped one likewise; with `model_dir`, record how far
    its logits are from PyTorch's.

    Weight-only, not onnxruntime's dynamic quantization: dynamic quantization also rounds the
    activations to 8 bits per tensor, which moved the demo target's next-token distribution by a
    total variation of 0.1-0.3; block-wise int8 weights move it by ~0.015 at nearly the same speed."""
    import onnx

    root = logging.getLogger()
    handlers, root_level = list(root.handlers), root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    root.handlers[:], root.level = handlers, root_level  # that import configures the root logger: undone

    folder = Path(folder)
    meta = GraphMeta.load(folder, kind="onnx")
    if meta.dtype != "float32" or meta.extra.get("quantize", "none") != "none":
        raise ValueError(f"{folder}: only a float32, unquantized graph can be quantized")
    config = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, accuracy_level=4, bits=8)
    extra = {**meta.extra, "quantize": "int8"}
    graphs = [(meta.graph, INT8_GRAPH_FILE)]
    if "plain_graph" in meta.extra:
        extra["plain_graph"] = _int8_name(meta.extra["plain_graph"])
        graphs.append((meta.extra["plain_graph"], extra["plain_graph"]))
    quiet = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # it logs every node it visits at INFO
    try:
        for source, target in graphs:
            quantizer = MatMulNBitsQuantizer(onnx.load(str(folder / source)), algo_config=config)
            quantizer.process()
            quantizer.model.save_model_to_file(str(folder / target), use_external_data_format=False)
            for name in (source, source + ".data"):
                (folder / name).unlink(missing_ok=True)
    finally:
        quiet.setLevel(level)
    meta = GraphMeta(**{**meta.__dict__, "graph": INT8_GRAPH_FILE, "extra": extra})
    meta.save(folder)
    if model_dir is not None:
        result = check_lm(model_dir, folder, tolerance=float("inf"))
        extra["int8"] = {"max_abs_diff": result.max_abs_diff, "steps": result.steps, "enforced": False}
        meta = GraphMeta(**{**meta.__dict__, "extra": extra})
        meta.save(folder)
        log.info("int8 graph: max |logit diff| vs PyTorch %.3g (recorded, not enforced)", result.max_abs_diff)
    return meta


def _int8_name(graph: str) -> str:
    return graph.removesuffix(".onnx") + ".int8.onnx"


def compare_backends(reference, candidate, prompt: torch.Tensor, steps: list[torch.Tensor], rollback: int) -> float:
    """Max |logit difference| between two `LM`s over a prefill, steps, a rollback and a 4-token step
    (a used-codes head's -inf entries must be -inf in both: any mismatch there counts as infinite)."""
    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.float().cpu(), b.float().cpu()
        both_inf = torch.isinf(a) & (a == b)
        return (a - b).abs().masked_fill(both_inf, 0.0).max().item()

    worst = diff(reference.prefill(prompt), candidate.prefill(prompt))
    for ids in steps:
        worst = max(worst, diff(reference.forward(ids), candidate.forward(ids)))
    for lm in (reference, candidate):
        lm.rollback(lm.length - rollback)
    ids = torch.cat(steps)[:4]
    return max(worst, diff(reference.forward(ids), candidate.forward(ids)))


def check_lm(model_dir: str | Path, onnx_dir: str | Path, *, dtype=torch.float32, tolerance: float | None = None,
             seed: int = 0) -> CheckResult:
    """Run the torch and onnxruntime backends side by side on a random prompt (each step graph of the
    export: the plain one and, beside it, the one that returns the taps)."""
    from pcgtts.runtime.lm.onnxruntime import OrtLM
    from pcgtts.runtime.lm.torch_lm import TorchLM

    reference = TorchLM.load(model_dir, dtype=torch.float32, max_length=64)
    vocab = reference.vocab
    diff = 0.0
    for taps in (False, True):
        candidate = OrtLM.load(onnx_dir, max_length=64, tokenizer=reference.tokenizer)
        if taps:
            if not candidate.meta.extra.get("taps"):
                break
            candidate.use_taps()
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, vocab.vocab_size, (11,), generator=gen)
        speech = lambda n: torch.randint(0, vocab.num_speech, (n,), generator=gen) + vocab.speech_offset  # noqa: E731
        steps = [speech(1), speech(4), speech(1), speech(4)]
        reference.rollback(0)
        diff = max(diff, compare_backends(reference, candidate, prompt, steps, rollback=3))
    if tolerance is None:
        tolerance = 2e-3 if dtype == torch.float32 else 1e-1
    return CheckResult(max_abs_diff=diff, tolerance=tolerance, steps=("prefill 11", "1", "4", "1", "4",
                                                                      "rollback 3", "4"))
