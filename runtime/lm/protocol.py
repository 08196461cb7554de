"""What the decode loop needs from a language model, whatever runs it (torch, onnxruntime, tensorrt).

An `LM` owns one sequence's static KV cache and a `length` (tokens in the cache):

    prefill(ids)   -> logits of the last prompt token        [V_r]     (resets the cache)
    forward(ids)   -> logits of every new token               [T, V_r]  (appends T tokens)
    rollback(n)    -> keep only the first n tokens; O(1): later writes overwrite the rest

Logits are over the restricted vocabulary (speech tokens + stop, `runtime/text/vocab.py`) and
belong to the caller: a backend never returns a buffer its next step overwrites.
`SequenceMixin` implements prefill / forward / rollback once over a backend's `_run`.

Optional, torch backend only: `forward_hidden(ids)` (logits and final-normed hidden states, for
multi-token heads and EAGLE drafts) and, when `drawable_digits` > 0, `forward_scores(ids)` (a
digit-factorised head's raw scores, which plain-temperature decoding samples digit by digit).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from pcgtts.runtime.text.vocab import SpeechVocab


@runtime_checkable
class LM(Protocol):
    vocab: SpeechVocab  # speech-token layout (offset, count, stop id) read from the tokenizer
    tokenizer: Any  # the Hugging Face tokenizer prompts are built with
    model_dir: Path  # where the model was loaded from
    max_length: int  # KV-cache capacity in tokens
    length: int  # tokens in the cache now
    device: torch.device

    @property
    def fingerprint(self) -> str: ...  # of the speech embedding rows; group tables are checked against it

    def prefill(self, ids: torch.Tensor) -> torch.Tensor: ...

    def forward(self, ids: torch.Tensor) -> torch.Tensor: ...

    def rollback(self, length: int) -> None: ...

    def ensure_cache(self) -> None: ...  # (re)allocate the cache after release()

    def release(self) -> None: ...  # free the cache; weights stay loaded


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
