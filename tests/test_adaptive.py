"""Adaptive draft length in the decode loop (DecodeConfig.adaptive_draft), on tiny real models.

Costs are given (not measured) so every figure is counted by the cost model, not wall time:
a useless draft must stay within 5 % of AR's cost, a draft equal to the target must get a long
L, greedy output must equal plain greedy for every L, and a seeded run must be reproducible.
Also the rules' sync-free path (the one non-CPU devices take) is checked for exactness here on
the CPU, since the CPU path now computes the residual only for rejected rows.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

import pcgtts.runtime.decode.acceptance as acceptance
from pcgtts.groups.device import DeviceGroupTable
from pcgtts.runtime.config import DecodeConfig, SamplingConfig
from pcgtts.runtime.decode.cost_model import StepCosts, counted_seconds
from pcgtts.runtime.decode.loop import decode
from pcgtts.runtime.decode.planning import measure_acceptance
from pcgtts.runtime.decode.steps import DecodeStats

CPU = StepCosts(target_forward=(1.0, 1.5, 2.0, 2.5, 3.0), draft_forward=(0.45, 0.55, 0.65, 0.75, 0.85),
                rule=0.03, sample=0.02)
CHEAP = StepCosts(target_forward=(1.0, 1.02, 1.04, 1.06, 1.08), draft_forward=(0.1, 0.101, 0.102, 0.103, 0.104),
                  rule=0.01, sample=0.01)
L_MAX = 4


@pytest.fixture(scope="module")
def models(tiny_lm_factory):
    from pcgtts.runtime.lm.checkpoint import load_tokenizer
    from pcgtts.runtime.lm.torch_lm import TorchLM

    path = tiny_lm_factory()
    tok = load_tokenizer(path)
    target = TorchLM.load(path, max_length=1024, tokenizer=tok)
    same = TorchLM.load(path, max_length=1024, tokenizer=tok)
    useless = TorchLM.load(path, max_length=1024, tokenizer=tok)
    with torch.no_grad():  # a deliberately useless draft: its head is random
        head = useless.model.head.weight
        head.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(3)) * head.std())
    prompt = torch.tensor(tok("hello there, speech")["input_ids"], dtype=torch.long)
    return target, same, useless, prompt


def run(target, draft, prompt, policy="sd", *, adaptive=True, length=L_MAX, temperature=1.0, tokens=160,
        costs=CPU, seed=0, acceptance=None):
    config = DecodeConfig(policy=policy, draft_length=length, adaptive_draft=adaptive, max_new_tokens=tokens,
                          sampling=SamplingConfig(temperature=temperature))
    stats = DecodeStats()
    out = [t for burst in decode(target, draft, prompt, config, torch.Generator().manual_seed(seed), stats=stats,
                                 costs=costs, acceptance=acceptance) for t in burst]
    return out, stats


def cost_per_token(stats: DecodeStats, costs: StepCosts) -> float:
    return counted_seconds(costs, stats.length_counts, stats.catchup_tokens) / stats.emitted


@pytest.mark.parametrize("costs", [CPU, CHEAP], ids=["cpu-costs", "cheap-draft-costs"])
def test_useless_draft_stays_within_five_percent_of_ar(models, costs):
    target, _, useless, prompt = models
    out, stats = run(target, useless, prompt, costs=costs)
    assert len(out) == 160 and stats.emitted == 160
    assert stats.target_forwards <= stats.emitted  # never more target forwards than AR
    assert cost_per_token(stats, costs) <= 1.05 * costs.ar_step
    # Power check: a fixed L with the same draft does lose more than 5 % under the same count.
    _, fixed = run(target, useless, prompt, adaptive=False, length=3, costs=costs)
    assert fixed.length_counts == [0, 0, 0, fixed.steps, 0][:4]
    assert cost_per_token(fixed, costs) > 1.05 * costs.ar_step


def test_draft_equal_to_target_gets_a_long_draft_length(models):
    target, same, _, prompt = models
    _, stats = run(target, same, prompt, costs=CHEAP)
    assert stats.acceptance_rate > 0.99
    assert stats.length_counts[L_MAX] >= 0.8 * stats.steps
    assert cost_per_token(stats, CHEAP) < 0.5 * CHEAP.ar_step


@pytest.mark.parametrize("policy", ["sd", "pcg"])
def test_greedy_output_equals_plain_greedy_for_every_draft_length(models, policy):
    target, same, useless, prompt = models
    plain, _ = run(target, None, prompt, "ar", adaptive=False, temperature=0.0, tokens=24)
    for draft in (useless, same):
        for length in range(1, L_MAX + 1):
            out, _ = run(target, draft, prompt, policy, adaptive=False, length=length, temperature=0.0, tokens=24)
            assert out == plain, (length, draft is same)
        for costs in (CPU, CHEAP):
            out, stats = run(target, draft, prompt, policy, temperature=0.0, tokens=24, costs=costs)
            assert out == plain
    assert len(plain) == 24


def test_adaptive_run_is_reproducible_given_costs(models):
    target, _, useless, prompt = models
    a, sa = run(target, useless, prompt, costs=CHEAP, seed=5)
    b, sb = run(target, useless, prompt, costs=CHEAP, seed=5)
    assert a == b and sa.length_counts == sb.length_counts
    assert sa.learned_costs == CHEAP  # given costs are kept, and reported as the last plan's
    c, _ = run(target, useless, prompt, costs=CHEAP, seed=6)
    assert c != a


def test_a_calibrated_run_reports_the_costs_its_loop_moved_them_to(models):
    """Measured (not given) costs are moved by the loop's own timings; the utterance reports both."""
    target, same, _, prompt = models
    _, stats = run(target, same, prompt, costs=None, tokens=40)
    assert isinstance(stats.learned_costs, StepCosts) and stats.costs is not None
    assert stats.learned_costs != StepCosts(**stats.costs)
    assert stats.as_dict()["learned_costs"] == stats.learned_costs.as_dict()


