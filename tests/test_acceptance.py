"""Acceptance rules: exact outcomes with forced randomness, and exactness in distribution.

Statistical tests draw N independent verify steps at once (the batch dimension) with a fixed
seed and apply a chi-square goodness-of-fit test at significance 1e-4: if the rule were
exact, a failure would occur with probability 1e-4 per test (a false alarm); the seed makes CI
deterministic. Each also checks that the same test *does* reject a wrong distribution, so a
vacuous test cannot pass.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pcgtts.groups.device import DeviceGroupTable
from pcgtts.runtime.decode import acceptance
from pcgtts.runtime.decode.acceptance import PLACEHOLDER, draw_uniforms, verify
from pcgtts.runtime.decode.acceptance.coarse import coarse_view

ALPHA = 1e-4
N = 200_000
# 8 speech tokens + stop (index 8). Overlapping groups: tokens 0 and 4 lie in three groups,
# the others in two; the stop token is its own group (id 7).
GROUPS = [[0, 1, 2], [2, 3, 4], [4, 5, 6], [6, 7, 0], [1, 5], [3, 7], [0, 4]]
V = 9


def table() -> DeviceGroupTable:
    return DeviceGroupTable.from_groups(GROUPS, num_tokens=8)


def distributions(seed: int, sharp: float = 1.5):
    g = torch.Generator().manual_seed(seed)
    draft = torch.softmax(sharp * torch.randn(V, generator=g), -1)
    target = torch.softmax(sharp * torch.randn(V, generator=g), -1)
    return draft, target


def coarse(probs: torch.Tensor) -> torch.Tensor:
    """Q_c / P_c by the definition (equal split), stop group last. [V] -> [M + 1]"""
    n = torch.zeros(8)
    for members in GROUPS:
        n[members] += 1
    masses = [sum(float(probs[t] / n[t]) for t in members) for members in GROUPS]
    return torch.tensor(masses + [float(probs[8])], dtype=torch.float64)


def batch(draft: torch.Tensor, target: torch.Tensor, n: int, length: int, gen: torch.Generator):
    draft_probs = draft.expand(n, length, V).contiguous()
    target_probs = target.expand(n, length + 1, V).contiguous()
    draft_tokens = torch.multinomial(draft, n * length, replacement=True, generator=gen).view(n, length)
    return draft_tokens, draft_probs, target_probs


def assert_fits(counts: torch.Tensor, expected_probs: torch.Tensor, wrong_probs: torch.Tensor) -> None:
    counts, expected_probs, wrong_probs = counts.double(), expected_probs.double(), wrong_probs.double()
    total = counts.sum()
    keep = expected_probs > 0
    assert counts[~keep].sum() == 0, "mass where the expected distribution has none"
    exp = expected_probs[keep] / expected_probs[keep].sum() * total
    assert chisquare(counts[keep].numpy(), exp.numpy()).pvalue > ALPHA
    # Power check: the same data must reject a clearly different distribution.
    wrong = (wrong_probs[keep] + 1e-12) / (wrong_probs[keep] + 1e-12).sum() * total
    assert chisquare(counts[keep].numpy(), wrong.numpy()).pvalue < ALPHA


def test_sd_emits_the_target_distribution():
    draft, target = distributions(0)
    gen = torch.Generator().manual_seed(1)
    tokens, dprobs, tprobs = batch(draft, target, N, 2, gen)
    verdict = verify("sd", tokens, dprobs, tprobs, draw_uniforms(N, 2, gen, "cpu"), gen)
    for slot in (0, 1):  # slot 1 mixes accepted, recovered and bonus tokens
        emitted = verdict.tokens[:, slot]
        mask = emitted != PLACEHOLDER
        if slot == 1:
            # Slot 1 exists only after slot 0 was accepted; conditioning on that keeps it ~ target
            # because the rows are i.i.d. and position 1's draw is independent of position 0's.
            mask &= verdict.num_accepted >= 1
        counts = torch.bincount(emitted[mask], minlength=V)
        assert_fits(counts, target, draft)


def test_ssd_with_beta_zero_equals_sd():
    draft, target = distributions(2)
    gen = torch.Generator().manual_seed(3)
    tokens, dprobs, tprobs = batch(draft, target, 5000, 3, gen)
    uniforms = draw_uniforms(5000, 3, gen, "cpu")
    state = gen.get_state()
    sd = verify("sd", tokens, dprobs, tprobs, uniforms, gen)
    gen.set_state(state)
    ssd = verify("ssd", tokens, dprobs, tprobs, uniforms, gen, ssd_beta=0.0)
    assert torch.equal(sd.tokens, ssd.tokens) and torch.equal(sd.num_accepted, ssd.num_accepted)
    gen.set_state(state)
    relaxed = verify("ssd", tokens, dprobs, tprobs, uniforms, gen, ssd_beta=0.4)
    assert relaxed.num_accepted.float().mean() > sd.num_accepted.float().mean()


def test_pcg_emits_the_coarse_target_distribution():
    draft, target = distributions(4)
    gen = torch.Generator().manual_seed(5)
    tokens, dprobs, tprobs = batch(draft, target, N, 1, gen)
    verdict = verify("pcg", tokens, dprobs, tprobs, draw_uniforms(N, 1, gen, "cpu"), gen, groups=table())
    group = verdict.groups[:, 0]
    q_c, p_c = coarse(target), coarse(draft)
    assert_fits(torch.bincount(group, minlength=len(q_c)), q_c, p_c)
    # Conditional on a rejection, the group comes from the normalised residual [Q_c - P_c]_+.
    rejected = verdict.num_accepted == 0
    residual = (q_c - p_c).clamp_min(0)
    assert_fits(torch.bincount(group[rejected], minlength=len(q_c)), residual, q_c)
    # The emitted token is a member of the emitted group (the stop group holds only the stop token).
    members = [set(m) for m in GROUPS] + [{8}]
    pairs = torch.stack([verdict.tokens[:, 0], group], 1).unique(dim=0).tolist()
    assert all(t in members[k] for t, k in pairs)


def test_pcg_exact_fallback_is_exact(monkeypatch):
    """One thinning trial, no extra rounds and a small residual force the exact all-groups fallback often."""
    monkeypatch.setattr(acceptance, "THINNING_ROUNDS", 0)
    draft, target = distributions(6, sharp=0.5)
    gen = torch.Generator().manual_seed(7)
    n = 60_000
    tokens, dprobs, tprobs = batch(draft, target, n, 1, gen)
    verdict = verify("pcg", tokens, dprobs, tprobs, torch.ones(n, 1) - 1e-7, gen, groups=table(), thinning_trials=1)
    rejected = verdict.num_accepted == 0
    assert rejected.float().mean() > 0.3  # uniforms ~1 reject unless Q_c >= P_c
    q_c, p_c = coarse(target), coarse(draft)
    residual = (q_c - p_c).clamp_min(0)
    assert_fits(torch.bincount(verdict.groups[rejected, 0], minlength=len(q_c)), residual, q_c)


@pytest.mark.parametrize("trials", [16, 1])
def test_pcg_recovered_token_follows_the_target_within_its_group(trials, monkeypatch):
    """On a rejection the emitted (group K, token t) pair has probability
    R(K) * (target(t) / N(t)) / Q_c(K), R the normalised residual [Q_c - P_c]_+: chi-square over
    every (K, t) pair at significance 1e-4, with the power check against a uniform pick within K.
    trials=16: the kept thinning candidate's token is emitted; trials=1 with uniforms near 1
    and no extra thinning rounds, most rejected rows fall back to the exact all-groups residual
    and sample the token from the group."""
    if trials == 1:
        monkeypatch.setattr(acceptance, "THINNING_ROUNDS", 0)
    draft, target = distributions(10, sharp=0.5 if trials == 1 else 1.5)
    gen = torch.Generator().manual_seed(11)
    tokens, dprobs, tprobs = batch(draft, target, N, 1, gen)
    uniforms = torch.ones(N, 1) - 1e-7 if trials == 1 else draw_uniforms(N, 1, gen, "cpu")
    verdict = verify("pcg", tokens, dprobs, tprobs, uniforms, gen, groups=table(), thinning_trials=trials)
    rejected = verdict.num_accepted == 0
    q_c, p_c = coarse(target), coarse(draft)
    residual = (q_c - p_c).clamp_min(0)
    residual = residual / residual.sum()
    n = torch.zeros(V)
    for members in GROUPS:
        n[members] += 1
    n[8] = 1
    pairs = [(k, t) for k, members in enumerate(GROUPS + [[8]]) for t in members]
    index = {pair: i for i, pair in enumerate(pairs)}
    got = torch.tensor([index[(k, t)] for t, k in zip(verdict.tokens[rejected, 0].tolist(),
                                                      verdict.groups[rejected, 0].tolist())])
    members_of = GROUPS + [[8]]
    expected = torch.tensor([float(residual[k] * target[t] / n[t] / q_c[k]) for k, t in pairs])
    uniform = torch.tensor([float(residual[k] / len(members_of[k])) for k, t in pairs])
    assert_fits(torch.bincount(got, minlength=len(pairs)), expected, uniform)


def test_pcg_with_singleton_groups_is_sd_in_distribution():
    draft, target = distributions(8)
    gen = torch.Generator().manual_seed(9)
    tokens, dprobs, tprobs = batch(draft, target, N, 1, gen)
    singles = DeviceGroupTable.singletons(8)
    verdict = verify("pcg", tokens, dprobs, tprobs, draw_uniforms(N, 1, gen, "cpu"), gen, groups=singles)
    assert_fits(torch.bincount(verdict.tokens[:, 0], minlength=V), target, draft)


@pytest.mark.parametrize("rule", ["sd", "ssd", "pcg"])
def test_forced_accept_and_reject(rule):
    gen = torch.Generator().manual_seed(0)
    # Target puts 0.7 on token 1 and 0.3 on token 3 at every row; draft proposes 1, 1, 3.
    target = torch.zeros(1, 4, V)
    target[..., 1], target[..., 3] = 0.7, 0.3
    draft = torch.zeros(1, 3, V)
    draft[..., 1], draft[..., 3] = 0.5, 0.5
    tokens = torch.tensor([[1, 1, 3]])
    groups = DeviceGroupTable.singletons(8)
    accept_all = verify(rule, tokens, draft, target, torch.zeros(1, 3), gen, groups=groups)
    assert accept_all.num_accepted.item() == 3
    assert accept_all.tokens[0, :3].tolist() == [1, 1, 3] and accept_all.tokens[0, 3].item() in (1, 3)
    # u just below 1: tokens with target/draft >= 1 (token 1) pass, token 3 (0.3/0.5) fails.
    reject_last = verify(rule, tokens, draft, target, torch.full((1, 3), 0.999), gen, groups=groups)
    assert reject_last.num_accepted.item() == 2
    # The recovered token comes from max(0, target - draft): only token 1 has positive residual.
    assert reject_last.tokens[0].tolist() == [1, 1, 1, PLACEHOLDER]


def test_draft_equal_to_target_accepts_everything():
    _, target = distributions(10)
    gen = torch.Generator().manual_seed(11)
    tokens, dprobs, tprobs = batch(target, target, 2000, 4, gen)
    for rule in ("sd", "pcg"):
        verdict = verify(rule, tokens, dprobs, tprobs, draw_uniforms(2000, 4, gen, "cpu"), gen, groups=table())
        assert bool((verdict.num_accepted == 4).all()), rule
        assert bool((verdict.tokens[:, 4] >= 0).all())  # a bonus token in every row


def test_pcg_accepts_more_than_sd_when_draft_is_right_about_groups():
    """The draft puts its mass on a group-mate of the target's favourite: SD rejects, PCG accepts."""
    gen = torch.Generator().manual_seed(12)
    target, draft = torch.full((V,), 0.01), torch.full((V,), 0.01)
    target[5], draft[1] = 0.92, 0.92  # 1 and 5 share group [1, 5]
    tokens, dprobs, tprobs = batch(draft / draft.sum(), target / target.sum(), 20_000, 1, gen)
    u = draw_uniforms(20_000, 1, gen, "cpu")
    sd = verify("sd", tokens, dprobs, tprobs, u, gen).num_accepted.float().mean()
    pcg = verify("pcg", tokens, dprobs, tprobs, u, gen, groups=table()).num_accepted.float().mean()
    assert pcg > sd + 0.3


