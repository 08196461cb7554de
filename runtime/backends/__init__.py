"""LM backends behind one interface (`runtime/lm.py`'s `LM`): torch, onnxruntime, tensorrt.

`load_lm` picks one by name; the decode loop and acceptance rules never know which runs.
"""

from __future__ import annotations

from pathlib import Path

BACKENDS = ("torch", "onnxruntime", "tensorrt")


def load_lm(model_dir: str | Path, backend: str = "torch", device: str = "cpu", dtype: str = "float32",
            max_length: int = 4096, lookahead: int = 3, tokenizer=None):
    if backend == "torch":
        from pcgtts.runtime.lm import TorchLM

        return TorchLM.load(model_dir, device=device, dtype=dtype, max_length=max_length, lookahead=lookahead,
                            tokenizer=tokenizer)
    if backend == "onnxruntime":
        from pcgtts.runtime.backends.onnxruntime import OrtLM

        return OrtLM.load(model_dir, device=device, max_length=max_length, tokenizer=tokenizer)
    if backend == "tensorrt":
        from pcgtts.runtime.backends.tensorrt import TrtLM

        return TrtLM.load(model_dir, device="cuda" if device == "cpu" else device, max_length=max_length,
                          tokenizer=tokenizer)
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