# Costs at which the 0.5 prior plans AR (L = 1 predicted at 0.98x of it) but a draft equal to
# the target wins by far at L = 4 (1.6x).
MID = StepCosts(target_forward=(1.0, 1.3, 1.6, 1.9, 2.2), draft_forward=(0.2, 0.21, 0.22, 0.23, 0.24),
                rule=0.03, sample=0.02)


def test_measured_acceptance_follows_the_draft_and_repeats(models):
    target, same, useless, prompt = models
    config = DecodeConfig(policy="sd", draft_length=L_MAX, max_new_tokens=120)
    good = measure_acceptance(target, same, prompt, config)
    assert len(good) == L_MAX and min(good) == 1.0  # SD accepts a draft equal to the target always
    bad = measure_acceptance(target, useless, prompt, config)
    assert 1 <= len(bad) < L_MAX and bad[0] < 0.3  # the later positions are too rarely tried to keep
    assert measure_acceptance(target, useless, prompt, config) == bad  # seeded: the same every time
    assert measure_acceptance(target, useless, prompt, config, seed=1) != bad


def test_the_calibration_decode_times_its_steps_and_the_plan_takes_those_times(models):
    """`measure_acceptance` reports a step's mean in-loop parts at the length its steps ran;
    `in_loop_costs` puts each where `DraftLengthPolicy.record` would and scales the untimed entries
    by the target's in-loop ratio."""
    from pcgtts.runtime.decode.cost_model import in_loop_costs

    target, same, _, prompt = models
    loop_step: dict = {}
    config = DecodeConfig(policy="sd", draft_length=L_MAX, max_new_tokens=60)
    rates = measure_acceptance(target, same, prompt, config, loop_step=loop_step)
    assert rates == measure_acceptance(target, same, prompt, config)  # timing changes nothing it measures
    assert loop_step["length"] == L_MAX
    assert set(loop_step["seconds"]) == {"time_draft", "time_target", "time_verify"}
    assert all(t > 0 for t in loop_step["seconds"].values())
    seconds = {"time_draft": 0.4, "time_target": 3.8, "time_verify": 0.06}
    planned = in_loop_costs(MID, 3, seconds)  # MID's 4-token verify 1.9: in the loop 2x
    assert planned.target_forward[3] == 3.8 and planned.rule == 0.06
    assert planned.draft_forward[0] == pytest.approx(0.4 / 3)  # no chained proposals: per draft step
    assert planned.target_forward[0] == pytest.approx(2 * MID.target_forward[0])  # untimed: scaled
    assert planned.sample == pytest.approx(2 * MID.sample)
    assert planned.draft_forward[1:] == pytest.approx(tuple(2 * c for c in MID.draft_forward[1:]))