def test_greedy_is_argmax_matching():
    target = torch.nn.functional.one_hot(torch.tensor([[2, 5, 7, 1]]), V).float()
    same = verify("greedy", torch.tensor([[2, 5, 7]]), target[:, :3], target, torch.zeros(1, 3), None)
    assert same.tokens.tolist() == [[2, 5, 7, 1]] and same.num_accepted.item() == 3
    differ = verify("greedy", torch.tensor([[2, 4, 7]]), target[:, :3], target, torch.zeros(1, 3), None)
    assert differ.tokens.tolist() == [[2, 5, PLACEHOLDER, PLACEHOLDER]] and differ.num_accepted.item() == 1


def test_bad_arguments():
    gen = torch.Generator()
    x = torch.zeros(1, 2, dtype=torch.long)
    p, q = torch.full((1, 2, V), 1 / V), torch.full((1, 3, V), 1 / V)
    with pytest.raises(ValueError, match="unknown rule"):
        verify("nope", x, p, q, torch.zeros(1, 2), gen)
    with pytest.raises(ValueError, match="group table"):
        verify("pcg", x, p, q, torch.zeros(1, 2), gen)
    with pytest.raises(ValueError, match="one more row"):
        verify("sd", x, p, p, torch.zeros(1, 2), gen)
    with pytest.raises(ValueError, match="covers 5 speech tokens"):
        verify("pcg", x, p, q, torch.zeros(1, 2), gen, groups=DeviceGroupTable.singletons(5))


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pcg_on_cuda_is_exact():
    draft, target = distributions(4)
    gen = torch.Generator(device="cuda").manual_seed(5)
    tokens, dprobs, tprobs = batch(draft.cuda(), target.cuda(), N, 1, torch.Generator(device="cuda").manual_seed(1))
    verdict = verify("pcg", tokens, dprobs, tprobs, draw_uniforms(N, 1, gen, "cuda"), gen, groups=table().to("cuda"),
                     thinning_trials=2)
    assert_fits(torch.bincount(verdict.groups[:, 0].cpu(), minlength=8), coarse(target), coarse(draft))


