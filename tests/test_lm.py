"""The lean static-cache LLaMA against transformers' LlamaForCausalLM on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from pcgtts.runtime.lm.torch_lm import TorchLM, lay_out_for_cpu_steps

FEATURES = [
    {},  # GQA, tied head, llama3 rope (LLaSA-1B's layout)
    {"tie_word_embeddings": False},  # stored lm_head (LLaSA-8B's layout)
    {"num_kv_heads": 4},  # plain multi-head attention
    {"llama3_rope": False},
]


def hf_logits(model_dir, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids[None]).logits[0][:, rows]


@pytest.mark.parametrize("features", FEATURES, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "llasa1b")
def test_prefill_and_steps_match_transformers(tiny_lm_factory, features):
    model_dir = tiny_lm_factory(**features)
    lm = TorchLM.load(model_dir, max_length=64)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, lm.vocab.vocab_size, (40,), generator=gen)
    ref = hf_logits(model_dir, ids, lm.vocab.head_rows())
    torch.testing.assert_close(lm.prefill(ids[:25]), ref[24], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lm.forward(ids[25:26]), ref[25:26], atol=2e-5, rtol=1e-4)  # draft step
    torch.testing.assert_close(lm.forward(ids[26:30]), ref[26:30], atol=2e-5, rtol=1e-4)  # verify step
    assert lm.length == 30


def test_weights_laid_out_for_cpu_steps_still_match_transformers(tiny_lm_factory):
    # A compiled CPU LM's decoder weights are stored transposed (`lay_out_for_cpu_steps`): same values.
    model_dir = tiny_lm_factory()
    lm = TorchLM.load(model_dir, max_length=64)
    lay_out_for_cpu_steps(lm.model)
    weight = lm.model.layers[0].mlp.up_proj.weight
    assert weight.t().is_contiguous() and not weight.is_contiguous()
    ids = torch.randint(0, lm.vocab.vocab_size, (30,), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(model_dir, ids, lm.vocab.head_rows())
    torch.testing.assert_close(lm.prefill(ids[:25]), ref[24], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lm.forward(ids[25:30]), ref[25:30], atol=2e-5, rtol=1e-4)


def test_rollback_then_refeed_equals_fresh_computation(tiny_lm_factory):
    model_dir = tiny_lm_factory()
    lm = TorchLM.load(model_dir, max_length=64)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, lm.vocab.vocab_size, (30,), generator=gen)
    other = torch.randint(0, lm.vocab.vocab_size, (4,), generator=gen)
    lm.prefill(ids[:20])
    lm.forward(other)  # speculative tokens that get rejected
    lm.rollback(20)
    rolled = lm.forward(ids[20:30])
    fresh = TorchLM.load(model_dir, max_length=64)
    fresh.prefill(ids[:20])
    torch.testing.assert_close(rolled, fresh.forward(ids[20:30]), atol=1e-6, rtol=0)


def test_cache_limits_are_clear_errors(tiny_lm_factory):
    lm = TorchLM.load(tiny_lm_factory(), max_length=16)
    with pytest.raises(ValueError, match="exceeds the KV cache of 16"):
        lm.prefill(torch.zeros(17, dtype=torch.long))
    with pytest.raises(ValueError, match="empty prompt"):
        lm.prefill(torch.zeros(0, dtype=torch.long))
    lm.prefill(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="cannot roll back"):
        lm.rollback(6)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        TorchLM.load(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError):
        TorchLM.load(tmp_path)


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_steps_match_eager(tiny_lm_factory):
    model_dir = tiny_lm_factory()
    eager = TorchLM.load(model_dir, device="cuda", max_length=64, cuda_graphs=False)
    graphed = TorchLM.load(model_dir, device="cuda", max_length=64, cuda_graphs=True, graph_token_counts=(1, 4))
    ids = torch.randint(0, eager.vocab.vocab_size, (30,), device="cuda")
    for lm in (eager, graphed):
        lm.prefill(ids[:20])
    torch.testing.assert_close(graphed.forward(ids[20:21]), eager.forward(ids[20:21]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(graphed.forward(ids[21:25]), eager.forward(ids[21:25]), atol=1e-4, rtol=1e-4)
    for lm in (eager, graphed):
        lm.rollback(22)
    torch.testing.assert_close(graphed.forward(ids[22:26]), eager.forward(ids[22:26]), atol=1e-4, rtol=1e-4)
