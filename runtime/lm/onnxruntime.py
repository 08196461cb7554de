"""`LM` on ONNX Runtime: the exported step graph, with the KV buffers bound by IO binding.

CPU execution provider by default; with onnxruntime-gpu installed and `device="cuda"`, the
CUDA (or TensorRT) execution provider runs the graph and the buffers live on the GPU. Inputs,
the cache and every output are torch tensors bound by pointer, so nothing is copied between
ONNX Runtime and the decode loop except the T new cache entries written back per step.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from pcgtts.runtime.lm.buffered import BufferedLM
from pcgtts.runtime.lm.graph_meta import GraphMeta

log = logging.getLogger(__name__)

_NP_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}


def import_onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise RuntimeError("the onnxruntime backend needs onnxruntime: pip install 'pcgtts[onnx]' "
                           "(or 'pcgtts[gpu]' for onnxruntime-gpu)") from None
    return onnxruntime


def providers_for(device: torch.device, available: list[str]) -> list[str]:
    if device.type == "cpu":
        return ["CPUExecutionProvider"]
    if device.type == "cuda":
        wanted = [p for p in ("TensorrtExecutionProvider", "CUDAExecutionProvider") if p in available]
        if "CUDAExecutionProvider" not in wanted:
            raise RuntimeError(f"device 'cuda' needs onnxruntime-gpu (pip install 'pcgtts[gpu]'); "
                               f"this onnxruntime offers {available}")
        return wanted + ["CPUExecutionProvider"]
    raise ValueError(f"the onnxruntime backend runs on cpu or cuda, not {device.type!r}")


class OrtLM(BufferedLM):
    def __init__(self, session, meta: GraphMeta, folder: Path, device: torch.device, max_length: int,
                 tokenizer=None):
        self.session = session
        super().__init__(meta, folder, device, max_length, tokenizer)
        self._where = ("cuda" if device.type == "cuda" else "cpu", device.index or 0)

    @classmethod
    def load(cls, folder: str | Path, *, device: str = "cpu", max_length: int | None = None, tokenizer=None,
             threads: int | None = None, force: bool = False) -> "OrtLM":
        ort = import_onnxruntime()
        folder = Path(folder)
        meta = GraphMeta.load(folder, kind="onnx", force=force)
        dev = torch.device(device)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
        # ORT's pool spins after each run by default, stealing the cores the decode loop's own
        # torch work (sampling, the acceptance rule) needs between graph runs.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = providers_for(dev, ort.get_available_providers())
        try:
            session = ort.InferenceSession(str(folder / meta.graph), options, providers=providers)
        except Exception as err:  # onnxruntime raises its own exception types for bad graphs
            raise ValueError(f"{folder / meta.graph}: onnxruntime cannot load this graph: {err}") from None
        log.info("onnxruntime %s on %s", ort.__version__, session.get_providers()[0])
        return cls(session, meta, folder, dev, max_length or meta.max_length, tokenizer)

    def _bind(self, binding, name: str, tensor: torch.Tensor, output: bool) -> None:
        args = (name, self._where[0], self._where[1], _NP_DTYPES[tensor.dtype], tuple(tensor.shape),
                tensor.data_ptr())
        (binding.bind_output if output else binding.bind_input)(*args)

    def _execute(self, ids, positions, logits_index):
        meta = self.meta
        n, k = ids.shape[1], logits_index.shape[1]
        binding = self.session.io_binding()
        for name, tensor in (("input_ids", ids), ("position_ids", positions), ("logits_index", logits_index)):
            self._bind(binding, name, tensor, output=False)
        logits = torch.empty(1, k, meta.vocab.restricted_size, dtype=torch.float32, device=self.device)
        self._bind(binding, "logits", logits, output=True)
        present = []
        for i in range(meta.num_layers):
            for j, part in enumerate(("key", "value")):
                self._bind(binding, f"past_key_values.{i}.{part}", self.cache[2 * i + j], output=False)
                new = torch.empty(1, meta.num_kv_heads, n, meta.head_dim, dtype=self.cache_dtype, device=self.device)
                self._bind(binding, f"present.{i}.{part}", new, output=True)
                present.append(new)
        if self.device.type == "cuda":
            binding.synchronize_inputs()
        self.session.run_with_iobinding(binding)
        if self.device.type == "cuda":
            binding.synchronize_outputs()
        return logits, present