def test_group_picks_and_member_lists_through_the_stop_folded_spans():
    """Every (token, pick) reaches the pick-th group of S(t) and every group its own members, the
    stop token included (its own group `num_groups`, itself its one member); float32 pick uniforms
    are refused (u * |S(t)| could round up to the next token's first group)."""
    groups = [[0, 1, 2], [2, 3], [1, 3, 4], [4]]
    table = DeviceGroupTable.from_groups(groups, 5)
    view = coarse_view(table, 6)
    for token in range(6):
        memberships = [k for k, g in enumerate(groups) if token in g] if token < 5 else [len(groups)]
        for i, expected in enumerate(memberships):
            u = torch.tensor([(i + 0.5) / len(memberships)], dtype=torch.float64)
            assert int(view.pick(torch.tensor([token]), u)) == expected
    for sync_free, width in ((False, 3), (True, table.max_group_size)):  # the fixed width needs no host read
        members, valid = view.members(torch.tensor([0, 1, 2, 3, 4]), sync_free)
        assert members.shape == (5, width)
        assert [m[v].tolist() for m, v in zip(members, valid)] == [*groups, [5]]
    with pytest.raises(TypeError, match="float64"):
        view.pick(torch.tensor([0]), torch.tensor([0.5]))


@pytest.mark.parametrize("rule, fallback", [("sd", False), ("ssd", False), ("pcg", False), ("pcg", True)],
                         ids=["sd", "ssd", "pcg", "pcg-exact-fallback"])
