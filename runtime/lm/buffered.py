"""The `LM` contract for exported graphs: the runtime owns the static KV buffers.

ONNX Runtime and TensorRT run the same step graph (`export/lm_graph.py`): the whole cache
buffer goes in, the T new keys/values come out. This base class owns the buffers (torch
tensors on the backend's device, so their memory can be bound zero-copy by pointer), writes
each step's new entries at their slots and implements prefill / forward / rollback; a backend
only implements `_execute`; prefill / forward / rollback come from `SequenceMixin`.
Graphs exported since the EAGLE draft ran on onnxruntime also return the final-normed hidden
states (`last_hidden_state`): `forward_hidden` reads them (`exposes_hidden`; older exports do not).

The step graph attends over the whole buffer it is given, so a buffer sized for `max_length`
(4,096 in the synthesizer) makes every early step pay for thousands of empty slots. Where the
graph takes any buffer size (onnxruntime) the buffer starts at `INITIAL_CAPACITY` slots and
doubles, copying what it holds, up to `max_length` (`grow_cache`), and a new prompt's prefill
shrinks it back; a TensorRT engine's profiles fix its size.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pcgtts.runtime.lm.digit_head import expand_digit_scores
from pcgtts.runtime.lm.graph_meta import GraphMeta
from pcgtts.runtime.lm.checkpoint import load_tokenizer, resolve_dtype
from pcgtts.runtime.lm.protocol import SequenceMixin, check_fits
from pcgtts.runtime.text.vocab import SpeechVocab


INITIAL_CAPACITY = 256  # cache slots a growable buffer starts with
KEPT_STEP_INPUTS = 16  # token counts (steps, verifies) whose graph inputs are kept and rewritten in place


class KVBuffers(list):
    """A model's 2 x layers cache (or new-entry) buffers [1, kv, S, D] as views of one tensor
    `stack` [2 x layers, 1, kv, S, D]: each is still bound to its graph input by pointer, and a
    step's new entries go into every layer's buffer with one copy (twelve slice assignments cost
    the built-in voice ~70 µs of its ~1.7 ms step)."""

    def __init__(self, stack: torch.Tensor):
        super().__init__(stack.unbind(0))
        self.stack = stack

    @classmethod
    def zeros(cls, count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> "KVBuffers":
        return cls(torch.zeros(count, *shape, dtype=dtype, device=device))

    @classmethod
    def empty(cls, count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> "KVBuffers":
        return cls(torch.empty(count, *shape, dtype=dtype, device=device))


def write_entries(cache: list[torch.Tensor], new: list[torch.Tensor], start: int) -> None:
    """Every buffer's slots start .. start + T from the new entries [1, kv, T, D]: one copy when both
    are `KVBuffers`, a copy per buffer otherwise."""
    end = start + new[0].shape[2]
    if isinstance(cache, KVBuffers) and isinstance(new, KVBuffers):
        cache.stack[:, :, :, start:end] = new.stack
        return
    for buf, entries in zip(cache, new):
        buf[:, :, start:end] = entries


def grow_cache(cache: list[torch.Tensor], length: int, needed: int, max_length: int) -> list[torch.Tensor]:
    """`cache` ([1, kv, S, D] each) with room for `needed` slots: S doubled until it fits (at most
    `max_length`), the first `length` slots copied; the same list when it already fits."""
    slots = cache[0].shape[2]
    if needed <= slots:
        return cache
    return resize_cache(cache, length, _doubled(slots, needed, max_length))


def fresh_slots(length: int, max_length: int) -> int:
    """The buffer size a cache grown from `INITIAL_CAPACITY` has once it holds `length` slots."""
    return _doubled(INITIAL_CAPACITY, length, max_length)


def _doubled(slots: int, needed: int, max_length: int) -> int:
    """`slots` doubled until it holds `needed`, at most `max_length`."""
    while slots < needed:
        slots *= 2
    return min(slots, max_length)


def resize_cache(cache: list[torch.Tensor], length: int, slots: int) -> list[torch.Tensor]:
    """New buffers of `slots` slots holding the first `length` of `cache`'s; the same list when the size is unchanged."""
    if cache[0].shape[2] == slots:
        return cache
    first = cache[0]
    resized = KVBuffers.zeros(len(cache), (*first.shape[:2], slots, first.shape[3]), first.dtype, first.device)
    write_entries(resized, [buf[:, :, :length] for buf in cache], 0)
    return resized


