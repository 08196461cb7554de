"""`load_lm`: an `LM` (`runtime/lm/protocol.py`) from a model folder, on the backend named.

torch reads a Hugging Face checkpoint; onnxruntime and tensorrt read `pcgtts export` output. The
decode loop and the acceptance rules never know which one runs.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pcgtts.runtime.config import BACKENDS, DeviceConfig


def concrete_backend(backend: str, target: str | Path | None) -> str:
    """`backend`, with "auto" made concrete: the backend an export folder was made for
    (`pcgtts-lm.json`), torch for a checkpoint (or with int8 layers asked for)."""
    if backend != "auto":
        return backend
    from pcgtts.runtime.lm.graph_meta import exported_kind

    kind = exported_kind(target) if target is not None else None
    return {"onnx": "onnxruntime", "tensorrt": "tensorrt"}.get(kind, "torch")


def resolve_backend(device: DeviceConfig, target: str | Path | None) -> DeviceConfig:
    """`device` with its backend made concrete for `target` (`concrete_backend`)."""
    return replace(device, backend=concrete_backend(device.backend, target))


def load_lm(model_dir: str | Path, backend: str = "auto", device: str = "cpu", dtype: str = "float32",
            max_length: int = 4096, draft_length: int = 3, tokenizer=None, force_export: bool = False,
            quantize: str = "none", compiled: bool = False, threads: int | None = None, prefix_cache: bool = True):
    """draft_length sizes the CUDA graphs of the torch backend (1-token steps, L+1-token verifies);
    force_export loads an export whose recorded numeric check failed; quantize="int8": the torch
    backend's int8 linear layers on a CPU (`runtime/lm/int8.py`); compiled: the torch backend's
    steps through torch.compile on a CPU (`runtime/lm/torch_lm.py`); threads: onnxruntime's intra-op
    threads (None: its default; torch's are process-wide, set by the caller); prefix_cache: a
    prefill reuses the KV of the leading tokens it shares with the last prompt (`protocol.py`)."""
    lm = _load(model_dir, concrete_backend(backend, model_dir), device, dtype, max_length, draft_length, tokenizer,
               force_export, quantize, compiled, threads)
    lm.reuse_prefix = prefix_cache
    return lm


def _load(model_dir, backend, device, dtype, max_length, draft_length, tokenizer, force_export, quantize, compiled,
          threads):
    if backend == "torch":
        from pcgtts.runtime.lm.torch_lm import TorchLM

        return TorchLM.load(model_dir, device=device, dtype=dtype, max_length=max_length,
                            graph_token_counts=(1, draft_length + 1), tokenizer=tokenizer, quantize=quantize,
                            compiled=compiled)
    if backend == "onnxruntime":
        from pcgtts.runtime.lm.onnxruntime import OrtLM

        return OrtLM.load(model_dir, device=device, max_length=max_length, tokenizer=tokenizer, force=force_export,
                          threads=threads)
    if backend == "tensorrt":
        from pcgtts.runtime.lm.tensorrt import TrtLM

        return TrtLM.load(model_dir, device="cuda" if device == "cpu" else device, max_length=max_length,
                          tokenizer=tokenizer, force=force_export)
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