def test_the_cpu_lane_returns_the_tensor_rules_tokens_draw_for_draw(rule, fallback, monkeypatch):
    """The host lane (NumPy indexing, one sequence) against the tensor rules at batch 1
    from the same generator state, over random pairs of distributions, lengths 1-4, the stop token
    among the proposals: the same count, the same tokens, and the generator left in the same state
    (the same draws consumed), so the statistical tests above cover the lane. `fallback`: one
    thinning trial and no extra rounds, so that PCG's exact all-groups residual runs often."""
    from pcgtts.runtime.decode.acceptance import verify_one

    exact_calls = []
    if fallback:
        from pcgtts.runtime.decode.acceptance import coarse, host, tensor

        for module in (tensor, host):
            monkeypatch.setattr(module, "THINNING_ROUNDS", 0)
            monkeypatch.setattr(module, "exact_residual_group",
                                lambda *a: exact_calls.append(1) or coarse.exact_residual_group(*a))
    groups, gen = table(), torch.Generator().manual_seed(13)
    outcomes = set()
    for case in range(800):
        length = 1 + case % 4
        sharp = (0.5, 1.5, 3.0)[case % 3]
        draft = torch.softmax(sharp * torch.randn(length, V, generator=gen), -1)
        target = torch.softmax(sharp * torch.randn(length + 1, V, generator=gen), -1)
        if case % 5 == 0:
            target[:length] = draft  # everything accepted: the bonus path
        tokens = torch.multinomial(draft, 1, generator=gen)[:, 0]
        uniforms = draw_uniforms(1, length, gen, "cpu")[0]
        if fallback:
            uniforms = torch.ones(length) - 1e-7
        state = gen.get_state()
        n, row = verify_one(rule, tokens, draft, target, uniforms, gen, groups=groups, ssd_beta=0.2,
                            thinning_trials=1 if fallback else 16)
        after = gen.get_state()
        gen.set_state(state)
        verdict = verify(rule, tokens[None], draft[None], target[None], uniforms[None], gen, groups=groups,
                         ssd_beta=0.2, thinning_trials=1 if fallback else 16)
        expected = verdict.tokens[0, : int(verdict.num_accepted) + 1].tolist()
        assert (n, row) == (int(verdict.num_accepted), expected), case
        assert torch.equal(after, gen.get_state()), case
        outcomes.add((n == length, 8 in row))
    assert outcomes >= {(True, False), (False, False), (False, True)}  # bonus, recovery, the stop token emitted
    assert len(exact_calls) > 100 if fallback else not exact_calls