class BufferedLM(SequenceMixin):
    growable = False  # a backend whose graph takes any buffer size sets this (onnxruntime)

    def __init__(self, meta: GraphMeta, folder: Path, device: torch.device, max_length: int, tokenizer=None):
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length}")
        tokenizer = tokenizer or load_tokenizer(folder)
        vocab = SpeechVocab.from_tokenizer(tokenizer)
        meta.check_tokenizer(vocab, str(folder))
        self.meta, self.vocab, self.tokenizer = meta, vocab, tokenizer
        self.model_dir = folder
        self.fingerprint = meta.fingerprint
        self.device = device
        self.max_length = max_length
        self.cache_dtype = resolve_dtype(meta.dtype)
        self.length = 0
        self.exposes_hidden = False  # set by a backend whose graph returns last_hidden_state
        # > 0: the graph returns a digit head's scores (head_scores), not logits (export/lm_graph.py)
        self.head_digits = int(meta.extra.get("head_digits", 0))
        self.head_output = "head_scores" if self.head_digits else "logits"
        self.head_width = 2 + 4 * self.head_digits if self.head_digits else meta.vocab.restricted_size
        self._hidden: torch.Tensor | None = None  # [T, D] of the last _run, when exposed
        self._kept_inputs: dict[tuple[int, bool], tuple[torch.Tensor, ...]] = {}  # `_step_inputs`, per (T, last_only)
        self.cache: list[torch.Tensor] = []  # [2 * layers] of [1, kv, max_length, D]: k0, v0, k1, ...
        self.ensure_cache()

    def ensure_cache(self) -> None:
        if not self.cache:
            slots = min(INITIAL_CAPACITY, self.max_length) if self.growable else self.max_length
            shape = (1, self.meta.num_kv_heads, slots, self.meta.head_dim)
            self.cache = KVBuffers.zeros(2 * self.meta.num_layers, shape, self.cache_dtype, self.device)

    def _new_sequence(self, kept: int) -> None:
        """A growable buffer goes back to the size a fresh prefill would have once it holds the
        `kept` reused slots. The graph attends over its whole buffer, so a buffer left grown by a
        long utterance would slow every step of the next one (the built-in voice's next time to
        first audio: ~210 ms instead of ~100), and the blocks then run on a fresh prefill's sizes."""
        if self.growable and self.cache:
            self.cache = resize_cache(self.cache, kept, fresh_slots(kept, self.max_length))

    def release(self) -> None:
        self.cache = []
        self.length = 0
        self.forget_prefix()

    def _execute(self, ids: torch.Tensor, positions: torch.Tensor, logits_index: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        """ids, positions: [1, T]; logits_index: [1, K] (int64, on `device`). Returns the head's
        output [1, K, head_width] float32 (logits, or a digit head's scores: `head_output`), the
        hidden states [1, K, D] (None when the graph has none) and the new entries [2 * layers]
        of [1, kv, T, D]."""
        raise NotImplementedError

    @property
    def drawable_digits(self) -> int:
        """n > 0 when the graph returns a digit head's scores: `forward_scores` gives them, and a
        plain step draws digit by digit (as `TorchLM.drawable_digits`)."""
        return self.head_digits

    def forward_scores(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As `TorchLM.forward_scores`: ids [T] -> (digit scores [T, 34], hidden [T, D] or None)."""
        if not self.head_digits:
            raise ValueError(f"{self.model_dir}: this graph returns logits, not a digit head's scores")
        return self._step(ids, last_only=False), self._hidden

    def forward_hidden(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As `TorchLM.forward_hidden`: ids [T] -> (logits [T, V_r], hidden [T, D])."""
        if not self.exposes_hidden:
            raise ValueError(f"{self.model_dir}: this export has no hidden-state output; export the "
                             f"target again with `pcgtts export onnx` for the eagle-* policies")
        logits = self.forward(ids)
        return logits, self._hidden

    def _step_inputs(self, ids: torch.Tensor, last_only: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The graph's input_ids and position_ids [1, T] (slots length .. length + T - 1) and logits_index
        [1, K]. For a step or a verify (T <= `KEPT_STEP_INPUTS`) they are the same three tensors every
        time, written in place, so a backend that binds its inputs by pointer binds them once instead of
        three times a step."""
        n = ids.numel()
        first = n - 1 if last_only else 0
        kept = self._kept_inputs.get((n, last_only)) if n <= KEPT_STEP_INPUTS else None
        if kept is None:
            kept = (torch.empty(1, n, dtype=torch.long, device=self.device),
                    torch.empty(1, n, dtype=torch.long, device=self.device),
                    torch.arange(first, n, device=self.device).view(1, -1))
            if n <= KEPT_STEP_INPUTS:
                self._kept_inputs[n, last_only] = kept
        kept[0][0].copy_(ids.reshape(-1))
        torch.arange(self.length, self.length + n, out=kept[1][0])
        return kept

    @torch.inference_mode()
    def _run(self, ids: torch.Tensor, last_only: bool) -> torch.Tensor:
        head = self._step(ids, last_only)
        return expand_digit_scores(head, self.head_digits) if self.head_digits else head

    @torch.inference_mode()
    def _step(self, ids: torch.Tensor, last_only: bool) -> torch.Tensor:
        """Run the graph on `ids`, append them to the cache -> the head's output rows [K, head_width]."""
        n = ids.numel()
        check_fits(self.length, n, self.max_length)
        self.ensure_cache()
        self.cache = grow_cache(self.cache, self.length, self.length + n, self.max_length)
        logits, hidden, present = self._execute(*self._step_inputs(ids, last_only))
        self._hidden = None if hidden is None else hidden[0]
        write_entries(self.cache, present, self.length)
        self.length += n
        return logits[0]