def test_a_measured_start_speculates_from_the_first_step(models):
    """From the 0.5 prior the policy starts on AR and waits for a probe; from the measured rates it
    speculates at once. With the useless draft's measured rates it stays within 5 % of AR."""
    target, same, useless, prompt = models
    config = DecodeConfig(policy="sd", draft_length=L_MAX, max_new_tokens=120)
    _, cold = run(target, same, prompt, costs=MID)
    _, warm = run(target, same, prompt, costs=MID, acceptance=measure_acceptance(target, same, prompt, config))
    assert cold.length_counts[0] >= 10 and warm.length_counts[0] == 0
    assert cost_per_token(warm, MID) < 0.9 * cost_per_token(cold, MID)
    _, stats = run(target, useless, prompt, costs=MID, acceptance=measure_acceptance(target, useless, prompt, config))
    assert cost_per_token(stats, MID) <= 1.05 * MID.ar_step


def test_adaptive_setting_is_validated():
    with pytest.raises(ValueError, match="adaptive_draft"):
        DecodeConfig(adaptive_draft="yes")


# --- the rules' sync-free path (non-CPU devices), exact on the CPU too ------------------------

GROUPS = [[0, 1, 2], [2, 3, 4], [4, 5, 6], [6, 7, 0], [1, 5], [3, 7], [0, 4]]
V = 9


def _coarse(probs: torch.Tensor) -> torch.Tensor:
    n = torch.zeros(8)
    for members in GROUPS:
        n[members] += 1
    return torch.tensor([sum(float(probs[t] / n[t]) for t in g) for g in GROUPS] + [float(probs[8])],
                        dtype=torch.float64)


def _fits(counts: torch.Tensor, expected: torch.Tensor, wrong: torch.Tensor) -> None:
    keep = expected > 0
    assert counts[~keep].sum() == 0
    total = counts.double().sum()
    assert chisquare(counts[keep].double().numpy(), (expected[keep] / expected[keep].sum() * total).numpy()).pvalue > 1e-4
    assert chisquare(counts[keep].double().numpy(), (wrong[keep] / wrong[keep].sum() * total).numpy()).pvalue < 1e-4


@pytest.mark.slow  # ~15 s for pcg on the shared CPU
@pytest.mark.parametrize("rule", ["sd", "pcg"])
def test_sync_free_path_is_exact(rule):
    g = torch.Generator().manual_seed(4)
    draft = torch.softmax(1.5 * torch.randn(V, generator=g), -1)
    target = torch.softmax(1.5 * torch.randn(V, generator=g), -1)
    n = 100_000
    tokens = torch.multinomial(draft, n, replacement=True, generator=g).view(n, 1)
    verdict = acceptance.verify(rule, tokens, draft.expand(n, 1, V), target.expand(n, 2, V),
                                acceptance.draw_uniforms(n, 1, g, "cpu"), g,
                                groups=DeviceGroupTable.from_groups(GROUPS, num_tokens=8), sync_free=True)
    if rule == "sd":
        _fits(torch.bincount(verdict.tokens[:, 0], minlength=V), target.double(), draft.double())
    else:
        _fits(torch.bincount(verdict.groups[:, 0], minlength=8), _coarse(target), _coarse(draft))
