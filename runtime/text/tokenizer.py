"""A tokenizer with LLaSA's token layout: Llama-3 special tokens, LLaSA's control tokens and the
speech tokens as added tokens, over a 256-symbol byte-level text vocabulary, with a Llama-3 chat
template. The demo models and the speech lab's models are written with it, so they load as a
released LLaSA checkpoint does."""

from __future__ import annotations

from pcgtts.runtime.text.vocab import CONTROL_TOKENS, NUM_SPEECH_TOKENS, speech_token

LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

# A Llama-3-style chat template. `date_string` is a template variable so prompts can pin it.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if date_string is not defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date_string + '\\n\\n<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def build_demo_tokenizer(num_speech: int = NUM_SPEECH_TOKENS):
    """A fast tokenizer with LLaSA's token layout on a 256-symbol byte-level text vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(LLAMA3_SPECIAL))
    # LLaSA adds its control and speech tokens as ordinary added tokens, control tokens first.
    core.add_tokens(list(CONTROL_TOKENS) + [speech_token(i) for i in range(num_speech)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|begin_of_text|>",
                                  eos_token="<|eot_id|>", pad_token="<|eot_id|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok
