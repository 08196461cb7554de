"""LLaSA's prompt format, as token ids.

    user:      "Convert the text to speech:<|TEXT_UNDERSTANDING_START|>{ref_text}{text}<|TEXT_UNDERSTANDING_END|>"
    assistant: "<|SPEECH_GENERATION_START|>" + "".join(<|s_c|> for c in reference codes)

rendered with the checkpoint's own chat template, continuing the assistant turn (no end-of-turn
token), so the model's next tokens are speech tokens. Llama-3 templates print today's date;
it is pinned here so the same input always gives the same prompt.

The user's words (text and ref_text) never become control tokens: they are tokenized apart from
the template, through the tokenizer's normaliser, pre-tokenizer and model only, skipping its
added-token vocabulary, so a typed `<|SPEECH_GENERATION_START|>`, `<|s_123|>` or `<|eot_id|>` is
read as the characters it is made of (the same ids for ordinary text as tokenizing the whole).
"""

from __future__ import annotations

import re

import torch

from pcgtts.runtime.text.vocab import (
    SPEECH_GENERATION_START,
    TEXT_UNDERSTANDING_END,
    TEXT_UNDERSTANDING_START,
    SpeechVocab,
)

PINNED_DATE = "26 Jul 2024"  # the Llama 3.2 template's own fallback date
INSTRUCTION = "Convert the text to speech:"
MAX_TEXT_CHARS = 100_000  # longer input is refused: split it into files / calls
PRONOUNCEABLE = re.compile(r"[^\W_]", re.UNICODE)  # any letter or digit, in any script


def check_text(text: str) -> str:
    """Normalise whitespace and reject text that cannot be spoken."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a string, got {type(text).__name__}")
    text = " ".join(text.split())
    if not text:
        raise ValueError("text is empty")
    if len(text) > MAX_TEXT_CHARS:
        raise ValueError(f"text has {len(text)} characters; the limit per call is {MAX_TEXT_CHARS}")
    if not PRONOUNCEABLE.search(text):
        raise ValueError(f"text has no pronounceable characters: {text[:40]!r}")
    return text


def tokenize_plain(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as plain text: no added or special token (control, speech, chat) is
    matched, whatever the tokenizer marks as special."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer: remove every added-token string instead
        for token in sorted(tokenizer.get_added_vocab(), key=len, reverse=True):
            text = text.replace(token, "")
        return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    pieces = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer is not None else [(text, None)]
    return [token.id for piece, _ in pieces for token in backend.model.tokenize(piece)]


_USER_TEXT = "\x00pcgtts-user-text\x00"  # placeholder for the user's words while the template renders


def build_prompt(tokenizer, vocab: SpeechVocab, text: str, ref_text: str | None = None,
                 ref_codes: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids [T] of the prompt that makes the model speak `text` (in the voice of ref_codes)."""
    text = check_text(text)
    if ref_codes is not None and ref_text is None:
        raise ValueError("voice cloning needs the transcript of the reference audio (ref_text)")
    # The model card joins transcript and text without a separator; a space keeps words apart.
    spoken = f"{check_text(ref_text)} {text}" if ref_text else text
    chat = [
        {"role": "user", "content": f"{INSTRUCTION}{TEXT_UNDERSTANDING_START}{_USER_TEXT}{TEXT_UNDERSTANDING_END}"},
        {"role": "assistant", "content": SPEECH_GENERATION_START},
    ]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False, continue_final_message=True,
                                             date_string=PINNED_DATE)
    before, found, after = rendered.partition(_USER_TEXT)
    if not found or _USER_TEXT in after:
        raise ValueError("the chat template must place the user's message exactly once")

    def template(part: str) -> list[int]:
        return tokenizer(part, add_special_tokens=False)["input_ids"]

    ids = torch.tensor(template(before) + tokenize_plain(tokenizer, spoken) + template(after), dtype=torch.long)
    if int(ids[-1]) != vocab.speech_start_id:
        raise ValueError("chat template did not end the prompt with <|SPEECH_GENERATION_START|>")
    if ref_codes is not None:
        ids = torch.cat([ids, vocab.codes_to_token_ids(torch.as_tensor(ref_codes).view(-1))])
    return ids
