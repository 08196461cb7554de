"""The language-model interface the decode loop talks to, and its torch implementation.

An `LM` owns one sequence's static KV cache and a `length` (tokens in the cache):

    prefill(ids)   -> logits of the last prompt token        [V_r]     (resets the cache)
    forward(ids)   -> logits of every new token               [T, V_r]  (appends T tokens)
    rollback(n)    -> keep only the first n tokens; O(1): later writes overwrite the rest

Logits are over the restricted vocabulary (`runtime/vocab.py`). The ONNX Runtime and
TensorRT backends (`runtime/backends/`) implement the same interface, so the speculative
loop runs unchanged on each.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import torch

from pcgtts.runtime.checkpoint import load_llama, load_tokenizer, resolve_dtype
from pcgtts.runtime.llama import Llama
from pcgtts.runtime.vocab import SpeechVocab

log = logging.getLogger(__name__)


class LM(Protocol):
    vocab: SpeechVocab
    max_length: int
    length: int
    device: torch.device

    def prefill(self, ids: torch.Tensor) -> torch.Tensor: ...

    def forward(self, ids: torch.Tensor) -> torch.Tensor: ...

    def rollback(self, length: int) -> None: ...

    def release(self) -> None: ...


def check_fits(length: int, new: int, max_length: int) -> None:
    if length + new > max_length:
        raise ValueError(
            f"sequence of {length + new} tokens exceeds the KV cache of {max_length} tokens "
            f"(raise max_length, or shorten the text / reference audio)"
        )


class SequenceMixin:
    """prefill / forward / rollback over a backend's `_run(ids, last_only)`; shared by every backend."""

    length: int

    def _run(self, ids: torch.Tensor, last_only: bool) -> torch.Tensor:
        raise NotImplementedError

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [T] prompt token ids. Starts a new sequence. Returns [V_r] logits of the last token."""
        if ids.numel() == 0:
            raise ValueError("empty prompt")
        self.length = 0
        return self._run(ids, last_only=True)[-1]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [T] new token ids appended at `length`. Returns [T, V_r] logits."""
        return self._run(ids, last_only=False)

    def rollback(self, length: int) -> None:
        """O(1): later writes overwrite the dropped slots, which causality already hides."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length} tokens")
        self.length = length


class TorchLM(SequenceMixin):
    """`LM` on the lean torch model; on CUDA the 1-token and (L+1)-token steps replay CUDA graphs."""

    def __init__(self, model: Llama, vocab: SpeechVocab, max_length: int, graph_sizes: tuple[int, ...] = ()):
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length}")
        self.model = model
        self.vocab = vocab
        self.max_length = max_length
        self.device = model.embed_tokens.weight.device
        self.length = 0
        if graph_sizes and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.graph_sizes = tuple(graph_sizes)
        self._graphs: dict[int, _StepGraph] = {}
        self._fingerprint: str | None = None
        self.ensure_cache()

    @classmethod
    def load(cls, model_dir: str | Path, *, device: str = "cpu", dtype: str | torch.dtype = "float32",
             max_length: int = 4096, cuda_graphs: bool | None = None, lookahead: int = 3,
             tokenizer=None) -> "TorchLM":
        tokenizer = tokenizer or load_tokenizer(model_dir)
        vocab = SpeechVocab.from_tokenizer(tokenizer)
        model = load_llama(model_dir, vocab, resolve_dtype(dtype), device)
        if cuda_graphs is None:
            cuda_graphs = torch.device(device).type == "cuda"
        sizes = (1, lookahead + 1) if cuda_graphs else ()
        lm = cls(model, vocab, max_length, graph_sizes=sizes)
        lm.tokenizer = tokenizer
        lm.model_dir = Path(model_dir)
        return lm

    @torch.inference_mode()
    def _run(self, ids: torch.Tensor, last_only: bool) -> torch.Tensor:
        ids = ids.to(self.device).view(1, -1)
        n = ids.shape[1]
        check_fits(self.length, n, self.max_length)
        graph = self._graphs.get(n)
        if graph is not None and not last_only:
            out = graph.run(ids, self.length)
        else:
            positions = torch.arange(self.length, self.length + n, device=self.device)
            out = self.model(ids, positions, end=self.length + n, last_only=last_only)[0]
        self.length += n
        return out

    @property
    def fingerprint(self) -> str:
        """Fingerprint of the speech-token embedding rows: what a group table is checked against."""
        if self._fingerprint is None:
            from pcgtts.groups.build import embedding_fingerprint

            v = self.vocab
            self._fingerprint = embedding_fingerprint(self.model.embed_tokens.weight[v.speech_offset:v.speech_offset + v.num_speech])
        return self._fingerprint

    def release(self) -> None:
        """Free the KV cache and graphs (the weights stay loaded)."""
        self._graphs.clear()
        self.model.free_cache()
        self.length = 0

    def ensure_cache(self) -> None:
        """(Re)allocate the cache and capture the step graphs after `release()`."""
        if self.model.max_length != self.max_length:
            self.model.setup_cache(self.max_length)
            self._graphs = {n: _StepGraph(self.model, n) for n in self.graph_sizes}


class _StepGraph:
    """One captured forward of `n` tokens attending over the whole (masked) static cache."""

    def __init__(self, model: Llama, n: int):
        dev = model.embed_tokens.weight.device
        self.ids = torch.zeros(1, n, dtype=torch.long, device=dev)
        self.positions = torch.arange(n, device=dev)
        self.n = n
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm up kernels/allocator outside the capture
                model(self.ids, self.positions)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.inference_mode():
            self.logits = model(self.ids, self.positions)[0]
        # The warm-up wrote garbage into slots [0, n); harmless: slots are rewritten before use.

    def run(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        self.ids.copy_(ids)
        torch.arange(start, start + self.n, out=self.positions)
        self.graph.replay()
        return self.logits
