"""The cheap proposal head for a large dense speech head (runtime/lm/proposal_head.py): its candidates
carry the head's own scores, it is the same on every load, and an EAGLE draft proposing through it on
an int8 target keeps greedy speculation equal to greedy decoding and sampling exact in distribution."""

from __future__ import annotations

import pytest
import torch

from pcgtts.runtime.config import SamplingConfig
from pcgtts.runtime.decode.proposers import EagleProposer
from pcgtts.runtime.lm import int8, proposal_head
from pcgtts.runtime.lm.int8 import Int8Linear, is_quantized
from pcgtts.runtime.lm.proposal_head import ProposalHead
from pcgtts.runtime.lm.torch_lm import TorchLM
from pcgtts.runtime.text.prompt import build_prompt

from helpers import assert_same_marginal, decode_codes as run, random_draft, third_codes


def _head(rows=4096, width=96, rank=12, seed=0):
    """A head like a trained one: a few strong directions plus noise."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, rank, generator=gen) @ torch.randn(rank, width, generator=gen)
            + 0.1 * torch.randn(rows, width, generator=gen))


@pytest.mark.parametrize("form", ["float", "int8"])
def test_candidates_carry_the_head_s_own_scores_and_the_rest_are_impossible(form):
    weight = _head()
    if form == "int8":
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight.data.copy_(weight)
        layer = Int8Linear(linear, keep_rows=True)
        head, full_head = ProposalHead(layer.rows, layer.row_scales, candidates=256), layer  # scored as the layer does
    else:
        head, full_head = ProposalHead(weight, candidates=256), lambda f: weight @ f
    states = torch.randn(20, weight.shape[1], generator=torch.Generator().manual_seed(1))
    for f in states:
        with torch.inference_mode():
            scores, full = head(f), full_head(f)
        kept = torch.isfinite(scores)
        assert int(kept.sum()) == 256 and bool((scores[~kept] == float("-inf")).all())
        exact = form == "float" or full_head.kernel == "onednn"  # fbgemm's own grid differs from the head's
        tolerance = {} if exact else {"rtol": 0.05, "atol": 0.05 * float(full.abs().max())}
        torch.testing.assert_close(scores[kept], full[kept], **tolerance)
        assert int(scores.argmax()) == int(full.argmax())  # the preview finds the head's best token
    with torch.inference_mode():  # several drafts' rows at once (a batch's proposals): each as alone
        together = head(states[:9])
    for f, row in zip(states[:9], together):
        with torch.inference_mode():
            alone = head(f)
        assert torch.equal(torch.isfinite(row), torch.isfinite(alone))
        torch.testing.assert_close(row, alone)


def test_the_factor_is_the_same_on_every_load_and_small_heads_are_read_whole():
    weight = _head()
    a, b = ProposalHead(weight), ProposalHead(weight)
    assert torch.equal(a.down, b.down) and torch.equal(a.up, b.up)
    assert not ProposalHead.worth_it(65536, 256) and ProposalHead.worth_it(65536, 2048)


@pytest.fixture()
def int8_target(tiny_lms, monkeypatch):
    """The tiny dense-head target in int8, its layers (and its EAGLE draft's) all int8 on the large-layer
    kernel, with a proposal head that keeps only 16 candidates (a fresh load: the proposal head is made
    once per model)."""
    monkeypatch.setattr(int8, "ONEDNN_MIN_WEIGHTS", 0)
    monkeypatch.setattr(proposal_head, "MIN_HEAD_SIZE", 0)
    monkeypatch.setattr(proposal_head, "CANDIDATES", 16)
    target = TorchLM.load(tiny_lms["target"], max_length=256, quantize="int8")
    assert not target.model.digits
    return target


def _proposer(target, block="attention"):
    proposer = EagleProposer.from_draft(random_draft(target, block=block), target)
    assert is_quantized(proposer.step.draft) and isinstance(proposer.step.head, ProposalHead)
    assert proposer.step.head.candidates == 16
    return proposer


def test_a_float_target_s_host_eagle_step_proposes_through_the_cheap_head_too(tiny_lms, tiny_groups, monkeypatch):
    """An attention-free draft on a float32 CPU target steps in NumPy (`HostEagleStep`); greedy
    speculation through the cheap head still equals greedy decoding."""
    from pcgtts.runtime.lm.eagle import HostEagleStep

    monkeypatch.setattr(proposal_head, "MIN_HEAD_SIZE", 0)
    monkeypatch.setattr(proposal_head, "CANDIDATES", 16)
    target = TorchLM.load(tiny_lms["target"], max_length=256)
    proposer = EagleProposer.from_draft(random_draft(target, block="mlp"), target)
    assert isinstance(proposer.step, HostEagleStep) and isinstance(proposer.step.proposal_head, ProposalHead)
    prompt = build_prompt(target.tokenizer, target.vocab, "A cheap head test sentence.")
    reference, _ = run(target, proposer, prompt, "ar", SamplingConfig(temperature=0.0))
    output, stats = run(target, proposer, prompt, "eagle-pcg", SamplingConfig(temperature=0.0), groups=tiny_groups)
    assert output == reference and stats.drafted > 0


@pytest.mark.parametrize("block", ["attention", "mlp"])
def test_greedy_eagle_through_the_cheap_head_equals_plain_greedy(int8_target, tiny_groups, block):
    proposer = _proposer(int8_target, block)
    prompt = build_prompt(int8_target.tokenizer, int8_target.vocab, "A cheap head test sentence.")
    reference, _ = run(int8_target, proposer, prompt, "ar", SamplingConfig(temperature=0.0))
    for policy in ("eagle-sd", "eagle-pcg"):
        output, stats = run(int8_target, proposer, prompt, policy, SamplingConfig(temperature=0.0), groups=tiny_groups)
        assert output == reference, policy
        assert stats.drafted > 0


@pytest.mark.slow  # 3,000 decodes
def test_eagle_sd_through_the_cheap_head_is_exact_in_distribution(int8_target):
    """The 3rd generated code's marginal under eagle-sd (two proposals from a 16-candidate head) equals
    plain AR sampling's: two-sample chi-square over the 8 most frequent codes + the rest pooled, 1,500
    runs each, significance 1e-3 (false-alarm rate 0.1 %; seeds fixed: deterministic)."""
    proposer = _proposer(int8_target)
    short = build_prompt(int8_target.tokenizer, int8_target.vocab, "A cheap head test sentence.")[-6:]
    ar = third_codes(int8_target, proposer, short, "ar", 31)
    assert_same_marginal(ar, third_codes(int8_target, proposer, short, "eagle-sd", 32))
