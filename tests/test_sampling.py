"""Temperature / top-p processing and the sampler (chi-square at significance 1e-4, seeded)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from pcgtts.runtime.config import SamplingConfig
from pcgtts.runtime.decode.sampling import logits_to_probs, sample, sample_from_weights


def test_temperature_and_top_p():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    probs = logits_to_probs(logits, SamplingConfig(temperature=0.5))
    torch.testing.assert_close(probs, torch.softmax(logits / 0.5, -1))
    nucleus = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    full = torch.softmax(logits, -1)  # [0.64, 0.24, 0.09, 0.03]: the top two reach 0.8
    torch.testing.assert_close(nucleus, torch.cat([full[:2] / full[:2].sum(), torch.zeros(2)]))
    tiny = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.01))
    assert tiny.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_greedy_one_hot_lowest_index_on_ties():
    probs = logits_to_probs(torch.tensor([[1.0, 3.0, 3.0]]), SamplingConfig(temperature=0.0))
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


def test_sampler_matches_distribution():
    """Chi-square goodness of fit over 100k draws; false-alarm rate 1e-4."""
    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    gen = torch.Generator().manual_seed(0)
    draws = sample(probs.expand(100_000, -1), gen)
    counts = torch.bincount(draws, minlength=5).double()
    assert counts[1] == 0
    keep = probs > 0
    assert chisquare(counts[keep].numpy(), (probs[keep] * 100_000).double().numpy()).pvalue > 1e-4
    assert chisquare(counts[keep].numpy(), torch.full((4,), 25_000.0).numpy()).pvalue < 1e-4


def test_zero_weights_never_chosen_even_at_edges():
    weights = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    for u in (0.0, 0.5, 1 - 2**-24):  # the largest float32 below 1, torch.rand's maximum
        assert sample_from_weights(weights, torch.full((3,), u)).tolist() == [1, 0, 2]


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}])
def test_bad_sampling_config(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)
