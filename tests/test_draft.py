"""Layer-subset drafts: the checkpoint is a valid LLaSA model holding exactly the chosen layers."""

from __future__ import annotations

import json

import pytest
import torch

from pcgtts.train.subset_draft import make_layer_subset_draft, spread_layers
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


def test_used_codes_head_gives_zero_probability_elsewhere_and_stays_exact(tiny_lms, tmp_path):
    """`draft init --used-codes`: the draft's head covers only the codes that occur (+ stop), every
    other code gets probability 0; greedy speculation with it still equals plain greedy decoding."""
    import numpy as np
    import torch

    from pcgtts.cli import main
    from pcgtts.runtime.config import DecodeConfig, SamplingConfig
    from pcgtts.runtime.decode.loop import decode
    from pcgtts.runtime.decode.steps import DecodeStats
    from pcgtts.runtime.lm.torch_lm import TorchLM
    from pcgtts.runtime.text.prompt import build_prompt

    used = np.arange(0, 1024, 3)  # a third of the tiny vocabulary
    np.savez(tmp_path / "codes.npz", a=used[:200], b=used[150:])
    assert main(["train", "draft", "init", "--target", str(tiny_lms["target"]), "--layers", "2", "--out",
                 str(tmp_path / "draft"), "--used-codes", str(tmp_path / "codes.npz")]) == 0
    target = TorchLM.load(tiny_lms["target"], max_length=512)
    draft = TorchLM.load(tmp_path / "draft", max_length=512, tokenizer=target.tokenizer)
    assert draft.model.head.weight.shape[0] == len(used) + 1
    prompt = build_prompt(target.tokenizer, target.vocab, "Used codes only.")
    logits = draft.prefill(prompt)
    allowed = torch.zeros(target.vocab.restricted_size, dtype=torch.bool)
    allowed[torch.as_tensor(used)] = True
    allowed[-1] = True
    assert torch.isinf(logits[~allowed]).all() and torch.isfinite(logits[allowed]).all()
    (tmp_path / "draft" / "head_codes.npy").unlink()
    full = TorchLM.load(tmp_path / "draft", max_length=512, tokenizer=target.tokenizer)
    assert torch.allclose(full.prefill(prompt)[allowed], logits[allowed], atol=1e-5)

    def run(policy, lm):
        config = DecodeConfig(policy=policy, max_new_tokens=30, adaptive_draft=False,
                              sampling=SamplingConfig(temperature=0.0))
        return [t for b in decode(target, lm, prompt, config, torch.Generator(), stats=DecodeStats()) for t in b]

    np.save(tmp_path / "draft" / "head_codes.npy", np.append(used, 1024).astype(np.int32))
    sparse = TorchLM.load(tmp_path / "draft", max_length=512, tokenizer=target.tokenizer)
    assert run("sd", sparse) == run("ar", None)
