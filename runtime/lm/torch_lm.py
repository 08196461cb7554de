"""`TorchLM`: the `LM` protocol (`runtime/lm/protocol.py`) on the lean torch LLaMA, with CUDA graphs.

Logits are over the restricted vocabulary (`runtime/text/vocab.py`). On CUDA the 1-token (draft)
and (L+1)-token (verify) steps replay captured graphs; every step returns logits the caller owns.
"""

from __future__ import annotations

import logging
from pathlib import Path
import torch

from pcgtts.runtime.lm.checkpoint import load_llama, load_tokenizer, resolve_dtype
from pcgtts.runtime.lm.llama import Llama
from pcgtts.runtime.lm.protocol import SequenceMixin, check_fits
from pcgtts.runtime.text.vocab import SpeechVocab

log = logging.getLogger(__name__)


class TorchLM(SequenceMixin):
    """`LM` on the lean torch model; on CUDA the 1-token and (L+1)-token steps replay CUDA graphs."""

    def __init__(self, model: Llama, vocab: SpeechVocab, max_length: int, graph_sizes: tuple[int, ...] = (),
                 tokenizer=None, model_dir: str | Path | None = None):
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length}")
        self.model = model
        self.vocab = vocab
        self.tokenizer = tokenizer
        self.model_dir = Path(model_dir) if model_dir is not None else None
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
             max_length: int = 4096, cuda_graphs: bool | None = None, graph_token_counts: tuple[int, ...] = (1, 4),
             tokenizer=None, digit_head: bool = True, quantize: str = "none") -> "TorchLM":
        """graph_token_counts: the step sizes captured as CUDA graphs (a draft step is 1 token, a
        verify pass draft_length + 1); ignored unless `cuda_graphs` (default: on for CUDA).
        digit_head=False computes a digit-factorised head row by row (benchmarks compare the two).
        quantize="int8": int8 linear layers on a CPU (`runtime/lm/int8.py`)."""
        tokenizer = tokenizer or load_tokenizer(model_dir)
        vocab = SpeechVocab.from_tokenizer(tokenizer)
        model = load_llama(model_dir, vocab, resolve_dtype(dtype), device, digit_head=digit_head)
        if quantize == "int8":
            from pcgtts.runtime.lm.int8 import quantize_int8

            quantize_int8(model)
        elif quantize != "none":
            raise ValueError(f"quantize must be 'none' or 'int8', got {quantize!r}")
        if cuda_graphs is None:
            cuda_graphs = torch.device(device).type == "cuda"
        sizes = tuple(sorted(set(graph_token_counts))) if cuda_graphs else ()
        return cls(model, vocab, max_length, graph_sizes=sizes, tokenizer=tokenizer, model_dir=model_dir)

    @torch.inference_mode()
    def _run(self, ids: torch.Tensor, last_only: bool) -> torch.Tensor:
        ids = ids.to(self.device).view(1, -1)
        n = ids.shape[1]
        check_fits(self.length, n, self.max_length)
        graph = self._graphs.get(n)
        if graph is not None and not last_only:
            out = graph.run(ids, self.length).clone()  # the graph's output buffer is rewritten next replay
        else:
            positions = torch.arange(self.length, self.length + n, device=self.device)
            out = self.model(ids, positions, end=self.length + n, last_only=last_only)[0]
        self.length += n
        return out

    def _hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """Eager forward of ids [T] -> final-normed hidden states [T, D]."""
        ids = ids.to(self.device).view(1, -1)
        n = ids.shape[1]
        check_fits(self.length, n, self.max_length)
        positions = torch.arange(self.length, self.length + n, device=self.device)
        hidden = self.model.hidden(ids, positions, end=self.length + n)[0]
        self.length += n
        return hidden

    @torch.inference_mode()
    def forward_hidden(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Like `forward`, also returning the final-normed hidden states that multi-token heads
        read: ids [T] -> (logits [T, V_r], hidden [T, D]). Eager (no CUDA graph)."""
        hidden = self._hidden(ids)
        return self.model.logits(hidden), hidden

    @property
    def drawable_digits(self) -> int:
        """n > 0 when a step's token can be drawn digit by digit from `forward_scores`
        (`digit_head.sample_digit_codes`): a digit head without a used-codes mask, stepped eagerly."""
        return self.model.digits if self.model.samples_digits and not self._graphs else 0

    @torch.inference_mode()
    def forward_scores(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Like `forward_hidden`, but with the head's raw scores [T, 1 + 4 * digits + 1] in place
        of the logits (eager): what a digit-by-digit draw needs."""
        hidden = self._hidden(ids)
        return self.model.head_scores(hidden), hidden

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
        self.forget_prefix()

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