DIGIT_GROUPS = [[0, 1, 5], [1, 2, 6, 7], [3, 7, 11], [4, 8, 9], [9, 10, 14, 15], [12, 13], [5, 6, 10], [11, 15],
                [0, 4, 12], [2, 3, 13, 14], [8]]  # over the 16 codes of 2 digits; the stop (16) is its own group


@pytest.mark.parametrize("rule, draft_kind, fallback", [
    ("sd", "digits", False), ("pcg", "digits", False), pytest.param("pcg", "compiled", False, marks=pytest.mark.slow),
    pytest.param("sd", "compiled", False, marks=pytest.mark.slow),
    pytest.param("pcg", "dense", False, marks=pytest.mark.slow), pytest.param("sd", "digits", True, marks=pytest.mark.slow),
    pytest.param("pcg", "digits", True, marks=pytest.mark.slow), pytest.param("pcg", "compiled", True, marks=pytest.mark.slow)],
                         ids=["sd", "pcg", "pcg-compiled", "sd-compiled", "pcg-dense-draft", "sd-residual-fallback", "pcg-exact-fallback",
                              "pcg-compiled-fallback"])
def test_digit_factored_rows_verify_like_their_dense_rows(rule, draft_kind, fallback, monkeypatch):
    """The lane over a digit head's scores (`DigitRows`: probabilities and draws from per-digit
    softmaxes, the recovered token by thinning) against the same distributions expanded into dense
    rows (`DenseRows`, draw for draw the tensor rules): emitted (n, token) pairs are compared with a
    chi-square homogeneity test at significance 1e-4 (two independent samples of 6,000 verify steps,
    2 digits x 4 levels + stop = 17 tokens, one proposal); the same test must tell the digit rows
    apart from a slightly different target (power check). `fallback`: one thinning trial, no extra
    rounds and uniforms near 1, so the dense residual (SD) or the all-groups residual (PCG) runs often.
    The draft's rows are at a temperature of their own (0.6 against the target's 0.8).
    "compiled": the compiled rule's graph (`compiled.PCGDigitRule`, run eagerly here; its
    AOTInductor package computes the same: tests/test_compiled_rule.py) judges the digit rows, for
    SD over singleton groups; with `fallback` its one candidate is mostly refused and the host
    finishes the recovery."""
    from scipy.stats import chi2_contingency

    from pcgtts.runtime.decode.acceptance import verify_one
    from pcgtts.runtime.decode.rows import DenseRows, DigitRows
    from pcgtts.runtime.decode.acceptance.compiled import CompiledRule, PCGDigitRule
    from pcgtts.runtime.lm.digit_head import expand_digit_scores

    if fallback:
        monkeypatch.setattr(acceptance, "THINNING_ROUNDS", 0)
    groups = DeviceGroupTable.from_groups(DIGIT_GROUPS, 16)
    n_steps, trials = 6_000, 1 if fallback else 16
    compiled = None
    if draft_kind == "compiled":
        from pcgtts.runtime.decode.acceptance.compiled import singletons

        compiled = CompiledRule(PCGDigitRule(2, trials), groups if rule == "pcg" else singletons(16), 2, trials, rule)
    runs = []
    g = torch.Generator().manual_seed(21)
    target_scores = 1.5 * torch.randn(2, 1 + 8 + 1, generator=g)
    draft_scores = target_scores + 1.2 * torch.randn(1, 1 + 8 + 1, generator=g)
    speech = lambda z: z[..., 0] + z[..., 1:-1].unflatten(-1, (2, 4)).logsumexp(-1).sum(-1)  # noqa: E731
    target_scores[:, -1] = speech(target_scores)  # the stop token takes half the target's mass,
    draft_scores[:, -1] = speech(draft_scores) - 3.0  # and ~5 % of the draft's (at temperature 1)
    other_scores = target_scores + torch.tensor([0.0] + [0.8, 0, 0, 0] + [0] * 4 + [0.0])  # a shifted digit-0 softmax
    temperature, draft_temperature = 0.8, 0.6  # the draft proposes cooler, at its own temperature (an EAGLE draft's)
    dense = lambda scores, t=temperature: DigitRows(scores, 2, t).dense()  # noqa: E731

    def sample(target_rows, draft_rows, draft_dense, seed, compiled=None):
        gen = torch.Generator().manual_seed(seed)
        counts = torch.zeros(2, 17, dtype=torch.long)
        for _ in range(n_steps):
            token = torch.multinomial(draft_dense[0], 1, generator=gen)
            u = torch.ones(1) - 1e-7 if fallback else draw_uniforms(1, 1, gen, "cpu")[0]
            n, row = verify_one(rule, token, draft_rows, target_rows, u, gen, groups=groups, thinning_trials=trials,
                                compiled=compiled)
            counts[n, row[-1]] += 1
        return counts

    draft_dense = dense(draft_scores, draft_temperature)
    draft_rows = DenseRows(draft_dense) if draft_kind == "dense" else DigitRows(draft_scores, 2, draft_temperature)
    if compiled is not None:  # count the graph's calls: the compiled rule must be what judged
        graph = compiled.runner
        compiled.runner = lambda *args: runs.append(1) or graph(*args)
    factored = sample(DigitRows(target_scores, 2, temperature), draft_rows, draft_dense, 1, compiled)
    assert len(runs) == (n_steps if compiled is not None else 0)
    reference = sample(DenseRows(dense(target_scores)), DenseRows(draft_dense), draft_dense, 2)
    shifted = sample(DenseRows(dense(other_scores)), DenseRows(draft_dense), draft_dense, 3)

    def p_value(a, b):
        table = torch.stack([a.flatten(), b.flatten()]).numpy()
        return chi2_contingency(table[:, table.sum(0) > 0])[1]

    if fallback:
        assert factored[0].sum() > 0.3 * n_steps  # rejections, each through the fallback
    assert p_value(factored, reference) > ALPHA
    assert p_value(factored, shifted) < ALPHA
    assert torch.allclose(dense(target_scores), torch.softmax(expand_digit_scores(target_scores, 2) / temperature, -1))


