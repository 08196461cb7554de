"""A tiny X-codec2 checkpoint in the Hugging Face (`HKUSTAudio/xcodec2-hf`) layout.

RANDOM WEIGHTS: it encodes and decodes with the real transformers `Xcodec2Model` code and
the real file format, at the real rates (16 kHz, 320 samples per token, 65,536 codes), but
what it decodes is not speech.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


def demo_codec_config():
    from transformers import Wav2Vec2BertConfig, Xcodec2Config

    semantic = Wav2Vec2BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  feature_projection_input_dim=160, output_hidden_size=32,
                                  conv_depthwise_kernel_size=5, add_adapter=False)
    # quantization_dim = decoder hidden + semantic hidden, as in the released model (1024 + 1024).
    return Xcodec2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=32, encoder_hidden_size=8,
                         semantic_model_config=semantic.to_dict(), quantization_dim=96)


# What the released repository's preprocessor_config.json holds (Xcodec2FeatureExtractor).
PREPROCESSOR = {"feature_extractor_type": "Xcodec2FeatureExtractor", "feature_size": 80, "hop_length": 320,
                "padding_side": "right", "padding_value": 1.0, "return_attention_mask": True,
                "sampling_rate": 16000}


def write_demo_codec(out_dir: str | Path, seed: int = 0) -> Path:
    from transformers import Xcodec2Model

    out_dir = Path(out_dir)
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG
        torch.manual_seed(seed)
        model = Xcodec2Model(demo_codec_config()).eval()
    with torch.no_grad():
        # Random init decodes to ~-46 dBFS; lift the ISTFT magnitudes so the demo is audible.
        head = model.acoustic_decoder.head.linear
        head.bias[: head.out_features // 2] += math.log(20.0)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    (out_dir / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    return out_dir
