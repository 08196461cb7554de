"""X-codec2 through transformers' `Xcodec2Model`, from a local Hugging Face-format directory.

Decode-only mode (the default: synthesis only decodes) builds just the quantizer and the
decoder and loads their weights from the safetensors, so the 600M-parameter semantic
encoder (wav2vec2-bert) and the acoustic encoder are never in memory. Encoding (voices)
loads the whole model and uses our torch reimplementation of its feature extractor
(`runtime/audio/features.py`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from pcgtts.runtime.audio.chunk import SAMPLE_RATE, SAMPLES_PER_TOKEN

log = logging.getLogger(__name__)

_DECODER_PREFIXES = ("quantizer.", "acoustic_decoder.")


@contextlib.contextmanager
def quiet_loading():
    """transformers without its "Loading weights" progress bar and INFO chatter for the block (a
    reference encode loads the full codec each time a server or a command starts one)."""
    from transformers.utils import logging as hf_logging

    bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _read_config(codec_dir: Path):
    from transformers import Xcodec2Config

    if not codec_dir.is_dir():
        raise FileNotFoundError(f"codec directory not found: {codec_dir}")
    path = codec_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{codec_dir} is not an X-codec2 checkpoint: no config.json")
    cfg = json.loads(path.read_text())
    if cfg.get("model_type") != "xcodec2":
        raise ValueError(f"{codec_dir} is not an X-codec2 (Hugging Face format) checkpoint: "
                         f"model_type={cfg.get('model_type')!r}")
    return Xcodec2Config.from_pretrained(str(codec_dir))


@runtime_checkable
class SpeechCodec(Protocol):
    """What the runtime needs from a speech codec, whatever runs it (torch here, `OrtCodec`)."""

    sample_rate: int  # 16,000 for X-codec2
    samples_per_token: int  # 320: one token is 20 ms of audio, the streaming decoder's window step
    source_dir: Path  # the folder it was loaded from (an encoder is loaded from there on demand)

    @property
    def can_encode(self) -> bool: ...

    def encode(self, samples: np.ndarray) -> np.ndarray: ...  # float32 [N] mono 16 kHz -> int64 codes [T]

    def decode(self, codes) -> np.ndarray: ...  # int codes [T] -> float32 samples [320 T]

    def decode_batch(self, codes) -> np.ndarray:
        """int codes [B, T] -> float32 samples [B, 320 T] (several streams' windows of one length at
        once, `runtime/audio/codec_batch.py`); by default window by window."""
        return np.stack([self.decode(row) for row in np.asarray(codes)])


class Codec:
    """X-codec2 on torch: decode(codes [T]) -> float32 samples [320 T]; encode(samples) -> codes [T]
    when loaded with the encoder (`decode_only=False`)."""

    sample_rate = SAMPLE_RATE
    samples_per_token = SAMPLES_PER_TOKEN

    def __init__(self, quantizer: torch.nn.Module, decoder: torch.nn.Module, source_dir: str | Path,
                 full=None, device="cpu"):
        self.quantizer, self.decoder, self.full = quantizer, decoder, full
        self.source_dir = Path(source_dir)
        self.device = torch.device(device)

    @classmethod
    def from_pretrained(cls, codec_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                        decode_only: bool = True) -> "Codec":
        from transformers import Xcodec2Model
        from transformers.models.xcodec2.modeling_xcodec2 import Xcodec2Decoder, Xcodec2Quantizer

        codec_dir = Path(codec_dir)
        config = _read_config(codec_dir)
        if not decode_only:
            with quiet_loading():
                model = Xcodec2Model.from_pretrained(str(codec_dir), dtype=dtype).to(device).eval()
            return cls(model.quantizer, model.acoustic_decoder, codec_dir, model, device)
        from safetensors import safe_open

        weights = codec_dir / "model.safetensors"
        if not weights.is_file():
            raise ValueError(f"{codec_dir} has no model.safetensors")
        # The standalone decoder must dispatch attention like the full model does (SDPA).
        config._attn_implementation = "sdpa"
        quantizer, decoder = Xcodec2Quantizer(config), Xcodec2Decoder(config)
        state = {}
        with safe_open(str(weights), framework="pt") as f:
            for key in f.keys():
                if key.startswith(_DECODER_PREFIXES):
                    state[key] = f.get_tensor(key)
        for prefix, module in zip(_DECODER_PREFIXES, (quantizer, decoder)):
            part = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            missing, unexpected = module.load_state_dict(part, strict=False)
            if missing:
                raise ValueError(f"{codec_dir}: checkpoint lacks decoder weights {missing[:4]}")
        return cls(quantizer.to(device, dtype).eval(), decoder.to(device, dtype).eval(), codec_dir, None, device)

    @property
    def can_encode(self) -> bool:
        return self.full is not None

    def decode(self, codes) -> np.ndarray:
        """codes: int [T] in [0, 65536) -> float32 [320 T] at 16 kHz."""
        return self.decode_batch(np.asarray(codes).reshape(1, -1))[0]

    @torch.inference_mode()
    def decode_batch(self, codes) -> np.ndarray:
        """codes: int [B, T] in [0, 65536) -> float32 [B, 320 T] at 16 kHz, in one forward (a window
        decoded beside others differs from it decoded alone in the last float bits)."""
        codes = torch.as_tensor(np.asarray(codes), dtype=torch.long, device=self.device)
        if codes.dim() != 2:
            raise ValueError(f"decode_batch takes codes [B, T], got shape {tuple(codes.shape)}")
        if codes.numel() == 0:
            return np.zeros((codes.shape[0], 0), np.float32)
        if int(codes.min()) < 0 or int(codes.max()) >= 65536:
            raise ValueError("codec indices must lie in [0, 65536)")
        latents = self.quantizer.from_codes(codes.unsqueeze(-1))  # [B, T, D]
        audio = self.decoder(latents)  # [B, 1, 320 T]
        return audio[:, 0].float().cpu().numpy()

    @torch.inference_mode()
    def encode(self, samples: np.ndarray) -> np.ndarray:
        """float32 [N] mono 16 kHz -> int64 codes [N // 320 + 1]."""
        if not self.can_encode:
            raise ValueError("this codec was loaded decode-only; load it with decode_only=False to encode audio")
        from pcgtts.runtime.audio.features import encoder_inputs

        inputs = {k: v.to(self.device) for k, v in encoder_inputs(samples).items()}
        dtype = next(self.full.parameters()).dtype
        out = self.full.encode(inputs["input_values"].to(dtype), inputs["input_features"].to(dtype),
                               padding_mask=inputs["padding_mask"],
                               input_features_mask=inputs["input_features_mask"])
        return out.audio_codes[0, 0].long().cpu().numpy()

    def num_parameters(self) -> int:
        modules = [self.full] if self.full is not None else [self.quantizer, self.decoder]
        return sum(p.numel() for m in modules for p in m.parameters())
