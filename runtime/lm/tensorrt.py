"""`LM` on TensorRT engines built by `pcgtts export tensorrt` from the ONNX step graph.

One engine, three optimization profiles, one execution context per profile:

    draft   T = 1,           K = 1            the draft's 1-token step
    step    T in [1, L + 2], K = T            verify (L + 1), catch-up and other short steps
    prefill T in [1, S],     K = 1            the prompt; head for the last token only

The KV buffers are torch CUDA tensors owned by `BufferedLM`; every tensor address is set by
pointer, so an engine run copies nothing besides writing the T new cache entries back. An
engine only runs on the GPU model and TensorRT version it was built with: `load` checks both
against `pcgtts-lm.json` and says what to rebuild.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pcgtts.runtime.lm.buffered import BufferedLM, KVBuffers
from pcgtts.runtime.lm.graph_meta import GraphMeta

log = logging.getLogger(__name__)

PROFILES = ("draft", "step", "prefill")


def import_tensorrt():
    try:
        import tensorrt
    except ImportError:
        raise RuntimeError(
            "TensorRT is not installed. It needs an NVIDIA GPU and NVIDIA's Python package "
            "(pip install 'pcgtts[tensorrt]', which pulls `tensorrt` from pypi.nvidia.com); "
            "on machines without it use --backend onnxruntime or torch") from None
    if not torch.cuda.is_available():
        raise RuntimeError("TensorRT needs an NVIDIA GPU, and torch sees no CUDA device here")
    return tensorrt


def gpu_identity(device: torch.device) -> dict:
    props = torch.cuda.get_device_properties(device)
    return {"gpu": props.name, "compute_capability": f"{props.major}.{props.minor}"}


def choose_profile(tokens: int, logits: int, step_max: int) -> int:
    """Which optimization profile serves a run of `tokens` new tokens needing `logits` rows."""
    if tokens == 1 and logits == 1:
        return PROFILES.index("draft")
    if logits == tokens and tokens <= step_max:
        return PROFILES.index("step")
    if logits == 1:
        return PROFILES.index("prefill")
    raise ValueError(f"no TensorRT profile serves {tokens} tokens with {logits} logit rows "
                     f"(steps are limited to {step_max} tokens; rebuild with a larger --draft-length)")


def check_engine(meta: GraphMeta, trt_version: str, identity: dict, folder: Path) -> None:
    built = meta.extra.get("built_for", {})
    wanted = {"tensorrt": trt_version, **identity}
    diff = {k: (built.get(k), v) for k, v in wanted.items() if built.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: engine {a!r} vs here {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"{folder}: the engine was built for another GPU or TensorRT ({detail}); "
                         f"rebuild it here with `pcgtts export tensorrt`")


class TrtLM(BufferedLM):
    def __init__(self, engine, meta: GraphMeta, folder: Path, device: torch.device, tokenizer=None):
        self.engine = engine
        self.contexts = []
        stream = torch.cuda.current_stream(device).cuda_stream
        for i in range(len(PROFILES)):
            context = engine.create_execution_context()
            context.set_optimization_profile_async(i, stream)
            self.contexts.append(context)
        self.step_max = int(meta.extra["profiles"]["step"][1])
        # The cache capacity is fixed by the profiles the engine was built with.
        super().__init__(meta, folder, device, meta.max_length, tokenizer)
        names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
        self.exposes_hidden = "last_hidden_state" in names

    @classmethod
    def load(cls, folder: str | Path, *, device: str = "cuda", max_length: int | None = None,
             tokenizer=None, force: bool = False) -> "TrtLM":
        trt = import_tensorrt()
        folder = Path(folder)
        meta = GraphMeta.load(folder, kind="tensorrt", force=force)
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError("the tensorrt backend runs on a CUDA device")
        if max_length not in (None, meta.max_length):
            log.warning("TensorRT engine has a fixed cache of %d tokens; ignoring max_length=%s",
                        meta.max_length, max_length)
        check_engine(meta, trt.__version__, gpu_identity(dev), folder)
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        engine = runtime.deserialize_cuda_engine((folder / meta.graph).read_bytes())
        if engine is None:
            raise ValueError(f"{folder / meta.graph}: TensorRT could not deserialize the engine (corrupt file?)")
        return cls(engine, meta, folder, dev, tokenizer)

    def _execute(self, ids, positions, logits_index):
        meta = self.meta
        n, k = ids.shape[1], logits_index.shape[1]
        context = self.contexts[choose_profile(n, k, self.step_max)]
        head = torch.empty(1, k, self.head_width, dtype=torch.float32, device=self.device)
        present = KVBuffers.empty(len(self.cache), (1, meta.num_kv_heads, n, meta.head_dim), self.cache_dtype,
                                  self.device)
        tensors = {"input_ids": ids, "position_ids": positions, "logits_index": logits_index,
                   self.head_output: head}
        hidden = None
        if self.exposes_hidden:  # every output of the engine must have an address
            hidden = torch.empty(1, k, meta.state_size, dtype=torch.float32, device=self.device)
            tensors["last_hidden_state"] = hidden
        for i in range(meta.num_layers):
            for j, part in enumerate(("key", "value")):
                tensors[f"past_key_values.{i}.{part}"] = self.cache[2 * i + j]
                tensors[f"present.{i}.{part}"] = present[2 * i + j]
        for name, tensor in tensors.items():
            if not (name in (self.head_output, "last_hidden_state") or name.startswith("present.")):
                context.set_input_shape(name, tuple(tensor.shape))
            context.set_tensor_address(name, tensor.data_ptr())
        if not context.execute_async_v3(torch.cuda.current_stream(self.device).cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        return head, hidden, present
