"""Table 2's swap operator and Table 3's mel features, on a tiny hand-made group table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pcgtts.groups.table import GroupTable
from pcgtts.quality.melgroups import matching_theta, mean_neighbours
from pcgtts.quality.swap import shares_group, swap_tokens


@pytest.fixture
def table():
    # 12 tokens: overlapping groups {0,1,2}, {2,3}, {4,5,6,7}, {7,8}; 9, 10, 11 are singletons.
    groups = [[0, 1, 2], [2, 3], [4, 5, 6, 7], [7, 8], [9], [10], [11]]
    offsets = np.concatenate([[0], np.cumsum([len(g) for g in groups])])
    return GroupTable.from_groups_csr(offsets, np.concatenate(groups), 12, theta=0.5)


def test_group_swaps_stay_inside_a_group(table):
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 9, size=400)  # tokens that all have another group member
    swapped, mask = swap_tokens(codes, table, 1.0, "group", rng)
    assert mask.all()  # every token had an alternative, so every position changed
    for a, b in zip(codes, swapped):
        assert shares_group(table, a, b), (a, b)
    # token 2 sits in two groups: both neighbourhoods are reached (K ~ uniform over S(2))
    assert {1, 3} <= set(swapped[codes == 2].tolist()) | {0}


def test_group_swaps_leave_singletons_and_respect_the_fraction(table):
    rng = np.random.default_rng(1)
    codes = np.array([9, 10, 11] * 20)
    swapped, mask = swap_tokens(codes, table, 1.0, "group", rng)
    assert not mask.any() and (swapped == codes).all()
    codes = rng.integers(0, 9, size=200)
    _, mask = swap_tokens(codes, table, 0.25, "group", rng)
    assert mask.sum() == 50  # exactly round(p * n) positions drawn, each with an alternative
    _, mask = swap_tokens(codes, table, 0.0, "group", rng)
    assert not mask.any()


def test_random_swaps_leave_the_group(table):
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 12, size=2000)
    swapped, mask = swap_tokens(codes, table, 1.0, "random", rng)
    assert mask.all() and swapped.min() >= 0 and swapped.max() < 12
    outside = np.mean([not shares_group(table, a, b) for a, b in zip(codes, swapped)])
    assert outside > 0.6  # random replacements mostly land outside the token's groups


def test_swap_rejects_bad_input(table):
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError):
        swap_tokens(np.array([1, 2]), table, 1.5, "group", rng)
    with pytest.raises(ValueError):
        swap_tokens(np.array([1, 2]), table, 0.5, "nearby", rng)
    with pytest.raises(ValueError):
        swap_tokens(np.array([1, 12]), table, 0.5, "group", rng)


def test_matching_theta_reaches_the_requested_group_size():
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(600, 16, generator=gen)
    sample = np.arange(0, 600, 3)
    for target in (1.0, 5.0, 20.0):
        theta = matching_theta(features, target, sample)
        assert mean_neighbours(features, theta, sample) == pytest.approx(target, abs=0.05)


def test_token_mel_features_of_the_demo_codec(demo_codec_dir):
    from pcgtts.quality.melgroups import token_mel_features
    from pcgtts.runtime.audio.codec import Codec

    codec = Codec.from_pretrained(demo_codec_dir)
    feats = token_mel_features(codec, 64, repeat=3, batch=32)
    assert feats.shape == (64, 40) and torch.isfinite(feats).all()
    assert torch.allclose(feats.mean(0), torch.zeros(40), atol=1e-4)  # centred
    # an uncentred row equals librosa's log-mel of that token decoded on its own by the public decode
    import librosa

    audio = codec.decode([5, 5, 5])
    mel = librosa.feature.melspectrogram(y=audio, sr=16000, n_fft=512, hop_length=160, win_length=400,
                                         n_mels=40, power=2.0, center=True, pad_mode="reflect")
    expected = torch.as_tensor(np.log(mel + 1e-8).mean(1), dtype=torch.float32)
    raw = token_mel_features(codec, 8, repeat=3, batch=8, centre=False)
    assert torch.allclose(raw[5], expected, atol=1e-3), (raw[5] - expected).abs().max()
    assert not torch.allclose(raw[5], raw[6], atol=1e-3)  # different tokens sound different
