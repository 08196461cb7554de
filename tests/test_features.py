"""Our torch Kaldi fbank against torchaudio's, where torchaudio is installed (not on CPU CI:
torchaudio has no build for torch 2.13; it runs on the GPU machine, see BENCHMARKS.md)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from pcgtts.runtime.audio.features import NUM_MEL_BINS, encoder_inputs, kaldi_fbank

HAS_TORCHAUDIO = importlib.util.find_spec("torchaudio") is not None


def speechlike(seconds: float = 1.3, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    voiced = sum(np.sin(2 * np.pi * f * t) / k for k, f in enumerate((140, 280, 420, 1200, 2500), 1))
    return (0.2 * voiced * (1 + np.sin(2 * np.pi * 3 * t)) + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


def test_tone_lands_in_the_right_mel_bin():
    tone = torch.tensor(np.sin(2 * np.pi * 1000 * np.arange(16000) / 16000), dtype=torch.float32) * 1e4
    feats = kaldi_fbank(tone)
    # Kaldi's mel scale: mel(1000 Hz) = 1000; bins are spaced (mel(8000) - mel(20)) / 81 apart.
    assert feats.shape == (98, NUM_MEL_BINS) and int(feats.mean(0).argmax()) == 27


def test_encoder_input_shapes_follow_the_extractor_formula():
    for n in (16000, 16319, 16320, 8001):
        inputs = encoder_inputs(np.zeros(n, np.float32) + 0.01)
        t = (n + 1 + 319) // 320
        assert inputs["input_values"].shape == (1, 1, 320 * t)
        assert inputs["input_features"].shape == (1, t, 160)
        assert int(inputs["padding_mask"].sum()) == n + 1


@pytest.mark.skipif(not HAS_TORCHAUDIO, reason="torchaudio not installed (no build for this torch)")
def test_matches_torchaudio_kaldi_fbank():
    import torchaudio

    wave = torch.tensor(speechlike()) * 2**15
    ours = kaldi_fbank(wave)
    ref = torchaudio.compliance.kaldi.fbank(wave[None], num_mel_bins=80, frame_length=25.0, frame_shift=10.0,
                                            sample_frequency=16000, window_type="povey", preemphasis_coefficient=0.97,
                                            remove_dc_offset=True, use_log_fbank=True, use_energy=False, dither=0.0,
                                            snip_edges=True, low_freq=20, high_freq=8000)
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-3)


@pytest.mark.skipif(not HAS_TORCHAUDIO, reason="torchaudio not installed (no build for this torch)")
def test_matches_the_transformers_feature_extractor():
    from transformers import Xcodec2FeatureExtractor

    audio = speechlike(1.7)
    ref = Xcodec2FeatureExtractor()(audio, sampling_rate=16000, return_tensors="pt")
    ours = encoder_inputs(audio)
    for key in ("input_values", "padding_mask", "input_features_mask"):
        assert torch.equal(ours[key].to(ref[key].dtype), ref[key]), key
    torch.testing.assert_close(ours["input_features"], ref["input_features"], atol=2e-3, rtol=1e-3)
