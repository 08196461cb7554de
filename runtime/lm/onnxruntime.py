"""`LM` on ONNX Runtime: the exported step graph, with the KV buffers bound by IO binding.

CPU execution provider by default; with onnxruntime-gpu installed and `device="cuda"`, the
CUDA (or TensorRT) execution provider runs the graph and the buffers live on the GPU. Inputs,
the cache and every output are torch tensors bound by pointer, so nothing is copied between
ONNX Runtime and the decode loop except the T new cache entries written back per step.

`OrtEagleStep` and `OrtHeads` run the proposers exported with the target (`export/proposer_graphs.py`,
listed under "eagle" / "heads" in pcgtts-lm.json) for the eagle-* and mtp-* policies.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from pcgtts.runtime.lm.buffered import BufferedLM, KVBuffers, fresh_slots, grow_cache, resize_cache, write_entries
from pcgtts.runtime.lm.digit_head import expand_digit_scores
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


def open_session(path: Path, device: torch.device, threads: int | None = None):
    """An InferenceSession for one of our graphs on `device`, or a clear error."""
    ort = import_onnxruntime()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    # ORT's pool spins after each run by default, stealing the cores the decode loop's own
    # torch work (sampling, the acceptance rule) needs between graph runs.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    providers = providers_for(device, ort.get_available_providers())
    try:
        session = ort.InferenceSession(str(path), options, providers=providers)
    except Exception as err:  # onnxruntime raises its own exception types for bad graphs
        raise ValueError(f"{path}: onnxruntime cannot load this graph: {err}") from None
    log.info("onnxruntime %s on %s: %s", ort.__version__, session.get_providers()[0], path.name)
    return session


_KEPT_PRESENT = 16  # token counts (steps, verifies) whose new-entry buffers are kept; prefills allocate theirs


class _Bound:
    """Runs a session with torch tensors bound by pointer (inputs and preallocated outputs).

    One binding lives as long as the session; a name is bound again only when its tensor's
    pointer, shape or dtype changed. A decode step's inputs are mostly the same KV buffers each
    step: binding all 2 x layers + 2 x layers names anew cost ~0.35 ms of a 4.3 ms built-in-voice
    step (53 bindings through onnxruntime's Python wrapper)."""

    def __init__(self, session, device: torch.device):
        self.session, self.device = session, device
        self._where = ("cuda" if device.type == "cuda" else "cpu", device.index or 0)
        self._binding = session.io_binding()
        self._bound: dict[str, tuple] = {}  # name -> (pointer, shape, dtype) it is bound to

    def run(self, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> None:
        binding = self._binding
        for output, tensors in ((False, inputs), (True, outputs)):
            for name, tensor in tensors.items():
                key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
                if self._bound.get(name) == key:
                    continue
                args = (name, self._where[0], self._where[1], _NP_DTYPES[tensor.dtype], key[1], key[0])
                (binding.bind_output if output else binding.bind_input)(*args)
                self._bound[name] = key
        if self.device.type == "cuda":
            binding.synchronize_inputs()
        self.session.run_with_iobinding(binding)
        if self.device.type == "cuda":
            binding.synchronize_outputs()


class OrtLM(BufferedLM):
    growable = True  # the step graph takes any cache size: the buffer grows with the sequence

    def __init__(self, session, meta: GraphMeta, folder: Path, device: torch.device, max_length: int,
                 tokenizer=None, threads: int | None = None, tapped: bool = True):
        super().__init__(meta, folder, device, max_length, tokenizer)
        self._present: dict[int, list[torch.Tensor]] = {}  # token count -> the new-entry buffers it writes
        self.threads = threads
        self._use(session, tapped)

    @classmethod
    def load(cls, folder: str | Path, *, device: str = "cpu", max_length: int | None = None, tokenizer=None,
             threads: int | None = None, force: bool = False) -> "OrtLM":
        """The export's step graph; where it returns an EAGLE draft's taps, the plain step beside it
        (`plain_graph`: onnxruntime runs every node whatever is asked for) until `use_taps()`."""
        folder = Path(folder)
        meta = GraphMeta.load(folder, kind="onnx", force=force)
        dev = torch.device(device)
        plain = meta.extra.get("plain_graph")
        session = open_session(folder / (plain or meta.graph), dev, threads)
        return cls(session, meta, folder, dev, max_length or meta.max_length, tokenizer, threads, tapped=not plain)

    def _use(self, session, tapped: bool) -> None:
        names = {o.name for o in session.get_outputs()}
        if self.head_output not in names:
            raise ValueError(f"{self.model_dir}: pcgtts-lm.json says the graph returns {self.head_output}, it does not")
        self.session, self._bound, self.tapped = session, _Bound(session, self.device), tapped
        self.exposes_hidden = "last_hidden_state" in names
        # the width of the rows last_hidden_state returns: with the taps, those layers' outputs too
        self.state_size = 0
        if self.exposes_hidden:
            self.state_size = self.meta.state_size if tapped else self.meta.extra["hidden_size"]

    def use_taps(self) -> None:
        """From now on step through the graph that also returns the layers an EAGLE draft reads
        (`extra["taps"]`); the cache is the runtime's, so a sequence goes on where it was."""
        if not self.tapped:
            self._use(open_session(self.model_dir / self.meta.graph, self.device, self.threads), tapped=True)

    @property
    def has_eagle(self) -> bool:
        """Whether an EAGLE draft was exported with this target (`pcgtts export onnx --eagle`)."""
        return "eagle" in self.meta.extra

    @property
    def has_heads(self) -> bool:
        """Whether multi-token heads were exported with this target (`pcgtts export onnx --heads`)."""
        return "heads" in self.meta.extra

    def _proposer_session(self, kind: str, flag: str):
        record = self.meta.extra.get(kind)
        if record is None:
            raise ValueError(f"{self.model_dir}: no {kind} graph was exported with this target "
                             f"(`pcgtts export onnx --model CHECKPOINT {flag} FILE`)")
        if not self.exposes_hidden:
            raise ValueError(f"{self.model_dir}: this export has no hidden-state output; export it again")
        path = self.model_dir / record["graph"]
        if not path.is_file():
            raise FileNotFoundError(f"{self.model_dir}: {record['graph']} listed in pcgtts-lm.json is missing")
        return open_session(path, self.device, self.threads), record

    # proposers run from the graphs exported with the target (`eagle_step`, `heads_step`), never a file
    exported_proposers = frozenset({"eagle", "heads"})

    def eagle_step(self) -> "OrtEagleStep":
        """The EAGLE draft exported with this target, on the same device, with its own cache."""
        session, record = self._proposer_session("eagle", "--eagle")
        fuse = None
        if "fuse" in record:  # a draft that reads several target layers: its map from a target row
            self.use_taps()
            path = self.model_dir / record["fuse"]
            if not path.is_file():
                raise FileNotFoundError(f"{self.model_dir}: {record['fuse']} listed in pcgtts-lm.json is missing")
            fuse = torch.from_numpy(np.load(path))
        return OrtEagleStep(session, record, self.device, self.max_length, fuse)

    def heads_step(self) -> "OrtHeads":
        """The multi-token heads exported with this target."""
        session, record = self._proposer_session("heads", "--heads")
        return OrtHeads(session, record, self.device, self.meta.vocab.restricted_size)

    def _execute(self, ids, positions, logits_index):
        meta = self.meta
        n, k = ids.shape[1], logits_index.shape[1]
        head = torch.empty(1, k, self.head_width, dtype=torch.float32, device=self.device)
        inputs = {"input_ids": ids, "position_ids": positions, "logits_index": logits_index}
        outputs = {self.head_output: head}
        hidden = None
        if self.exposes_hidden:
            hidden = torch.empty(1, k, self.state_size, dtype=torch.float32, device=self.device)
            outputs["last_hidden_state"] = hidden
        present = self._present.get(n)
        if present is None:  # copied into the cache right after the run: reusable, so bound once per n
            present = KVBuffers.empty(2 * meta.num_layers, (1, meta.num_kv_heads, n, meta.head_dim), self.cache_dtype,
                                      self.device)
            if n <= _KEPT_PRESENT:
                self._present[n] = present
        for i in range(meta.num_layers):
            for j, part in enumerate(("key", "value")):
                inputs[f"past_key_values.{i}.{part}"] = self.cache[2 * i + j]
                outputs[f"present.{i}.{part}"] = present[2 * i + j]
        self._bound.run(inputs, outputs)
        return head, hidden, present


class OrtHeads:
    """`heads.TorchHeads`' contract over the exported heads graph: logits(hidden [D], count) -> [count, V_r]
    (the graph computes all k heads; the first `count` are returned)."""

    def __init__(self, session, record: dict, device: torch.device, restricted_size: int):
        self._bound, self.device = _Bound(session, device), device
        self.num_heads, self.hidden_size, self.restricted_size = record["num_heads"], record["hidden_size"], restricted_size
        self.dtype = torch.float32

    def logits(self, hidden: torch.Tensor, count: int) -> torch.Tensor:
        out = torch.empty(1, self.num_heads, self.restricted_size, dtype=torch.float32, device=self.device)
        state = hidden.to(self.device, torch.float32).contiguous().view(1, -1)
        self._bound.run({"last_hidden_state": state}, {"logits": out})
        return out[0, :count]


class OrtEagleStep:
    """`eagle.TorchEagleStep`'s contract over the exported EAGLE graph: run(states [k, D], tokens [k],
    start) -> (f [D], head scores [W]), float32, with the one block's cache owned here."""

    def __init__(self, session, record: dict, device: torch.device, max_length: int, fuse: torch.Tensor | None = None):
        self._bound, self.device, self.max_length = _Bound(session, device), device, max_length
        self.acceptance = record.get("acceptance")
        self.temperature_scales = tuple((t, f) for t, f in record.get("temperature_scales", ()))
        self.head_width = record["head_width"]
        self.feature_size = record["hidden_size"]  # f's width: the target's hidden size
        self.hidden_size = record.get("state_size", self.feature_size)  # the width of the target's rows it reads
        # a draft that reads several target layers: its fuse map [D, (k + 1) D], applied to a target's row here
        self.fuse = None if fuse is None else fuse.to(device, torch.float32)
        self.digits = record["digits"]  # > 0: the scores are a digit table's, drawn digit by digit
        self.dtype = torch.float32  # the graph's state inputs and outputs
        self.attention = record.get("block", "attention") == "attention"  # else no positions, no cache
        cache_dtype = {"float32": torch.float32, "float16": torch.float16}[record["dtype"]]
        shape = (1, record["num_kv_heads"], fresh_slots(0, max_length), record["head_dim"])
        self.cache = KVBuffers.zeros(2, shape, cache_dtype, device) if self.attention else []

    def run(self, states: torch.Tensor, tokens: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.attention:  # rows are independent: the last one alone
            states, tokens = states[-1:], tokens[-1:]
        k = len(tokens)
        if self.fuse is not None and states.shape[-1] != self.feature_size:  # target rows: fuse their layers
            states = states.to(self.fuse) @ self.fuse.T
        f = torch.empty(1, 1, self.feature_size, dtype=torch.float32, device=self.device)
        scores = torch.empty(1, 1, self.head_width, dtype=torch.float32, device=self.device)
        inputs = {"hidden_states": states.to(self.device, torch.float32).contiguous().view(1, k, -1),
                  "restricted_ids": tokens.to(self.device, torch.long).contiguous().view(1, k)}
        outputs = {"last_hidden_state": f, "head_scores": scores}
        if self.attention:
            if start == 0:  # a new sequence: back to a fresh buffer's size (the block attends over all of it)
                self.cache = resize_cache(self.cache, 0, fresh_slots(k, self.max_length))
            self.cache = grow_cache(self.cache, start, start + k, self.max_length)
            c = self.cache[0]
            new = KVBuffers.empty(2, (1, c.shape[1], k, c.shape[3]), c.dtype, self.device)
            inputs |= {"position_ids": torch.arange(start, start + k, device=self.device).view(1, k),
                       "past_key_values.0.key": self.cache[0], "past_key_values.0.value": self.cache[1]}
            outputs |= {"present.0.key": new[0], "present.0.value": new[1]}
        self._bound.run(inputs, outputs)
        if self.attention:
            write_entries(self.cache, new, start)
        return f[0, 0], scores[0, 0]

    def scores_to_logits(self, scores: torch.Tensor) -> torch.Tensor:
        return expand_digit_scores(scores, self.digits) if self.digits else scores
