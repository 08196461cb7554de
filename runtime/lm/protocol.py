"""What the decode loop needs from a language model, whatever runs it (torch, onnxruntime, tensorrt).

An `LM` owns one sequence's static KV cache and a `length` (tokens in the cache):

    prefill(ids)   -> logits of the last prompt token        [V_r]     (starts a new sequence)
    forward(ids)   -> logits of every new token               [T, V_r]  (appends T tokens)
    rollback(n)    -> keep only the first n tokens; O(1): later writes overwrite the rest

Logits are over the restricted vocabulary (speech tokens + stop, `runtime/text/vocab.py`) and
belong to the caller: a backend never returns a buffer its next step overwrites.
`SequenceMixin` implements prefill / forward / rollback once over a backend's `_run`.

Prefix reuse: a prefill keeps the cache slots of the leading tokens it shares with the last
prompt whose KV the cache still holds, and runs only the rest. Prompts share a long fixed head
(the chat template up to the user's text: 111 of the built-in voice's ~140 tokens; a cloned
voice's transcript follows it), so the next utterance's prefill, most of its time to first audio,
shrinks to its own words. Decoding writes only past the prompt, so those slots survive an
utterance; a rollback below them or `release()` forgets them. A prefill runs in blocks that
depend on the prompt alone (`block_starts`: `PREFILL_BLOCK` tokens at a time up to the end of the
chat template's head, then the rest), and reuse keeps whole blocks, so a reused slot holds bit
for bit what a fresh prefill computes: the kernels see the same batch for it either way (a row
recomputed in a differently sized batch sums in another order, and dynamic int8 quantization
scales activations per batch; a seeded utterance would then depend on what came before it).
`reuse_prefix = False` turns reuse off.

Capabilities every LM declares (`SequenceMixin` gives the defaults): `compiled` (its steps run
through compiled graphs, which a compiled rule and an EAGLE chain suit), `drawable_digits` (> 0: a
digit-factorised head, whose raw scores `forward_scores(ids)` returns and plain-temperature
decoding samples digit by digit) and `exported_proposers` (proposer graphs exported with the model:
"eagle", "heads"). An LM that also returns its states is a `StatesLM`: `forward_hidden(ids)`
(logits and final-normed hidden states, for multi-token heads and EAGLE drafts) and
`forward_scores(ids)`: torch, and exported graphs that carry them (`export/lm_graph.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from pcgtts.runtime.text.vocab import SpeechVocab

PREFILL_BLOCK = 32  # tokens per prefill block within the template's head (the granularity of prefix reuse)


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

    compiled: bool  # steps run through compiled graphs
    drawable_digits: int  # > 0: a digit head of this many digits, drawn digit by digit (`forward_scores`)
    exported_proposers: frozenset[str]  # proposer graphs exported with the model: "eagle", "heads"


@runtime_checkable
class StatesLM(LM, Protocol):
    """An LM whose steps also return what proposers on the target's states read."""

    def forward_hidden(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...  # logits [T, V_r], states [T, D]

    def forward_scores(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]: ...  # digit scores, states


def check_fits(length: int, new: int, max_length: int) -> None:
    if length + new > max_length:
        raise ValueError(
            f"sequence of {length + new} tokens exceeds the KV cache of {max_length} tokens "
            f"(raise max_length, or shorten the text / reference audio)"
        )


def template_head(ids: torch.Tensor, vocab: SpeechVocab) -> int:
    """How many leading tokens of the prompt `ids` [T] are the chat template's head, which every
    utterance and voice shares: through the first <|TEXT_UNDERSTANDING_START|> (T if none)."""
    found = (ids == vocab.text_start_id).nonzero()
    return int(found[0, 0]) + 1 if len(found) else len(ids)


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading entries two 1-D id tensors share."""
    n = min(len(a), len(b))
    differs = (a[:n] != b[:n]).nonzero()
    return int(differs[0, 0]) if len(differs) else n


def reusable_length(previous: torch.Tensor | None, kept: int, ids: torch.Tensor, blocks: list[int],
                    reuse: bool = True) -> int:
    """How many leading tokens of the prompt `ids` [T] a cache holding `kept` tokens of the prompt
    `previous` (None: none) holds as a fresh prefill would leave them: the shared prefix cut back to a
    block start (`blocks`: `block_starts(ids)`), short of the last token (which always runs, for its
    logits); 0 when `reuse` is off."""
    n = min(kept, len(ids) - 1) if reuse and previous is not None else 0
    shared = common_prefix(previous[:n], ids[:n].cpu()) if n > 0 else 0
    return max(b for b in blocks if b <= shared)


def prefill_spans(kept: int, blocks: list[int], length: int) -> list[tuple[int, int]]:
    """The (start, end) runs a prefill of `length` tokens makes after its first `kept` (a block start),
    one per block (`blocks`: `block_starts`)."""
    starts = [kept] + [b for b in blocks if b > kept]
    return list(zip(starts, starts[1:] + [length]))


class SequenceMixin:
    """prefill / forward / rollback over a backend's `_run(ids, last_only)`; shared by every backend."""

    length: int
    reuse_prefix: bool = True  # prefill keeps the slots of the leading tokens shared with the last prompt
    compiled: bool = False  # the `LM` capabilities' defaults
    drawable_digits: int = 0
    exported_proposers: frozenset[str] = frozenset()
    _prompt: torch.Tensor | None = None  # [P] int64 on the CPU: the last prompt prefilled
    _kept: int = 0  # of its tokens, how many leading ones the cache still holds

    def _run(self, ids: torch.Tensor, last_only: bool) -> torch.Tensor:
        raise NotImplementedError

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [T] prompt token ids. Starts a new sequence. Returns [V_r] logits of the last token."""
        if ids.numel() == 0:
            raise ValueError("empty prompt")
        ids = ids.view(-1)
        self.length = self.reusable_prefix(ids)
        self._new_sequence(self.length)
        for start, end in prefill_spans(self.length, self.block_starts(ids), len(ids)):  # reuse ends at a block start
            logits = self._run(ids[start:end], last_only=True)
        self._prompt, self._kept = ids.to("cpu", copy=True), len(ids)
        return logits[-1]

    def _new_sequence(self, kept: int) -> None:
        """A prefill starts a sequence keeping the cache's first `kept` slots (a backend may resize its buffers)."""

    def block_starts(self, ids: torch.Tensor) -> list[int]:
        """Where a prefill of `ids` [T] starts its blocks: every `PREFILL_BLOCK` tokens up to the
        end of the chat template's head (the first <|TEXT_UNDERSTANDING_START|>, which every
        utterance shares), then the rest in one block (what follows differs from utterance to
        utterance: splitting it would only add calls). Whether a position starts a block depends
        only on the tokens before it, so two prompts that share a prefix split it alike."""
        anchor = template_head(ids, self.vocab)
        return list(range(0, anchor, PREFILL_BLOCK)) + ([anchor] if anchor < len(ids) else [])

    def reusable_prefix(self, ids: torch.Tensor) -> int:
        """How many leading tokens of the prompt `ids` [T] the cache holds as a fresh prefill would
        leave them: the shared prefix cut back to a block start, short of the last token (which
        always runs, for its logits); 0 when `reuse_prefix` is off."""
        return reusable_length(self._prompt, self._kept, ids, self.block_starts(ids), self.reuse_prefix)

    def forget_prefix(self) -> None:
        """The cache no longer holds the last prompt (it was freed or overwritten)."""
        self._prompt, self._kept = None, 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [T] new token ids appended at `length`. Returns [T, V_r] logits."""
        return self._run(ids, last_only=False)

    def rollback(self, length: int) -> None:
        """O(1): later writes overwrite the dropped slots, which causality already hides."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length} tokens")
        self.length = length
        self._kept = min(self._kept, length)  # slots from `length` on will be overwritten
