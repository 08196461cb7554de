"""The built-in demo: a small LLaSA-format target, a layer-subset draft and a tiny X-codec2.

RANDOM WEIGHTS: the demo exercises every stage with real file formats and reports real
latencies, but its audio is not speech. Every command that falls back to it says so.

The target is a genuine `LlamaForCausalLM` checkpoint (config.json + model.safetensors) with
a tokenizer holding a small byte-level text vocabulary, the Llama-3 chat tokens, every LLaSA
control token and `<|s_0|>` ... `<|s_65535|>`. Its speech-token embeddings are given the
structure real ones have: X-codec2 tokens are points of an 8-dimensional, 4-level FSQ lattice,
so each token is embedded from its lattice coordinates (random Fourier features of a Gaussian
kernel, i.e. cos-similarity falls off with lattice distance). With the tied LM head this makes
the models' next-token distributions spread over lattice neighbourhoods, so acoustic
similarity groups are non-trivial and a draft disagrees more on exact tokens than on groups.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from pcgtts.runtime.vocab import CONTROL_TOKENS, NUM_SPEECH_TOKENS, SPEECH_GENERATION_END, speech_token

log = logging.getLogger(__name__)

NOT_SPEECH_NOTICE = "demo models have random weights: the audio is not speech"

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


@dataclass(frozen=True)
class DemoLMConfig:
    hidden_size: int = 256
    num_layers: int = 12
    num_heads: int = 4
    num_kv_heads: int = 2  # GQA, like every released LLaSA
    intermediate_size: int = 1536
    num_speech: int = NUM_SPEECH_TOKENS
    draft_layers: int = 2
    kernel_length: float = 0.9  # lattice distance scale of embedding similarity
    embed_scale: float = 1.6  # sets how peaked the distributions are: 1.6 gives ~4.8 nats, SD acceptance ~0.5
    stop_logit_bias: float = 0.35  # larger values end utterances sooner but make the draft disagree (stop mass)
    tie_word_embeddings: bool = True
    llama3_rope: bool = True


def fsq_coordinates(num_tokens: int) -> torch.Tensor:
    """Lattice coordinates of X-codec2 token indices: digit d of i in base 4, d = 0..7. [N, 8]"""
    idx = torch.arange(num_tokens)[:, None]
    return ((idx // 4 ** torch.arange(8)[None, :]) % 4).float()


def structured_speech_embeddings(num_tokens: int, hidden: int, kernel_length: float, scale: float,
                                 generator: torch.Generator) -> torch.Tensor:
    """Random Fourier features of the FSQ coordinates: E[i]·E[j] ≈ scale² exp(-|c_i - c_j|² / 2ℓ²). [N, H]"""
    coords = fsq_coordinates(num_tokens)
    omega = torch.randn(8, hidden, generator=generator) / kernel_length
    phase = torch.rand(hidden, generator=generator) * 2 * math.pi
    feats = torch.cos(coords @ omega + phase) * math.sqrt(2.0 / hidden)
    return feats * scale


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


def write_demo_lm(out_dir: str | Path, config: DemoLMConfig = DemoLMConfig(), seed: int = 0,
                  tokenizer=None) -> Path:
    """Write a LLaSA-format target checkpoint (random, structured weights) to `out_dir`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    tok = tokenizer or build_demo_tokenizer(config.num_speech)
    vocab = tok.get_vocab()
    rope = {"rope_type": "default", "rope_theta": 500000.0}
    if config.llama3_rope:
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf_config = LlamaConfig(
        vocab_size=len(tok), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.hidden_size // config.num_heads,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=rope,
        tie_word_embeddings=config.tie_word_embeddings, bos_token_id=vocab["<|begin_of_text|>"],
        eos_token_id=vocab[SPEECH_GENERATION_END],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_config).eval()
    gen = torch.Generator().manual_seed(seed)
    offset = vocab[speech_token(0)]
    emb = model.model.embed_tokens.weight.data
    speech = structured_speech_embeddings(config.num_speech, config.hidden_size, config.kernel_length,
                                          config.embed_scale, gen)
    # A direction shared by every speech token: the stop token's row points along it, so its
    # logit tracks the typical speech logit and the demo stops after a few seconds of audio.
    shared = torch.randn(config.hidden_size, generator=gen)
    shared = shared / shared.norm() * config.embed_scale
    emb[offset:offset + config.num_speech] = speech + 0.5 * shared
    emb[vocab[SPEECH_GENERATION_END]] = shared * (0.5 + config.stop_logit_bias)
    if not config.tie_word_embeddings:
        model.lm_head.weight.data.copy_(emb + 0.01 * torch.randn(emb.shape, generator=gen))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return out_dir


def write_demo(out_dir: str | Path, seed: int = 0, config: DemoLMConfig = DemoLMConfig(),
               with_codec: bool = True) -> dict[str, Path]:
    """Write `out_dir/target`, `out_dir/draft` (layer subset of the target) and `out_dir/codec`."""
    from pcgtts.runtime.draft import make_layer_subset_draft

    out_dir = Path(out_dir)
    paths = {"target": write_demo_lm(out_dir / "target", config, seed)}
    paths["draft"] = make_layer_subset_draft(paths["target"], out_dir / "draft", config.draft_layers)
    if with_codec:
        from pcgtts.runtime.demo_codec import write_demo_codec

        paths["codec"] = write_demo_codec(out_dir / "codec", seed=seed)
    log.warning("%s", NOT_SPEECH_NOTICE)
    return paths
