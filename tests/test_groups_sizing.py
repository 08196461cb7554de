"""Group tables sized for the target (groups/build.py): estimate before building, refuse past a
memory budget, choose theta by a target mean group size, cap group size. On clustered
embeddings, where a fixed theta of 0.40 puts a whole cluster (a quarter of the vocabulary)
in every group."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pcgtts.groups.build import build_groups, estimate_groups, neighbour_lists, theta_for_mean_size

N, H, CLUSTERS = 2048, 32, 4


@pytest.fixture(scope="module")
def clustered() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(CLUSTERS, H, generator=g)
    labels = torch.arange(N) % CLUSTERS
    return centers[labels] + 0.35 * torch.randn(N, H, generator=g)


def mean_size(offsets: np.ndarray) -> float:
    return float(np.diff(offsets).mean())


def test_fixed_theta_makes_huge_groups_and_the_estimate_says_so(clustered):
    offsets, _ = neighbour_lists(clustered, 0.40, progress=False)
    actual = mean_size(offsets)
    assert actual > 0.2 * N  # the failure mode: groups of a whole cluster
    est = estimate_groups(clustered, 0.40, sample_rows=256)
    assert est["mean_group_size"] == pytest.approx(actual, rel=0.1)
    assert est["entries"] == pytest.approx(actual * N, rel=0.1) and est["build_bytes"] > est["entries"]


def test_build_refuses_past_the_budget_with_the_estimate_and_the_fix(clustered):
    with pytest.raises(ValueError, match=r"~\d+ members on average.*--mean-size"):
        build_groups(clustered, 0.40, progress=False, max_bytes=10 * 2**20)
    # Capped, the same theta fits the same budget.
    table = build_groups(clustered, 0.40, top_k=16, progress=False, max_bytes=10 * 2**20)
    assert table.stats["max_group_size"] <= 16


@pytest.mark.parametrize("target", [20.0, 140.0])
def test_theta_by_mean_size(clustered, target):
    theta = theta_for_mean_size(clustered, target)
    assert theta > 0.40  # a much tighter threshold than the paper's fixed one
    offsets, _ = neighbour_lists(clustered, theta, progress=False)
    assert mean_size(offsets) == pytest.approx(target, rel=0.25)
    capped = theta_for_mean_size(clustered, target, top_k=int(target) + 40)
    assert mean_size(neighbour_lists(clustered, capped, top_k=int(target) + 40, progress=False)[0]) == \
        pytest.approx(target, rel=0.25)


def test_bad_sizes():
    emb = torch.randn(64, 8)
    with pytest.raises(ValueError, match=">= 1"):
        theta_for_mean_size(emb, 0.5)
    with pytest.raises(ValueError, match="cannot exceed the cap"):
        theta_for_mean_size(emb, 30, top_k=10)
