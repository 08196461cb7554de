"""`pcgtts export tensorrt`: build a TensorRT engine from an exported ONNX step graph.

The engine gets the three optimization profiles `runtime/lm/tensorrt.py` runs with
(draft step, verify/short steps, prefill), a fixed cache capacity (the `past` inputs' slot
axis: TensorRT plans kernels per shape range, and a fixed capacity keeps every profile's
range tight), and fp16 or bf16 kernels. The folder it writes holds the engine, the tokenizer
and a `pcgtts-lm.json` naming the GPU and TensorRT version it was built for, and the build is
checked against the ONNX graph on onnxruntime before it is kept.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from pcgtts.export.onnx_common import copy_tokenizer
from pcgtts.runtime.lm.graph_meta import GraphMeta
from pcgtts.runtime.lm.tensorrt import PROFILES, gpu_identity, import_tensorrt

log = logging.getLogger(__name__)

ENGINE_FILE = "model.engine"


def profile_ranges(draft_length: int, max_length: int) -> dict[str, tuple[tuple[int, int, int], tuple[int, int, int]]]:
    """(min, opt, max) of the token count T and of the logit rows K for each profile."""
    step = draft_length + 2  # verify is L + 1; one spare for the draft's catch-up step
    return {
        "draft": ((1, 1, 1), (1, 1, 1)),
        "step": ((1, draft_length + 1, step), (1, draft_length + 1, step)),
        "prefill": ((1, min(256, max_length), max_length), (1, 1, 1)),
    }


def build_engine(onnx_dir: str | Path, out_dir: str | Path, *, precision: str = "fp16", draft_length: int = 3,
                 max_length: int = 2048, workspace_gb: float = 8.0) -> GraphMeta:
    trt = import_tensorrt()
    if precision not in ("fp16", "bf16", "fp32"):
        raise ValueError(f"precision must be fp16, bf16 or fp32, not {precision!r}")
    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    meta = GraphMeta.load(onnx_dir, kind="onnx")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_dir / meta.graph)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ValueError(f"TensorRT cannot parse {onnx_dir / meta.graph}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * (1 << 30)))
    if precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    elif precision == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
    ranges = profile_ranges(draft_length, max_length)
    cache = (1, meta.num_kv_heads, max_length, meta.head_dim)
    for name in PROFILES:  # the order is the profile index the runtime selects
        tokens, logits = ranges[name]
        profile = builder.create_optimization_profile()
        for tensor in ("input_ids", "position_ids"):
            profile.set_shape(tensor, *[(1, t) for t in tokens])
        profile.set_shape("logits_index", *[(1, k) for k in logits])
        for i in range(meta.num_layers):
            for part in ("key", "value"):
                profile.set_shape(f"past_key_values.{i}.{part}", cache, cache, cache)
        config.add_optimization_profile(profile)
    started = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError("TensorRT failed to build the engine (see its log above)")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / ENGINE_FILE).write_bytes(bytes(serialized))
    log.info("built %s in %.0f s", out_dir / ENGINE_FILE, time.perf_counter() - started)
    copy_tokenizer(onnx_dir, out_dir)
    built_for = {"tensorrt": trt.__version__, **gpu_identity(torch.device("cuda"))}
    engine_meta = dataclasses.replace(
        meta, graph=ENGINE_FILE, kind="tensorrt", max_length=max_length, source=str(onnx_dir),
        extra={**{k: v for k, v in meta.extra.items() if k != "plain_graph"},  # one engine: the taps cost little there
               "precision": precision, "built_for": built_for,
               "profiles": {name: list(ranges[name][0]) for name in PROFILES}},
    )
    engine_meta.save(out_dir)
    return engine_meta


def check_engine_against_onnx(onnx_dir: str | Path, engine_dir: str | Path, tolerance: float = 0.15) -> float:
    """Max |logit difference| between the engine and the ONNX graph over prefill, steps and a rollback."""
    from pcgtts.export.onnx_lm import compare_backends
    from pcgtts.runtime.lm.onnxruntime import OrtLM
    from pcgtts.runtime.lm.tensorrt import TrtLM

    engine = TrtLM.load(engine_dir)
    reference = OrtLM.load(onnx_dir, max_length=engine.max_length, tokenizer=engine.tokenizer)
    vocab = engine.vocab
    gen = torch.Generator().manual_seed(0)
    speech = lambda n: torch.randint(0, vocab.num_speech, (n,), generator=gen) + vocab.speech_offset  # noqa: E731
    diff = compare_backends(reference, engine, speech(11), [speech(1), speech(4), speech(1), speech(4)], rollback=3)
    if diff > tolerance:
        raise RuntimeError(f"TensorRT engine differs from the ONNX graph by {diff:.3g} (tolerance {tolerance})")
    return diff
