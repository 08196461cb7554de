"""Layer-subset drafts: the checkpoint is a valid LLaSA model holding exactly the chosen layers."""

from __future__ import annotations

import json

import pytest
import torch

from pcgtts.runtime.lm.draft import make_layer_subset_draft, spread_layers
from pcgtts.runtime.lm.torch_lm import TorchLM


def test_spread_layers():
    assert spread_layers(16, 3) == [0, 8, 15]
    assert spread_layers(12, 2) == [0, 11]
    assert spread_layers(5, 1) == [0]
    with pytest.raises(ValueError):
        spread_layers(4, 5)


def test_draft_with_all_layers_equals_target(tiny_lm_factory, tmp_path):
    target_dir = tiny_lm_factory()
    draft_dir = make_layer_subset_draft(target_dir, tmp_path / "draft", [0, 1, 2])
    target, draft = TorchLM.load(target_dir, max_length=32), TorchLM.load(draft_dir, max_length=32)
    ids = torch.arange(10) + 300
    torch.testing.assert_close(draft.prefill(ids), target.prefill(ids), atol=0, rtol=0)


def test_draft_keeps_the_chosen_layers(tiny_lm_factory, tmp_path):
    target_dir = tiny_lm_factory()
    draft_dir = make_layer_subset_draft(target_dir, tmp_path / "draft", 2)
    cfg = json.loads((draft_dir / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["pcgtts_draft"]["layers"] == [0, 2]
    target, draft = TorchLM.load(target_dir, max_length=32), TorchLM.load(draft_dir, max_length=32)
    assert draft.vocab == target.vocab
    torch.testing.assert_close(draft.model.layers[1].mlp.up_proj.weight, target.model.layers[2].mlp.up_proj.weight)
    with pytest.raises(ValueError):
        make_layer_subset_draft(target_dir, tmp_path / "bad", [0, 3])