def test_digit_rows_give_the_expanded_rows_probabilities():
    """`DigitRows.at` (two half-table lookups per code, the stop token through the extra high entry)
    equals the dense softmax of the expanded scores for every token, whether the rows were factored
    alone or together with another row set (`DigitRows.factor`, as a verify step does)."""
    from pcgtts.runtime.decode.rows import DigitRows
    from pcgtts.runtime.lm.digit_head import expand_digit_scores

    g = torch.Generator().manual_seed(3)
    scores, other = (2 * torch.randn(rows, 1 + 3 * 4 + 1, generator=g) for rows in (3, 2))
    dense = torch.softmax(expand_digit_scores(scores, 3).double() / 0.7, -1)
    tokens = np.arange(4 ** 3 + 1)
    alone = DigitRows(scores, 3, 0.7)
    together, first = DigitRows(scores, 3, 0.7), DigitRows(other, 3, 0.7)
    DigitRows.factor(first, together)
    for rows in (alone, together):
        probs = rows.at(np.arange(3)[:, None], tokens[None, :])
        np.testing.assert_allclose(probs, dense.numpy(), rtol=1e-5)  # the expansion sums in float32
        assert rows.at(2, tokens[-1:])[0] == pytest.approx(float(dense[2, -1]), rel=1e-5)
