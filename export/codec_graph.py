"""`pcgtts export codec`: the X-codec2 decoder (codes -> waveform) as an ONNX graph.

    codes  [1, N] int64 in [0, 65536)  ->  audio [1, 320 N] float32 at 16 kHz   (N dynamic)

The decoder is transformers' own `Xcodec2Quantizer.from_codes` + `Xcodec2Decoder`, except its
ISTFT head: that one builds a complex spectrum and calls `irfft`, which the ONNX exporter
cannot express. `RealIstftHead` computes the same thing in real arithmetic: the inverse real
DFT as two matmuls with fixed cosine/sine bases, then windowed overlap-add as r = n_fft/hop
shifted adds (x-codec2 uses n_fft = 4 hop), then the same window-envelope normalisation and
"same" trimming. The export is checked against the torch decoder before it is kept.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

from pcgtts.export.noise import held_back
from pcgtts.export.onnx_common import OPSET, export_graph, staged_output
from pcgtts.runtime.audio.onnx_codec import CODEC_META, OrtCodec

CODEC_GRAPH = "codec_decoder.onnx"


def overlap_add(frames: torch.Tensor, hop: int) -> torch.Tensor:
    """frames: [B, F, n_fft] with n_fft = r * hop -> [B, (F + r - 1) * hop]."""
    b, f, n_fft = frames.shape
    r = n_fft // hop
    parts = frames.reshape(b, f, r, hop)
    out = sum(F.pad(parts[:, :, j], (0, 0, j, r - 1 - j)) for j in range(r))  # [B, F + r - 1, hop]
    return out.reshape(b, -1)


class RealIstftHead(nn.Module):
    def __init__(self, head: nn.Module):
        super().__init__()
        n_fft, hop = head.n_fft, head.hop_length
        if n_fft % hop:
            raise ValueError(f"n_fft ({n_fft}) must be a multiple of hop_length ({hop})")
        self.linear, self.n_fft, self.hop, self.padding = head.linear, n_fft, hop, head.padding
        bins = n_fft // 2 + 1
        k = torch.arange(bins, dtype=torch.float64)[:, None]
        n = torch.arange(n_fft, dtype=torch.float64)[None, :]
        # irfft (norm="backward") of a one-sided spectrum: bins 1..N/2-1 count twice, the
        # imaginary parts of DC and Nyquist are ignored, everything divided by N.
        weight = torch.full((bins, 1), 2.0, dtype=torch.float64)
        weight[0] = weight[-1] = 1.0
        angle = 2 * math.pi * k * n / n_fft
        self.register_buffer("cos_basis", (weight * torch.cos(angle) / n_fft).float(), persistent=False)
        self.register_buffer("sin_basis", (-weight * torch.sin(angle) / n_fft).float(), persistent=False)
        self.register_buffer("window", head.window.float().clone(), persistent=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        magnitude, phase = self.linear(hidden_states).float().chunk(2, dim=-1)  # [B, F, bins] each
        magnitude = torch.exp(magnitude).clamp(max=1e2)
        frames = (magnitude * torch.cos(phase)) @ self.cos_basis + (magnitude * torch.sin(phase)) @ self.sin_basis
        audio = overlap_add(frames * self.window, self.hop)
        num_frames = frames.shape[1]
        envelope = overlap_add(self.window.square().expand(1, num_frames, -1), self.hop)[0]
        audio = audio / envelope.clamp(min=1e-11)
        return audio[:, self.padding:audio.shape[1] - self.padding].unsqueeze(1)


class CodecDecodeGraph(nn.Module):
    def __init__(self, quantizer: nn.Module, decoder: nn.Module):
        super().__init__()
        self.quantizer = quantizer
        self.decoder = copy.copy(decoder)  # shallow: shares every weight, only the head is swapped
        self.decoder._modules = dict(decoder._modules)
        self.decoder.head = RealIstftHead(decoder.head)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        latents = self.quantizer.from_codes(codes.unsqueeze(-1))  # [1, N, D]
        return self.decoder(latents)[:, 0]  # [1, 320 N]


def export_codec(codec_dir: str | Path, out_dir: str | Path, *, check: bool = True, tolerance: float = 1e-3) -> dict:
    from pcgtts.runtime.audio.codec import Codec

    codec_dir, out_dir = Path(codec_dir), Path(out_dir)
    codec = Codec.from_pretrained(codec_dir, decode_only=True)
    graph = CodecDecodeGraph(codec.quantizer, codec.decoder).eval()
    example = (torch.randint(0, 65536, (1, 12)),)
    meta = {"format": "pcgtts-codec", "version": 1, "graph": CODEC_GRAPH, "sample_rate": Codec.sample_rate,
            "samples_per_token": Codec.samples_per_token, "opset": OPSET, "source": str(codec_dir)}
    with held_back("export"), staged_output(out_dir) as stage:
        export_graph(graph, example, stage / CODEC_GRAPH, ["codes"], ["audio"],
                     ({1: torch.export.Dim("tokens", min=1)},))
        if check:
            codes = np.random.default_rng(0).integers(0, 65536, 75)
            diff = float(np.abs(codec.decode(codes) - OrtCodec(stage, meta).decode(codes)).max())
            meta["check"] = {"tokens": len(codes), "max_abs_diff": diff, "tolerance": tolerance, "ok": diff <= tolerance}
            if not meta["check"]["ok"]:
                raise RuntimeError(f"exported codec decoder differs from PyTorch by {diff:.3g} "
                                   f"(tolerance {tolerance:.3g}); nothing was written")
        (stage / CODEC_META).write_text(json.dumps(meta, indent=2) + "\n")
    return meta
