"""LLaSA vocabulary layout, prompt format, text checks and sentence splitting."""

from __future__ import annotations

import pytest
import torch

from pcgtts.runtime.lm.checkpoint import load_tokenizer
from pcgtts.runtime.text.prompt import PINNED_DATE, build_prompt, check_text
from pcgtts.runtime.text.split import split_sentences
from pcgtts.runtime.text.vocab import SpeechVocab


@pytest.fixture(scope="module")
def tokenizer(tiny_lm_factory):
    return load_tokenizer(tiny_lm_factory())


def test_vocab_read_from_tokenizer(tokenizer):
    vocab = SpeechVocab.from_tokenizer(tokenizer)
    assert vocab.num_speech == 512
    assert tokenizer.convert_ids_to_tokens(vocab.speech_offset) == "<|s_0|>"
    assert tokenizer.convert_ids_to_tokens(vocab.stop_id) == "<|SPEECH_GENERATION_END|>"
    rows = vocab.head_rows()
    assert rows.shape == (513,) and int(rows[-1]) == vocab.stop_id
    idx = torch.tensor([0, 511, vocab.stop_index])
    assert vocab.restricted_to_token_ids(idx).tolist() == [vocab.speech_offset, vocab.speech_offset + 511, vocab.stop_id]
    from_ints = vocab.token_ids(idx.tolist())  # the decode loops' form, from host ints
    assert from_ints.dtype == torch.long and torch.equal(from_ints, vocab.restricted_to_token_ids(idx))
    assert vocab.token_ids([]).shape == (0,)


def test_non_llasa_tokenizer_is_refused():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
    with pytest.raises(ValueError, match="not a LLaSA tokenizer"):
        SpeechVocab.from_tokenizer(plain)


def test_prompt_layout_plain_and_cloning(tokenizer):
    vocab = SpeechVocab.from_tokenizer(tokenizer)
    ids = build_prompt(tokenizer, vocab, "Hello  world.")
    text = tokenizer.decode(ids)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system")
    assert f"Today Date: {PINNED_DATE}" in text  # deterministic, whatever today is
    assert "Convert the text to speech:<|TEXT_UNDERSTANDING_START|>Hello world.<|TEXT_UNDERSTANDING_END|>" in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n<|SPEECH_GENERATION_START|>")
    assert int(ids[-1]) == vocab.speech_start_id
    cloned = build_prompt(tokenizer, vocab, "Hi.", ref_text="I said this.", ref_codes=torch.tensor([3, 0, 511]))
    assert "<|TEXT_UNDERSTANDING_START|>I said this. Hi.<|TEXT_UNDERSTANDING_END|>" in tokenizer.decode(cloned)
    assert cloned[-3:].tolist() == [vocab.speech_offset + 3, vocab.speech_offset, vocab.speech_offset + 511]
    assert torch.equal(build_prompt(tokenizer, vocab, "Hello world."), ids)


@pytest.mark.parametrize("bad, match", [("", "empty"), ("   \n", "empty"), ("?!... --", "no pronounceable"),
                                        ("x" * 100_001, "limit")])
def test_bad_text(bad, match):
    with pytest.raises(ValueError, match=match):
        check_text(bad)


def test_cloning_needs_transcript_and_valid_codes(tokenizer):
    vocab = SpeechVocab.from_tokenizer(tokenizer)
    with pytest.raises(ValueError, match="transcript"):
        build_prompt(tokenizer, vocab, "Hi.", ref_codes=torch.tensor([1]))
    with pytest.raises(ValueError, match="codec indices"):
        build_prompt(tokenizer, vocab, "Hi.", ref_text="x", ref_codes=torch.tensor([512]))


def test_split_sentences_keeps_every_word_in_order():
    text = "First sentence. Second one is here! " + " ".join(f"word{i}," for i in range(80)) + " Last?"
    pieces = split_sentences(text, max_chars=60)
    assert all(0 < len(p) <= 60 for p in pieces)
    assert " ".join(pieces).split() == text.split()
    assert split_sentences("Short text.") == ["Short text."]
    assert split_sentences("Hello. -- . World.", max_chars=20) == ["Hello. -- . World."]
