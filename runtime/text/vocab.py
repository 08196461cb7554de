"""The speech part of a LLaSA vocabulary, read from the tokenizer (never hard-coded).

LLaSA appends 8 control tokens and then `<|s_0|>` ... `<|s_65535|>` to a Llama-3 tokenizer.
During speech generation only the speech tokens and the stop token can be sampled, so the
runtime works in a *restricted* vocabulary of `num_speech + 1` entries:

    restricted index i in [0, num_speech)  <->  codec index i  <->  token id speech_offset + i
    restricted index num_speech            <->  <|SPEECH_GENERATION_END|> (the stop token)

Every LM backend returns logits over this restricted vocabulary (its LM head is computed only
over those rows), and the acceptance rules and group tables index it directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TEXT_UNDERSTANDING_START = "<|TEXT_UNDERSTANDING_START|>"
TEXT_UNDERSTANDING_END = "<|TEXT_UNDERSTANDING_END|>"
SPEECH_GENERATION_START = "<|SPEECH_GENERATION_START|>"
SPEECH_GENERATION_END = "<|SPEECH_GENERATION_END|>"
# All eight control tokens, in the order LLaSA's training script adds them.
CONTROL_TOKENS = (
    "<|TEXT_GENERATION_START|>",
    "<|TEXT_GENERATION_END|>",
    TEXT_UNDERSTANDING_START,
    TEXT_UNDERSTANDING_END,
    SPEECH_GENERATION_START,
    SPEECH_GENERATION_END,
    "<|SPEECH_UNDERSTANDING_START|>",
    "<|SPEECH_UNDERSTANDING_END|>",
)
NUM_SPEECH_TOKENS = 65536  # X-codec2: 8-dim FSQ with 4 levels each, 4**8 codes


def speech_token(index: int) -> str:
    return f"<|s_{index}|>"


@dataclass(frozen=True)
class SpeechVocab:
    speech_offset: int  # token id of <|s_0|>
    num_speech: int  # number of speech tokens (65,536 for X-codec2)
    stop_id: int  # token id of <|SPEECH_GENERATION_END|>
    speech_start_id: int  # token id of <|SPEECH_GENERATION_START|>
    text_start_id: int  # token id of <|TEXT_UNDERSTANDING_START|>
    text_end_id: int  # token id of <|TEXT_UNDERSTANDING_END|>
    vocab_size: int  # full tokenizer size (193,800 for the released checkpoints)

    def __post_init__(self) -> None:
        if self.num_speech <= 0:
            raise ValueError(f"num_speech must be positive, got {self.num_speech}")
        if self.speech_offset + self.num_speech > self.vocab_size:
            raise ValueError(
                f"speech tokens [{self.speech_offset}, {self.speech_offset + self.num_speech}) "
                f"do not fit a vocabulary of {self.vocab_size}"
            )
        if self.speech_offset <= self.stop_id < self.speech_offset + self.num_speech:
            raise ValueError("the stop token must not be a speech token")

    @property
    def restricted_size(self) -> int:
        """Size of the sampled vocabulary: every speech token plus the stop token."""
        return self.num_speech + 1

    @property
    def stop_index(self) -> int:
        """Index of the stop token in the restricted vocabulary."""
        return self.num_speech

    def head_rows(self) -> torch.Tensor:
        """Token ids of the LM-head rows kept, in restricted-vocabulary order. [num_speech + 1]"""
        speech = torch.arange(self.speech_offset, self.speech_offset + self.num_speech)
        return torch.cat([speech, torch.tensor([self.stop_id])])

    def restricted_to_token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        return torch.where(indices == self.stop_index, self.stop_id, indices + self.speech_offset)

    def token_ids(self, indices: list[int], device: torch.device | str | None = None) -> torch.Tensor:
        """`restricted_to_token_ids` of indices held as Python ints: mapped in Python, one tensor made
        (int64 [len]). A decode loop's tokens come back to the host anyway; the tensor form's three
        ops each release Python's GIL and must take it back from the codec's thread (3.9 µs against
        13.6 alone; in the loop the wait moves to the step's next tensor op)."""
        stop, offset = self.stop_index, self.speech_offset
        return torch.tensor([self.stop_id if i == stop else i + offset for i in indices], dtype=torch.long,
                            device=device)

    def codes_to_token_ids(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.num_speech):
            raise ValueError(f"codec indices must lie in [0, {self.num_speech})")
        return codes.to(torch.long) + self.speech_offset

    def prompt_codes(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """Codec indices of the speech tokens that end a prompt after its last
        <|SPEECH_GENERATION_START|> (a cloned voice's reference codes; empty without one). [N]"""
        ids = torch.as_tensor(prompt_ids).view(-1)
        starts = (ids == self.speech_start_id).nonzero()
        tail = ids[int(starts[-1]) + 1:] if len(starts) else ids[:0]
        if ((tail < self.speech_offset) | (tail >= self.speech_offset + self.num_speech)).any():
            raise ValueError("the prompt continues <|SPEECH_GENERATION_START|> with tokens that are not speech tokens")
        return (tail - self.speech_offset).to(torch.long).cpu()

    def describe(self) -> str:
        """The layout in one line, for error messages."""
        return (f"<|s_0|>..<|s_{self.num_speech - 1}|> at ids {self.speech_offset}..{self.speech_offset + self.num_speech - 1}, "
                f"stop {self.stop_id}, speech start {self.speech_start_id}, text start/end "
                f"{self.text_start_id}/{self.text_end_id}, {self.vocab_size} tokens")

    def check_same_layout(self, other: "SpeechVocab", mine: str = "target", theirs: str = "draft") -> None:
        """Raise a ValueError naming both layouts unless `other` lays out the vocabulary identically."""
        if other != self:
            raise ValueError(f"the {theirs}'s tokenizer has a different speech-token layout from the {mine}'s: "
                             f"{mine}: {self.describe()}; {theirs}: {other.describe()}")

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "SpeechVocab":
        """Read the layout from a Hugging Face tokenizer; fail clearly if it is not LLaSA's."""
        vocab = tokenizer.get_vocab()
        missing = [t for t in CONTROL_TOKENS if t not in vocab]
        if missing:
            raise ValueError(f"tokenizer is not a LLaSA tokenizer: missing control tokens {missing}")
        if speech_token(0) not in vocab:
            raise ValueError("tokenizer is not a LLaSA tokenizer: no <|s_0|> token")
        offset = vocab[speech_token(0)]
        num = 0
        # Speech tokens must be contiguous: the restricted vocabulary relies on it.
        while speech_token(num) in vocab:
            if vocab[speech_token(num)] != offset + num:
                raise ValueError(f"speech tokens are not contiguous at <|s_{num}|>")
            num += 1
        return cls(
            speech_offset=offset,
            num_speech=num,
            stop_id=vocab[SPEECH_GENERATION_END],
            speech_start_id=vocab[SPEECH_GENERATION_START],
            text_start_id=vocab[TEXT_UNDERSTANDING_START],
            text_end_id=vocab[TEXT_UNDERSTANDING_END],
            vocab_size=len(tokenizer),
        )
