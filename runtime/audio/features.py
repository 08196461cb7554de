"""X-codec2's encoder inputs, computed without torchaudio.

transformers' `Xcodec2FeatureExtractor` computes Kaldi log-mel filterbanks through
`torchaudio.compliance.kaldi.fbank`, and torchaudio has no build for the torch this project
pins. This module computes the same features with plain torch ops: 80 mel bins, 25 ms povey
windows every 10 ms, pre-emphasis 0.97, DC removal, no dither, `snip_edges`, 20 Hz - 8 kHz,
log of the power mel energies; then per-utterance mean/variance normalisation and stacking of
frame pairs (160 dims at 50 Hz, one vector per codec token). Checked against torchaudio where
it is installed (tests/test_features.py).
"""

from __future__ import annotations

import math

import numpy as np
import torch

SAMPLE_RATE = 16000
HOP = 320
FRAME_LENGTH = 400  # 25 ms
FRAME_SHIFT = 160  # 10 ms
NUM_MEL_BINS = 80
PREEMPHASIS = 0.97
LOW_FREQ, HIGH_FREQ = 20.0, 8000.0
FFT_SIZE = 512  # next power of two above the frame length, as Kaldi pads


def _mel(freq: torch.Tensor) -> torch.Tensor:
    return 1127.0 * torch.log1p(freq / 700.0)


def mel_banks() -> torch.Tensor:
    """Kaldi's triangular filters on the mel scale over the FFT bins below Nyquist. [80, 257]"""
    num_fft_bins = FFT_SIZE // 2
    fft_bin_width = SAMPLE_RATE / FFT_SIZE
    mel_low, mel_high = _mel(torch.tensor(LOW_FREQ)), _mel(torch.tensor(HIGH_FREQ))
    delta = (mel_high - mel_low) / (NUM_MEL_BINS + 1)
    b = torch.arange(NUM_MEL_BINS, dtype=torch.float64)[:, None]
    left, centre, right = mel_low + b * delta, mel_low + (b + 1) * delta, mel_low + (b + 2) * delta
    mel = _mel(fft_bin_width * torch.arange(num_fft_bins, dtype=torch.float64))[None, :]
    up = (mel - left) / (centre - left)
    down = (right - mel) / (right - centre)
    banks = torch.clamp(torch.minimum(up, down), min=0.0)
    return torch.nn.functional.pad(banks, (0, 1)).float()  # the Nyquist bin gets weight 0


def kaldi_fbank(waveform: torch.Tensor) -> torch.Tensor:
    """Log-mel filterbank of a mono waveform already scaled like 16-bit PCM. [S] -> [frames, 80]"""
    if waveform.numel() < FRAME_LENGTH:
        raise ValueError(f"audio too short for one 25 ms frame ({waveform.numel()} samples)")
    frames = waveform.double().unfold(0, FRAME_LENGTH, FRAME_SHIFT)  # snip_edges: whole frames only
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)
    frames = frames - PREEMPHASIS * previous
    window = torch.hann_window(FRAME_LENGTH, periodic=False, dtype=torch.float64).pow(0.85)  # "povey"
    spectrum = torch.fft.rfft(frames * window, n=FFT_SIZE).abs().pow(2)
    energies = spectrum @ mel_banks().double().T
    return energies.clamp_min(torch.finfo(torch.float32).eps).log().float()


def encoder_inputs(samples: np.ndarray) -> dict[str, torch.Tensor]:
    """What `Xcodec2FeatureExtractor(audio, sampling_rate=16000)` returns, for one utterance.

    samples: float32 [N] at 16 kHz. The waveform gets one zero sample (the original code's
    right pad) and is padded to a multiple of the hop, giving T = N // 320 + 1 codes.
    """
    audio = torch.as_tensor(np.asarray(samples, dtype=np.float32))
    audio = torch.nn.functional.pad(audio, (0, 1))
    length = math.ceil(audio.numel() / HOP) * HOP
    padding_mask = (torch.arange(length) < audio.numel()).long()[None]
    audio = torch.nn.functional.pad(audio, (0, length - audio.numel()))
    feats = kaldi_fbank(torch.nn.functional.pad(audio, (HOP // 2, HOP // 2)) * 2**15)
    feats = (feats - feats.mean(0)) / torch.sqrt(feats.var(0, unbiased=True) + 1e-7)
    frames = feats.shape[0] - feats.shape[0] % 2
    stacked = feats[:frames].reshape(1, frames // 2, 2 * NUM_MEL_BINS)
    return {
        "input_values": audio[None, None],
        "padding_mask": padding_mask,
        "input_features": stacked,
        "input_features_mask": torch.ones(1, frames // 2, dtype=torch.long),
    }
