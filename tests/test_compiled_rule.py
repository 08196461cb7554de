"""The compiled PCG rule (`runtime/decode/acceptance/compiled.py`): its graph's parts against the host lane's,
its AOTInductor package against the graph, and where the decode loops use it.

Its exactness in distribution is tested with the lane's: tests/test_acceptance.py's digit-rows
homogeneity test runs the graph (variants "pcg-compiled" and "pcg-compiled-fallback", slow)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pcgtts.groups.device import DeviceGroupTable
from pcgtts.runtime.config import SamplingConfig
from pcgtts.runtime.decode.acceptance import compiled as compiled_rule
from pcgtts.runtime.decode.acceptance import host as acceptance_cpu
from pcgtts.runtime.decode.rows import DigitRows
from pcgtts.runtime.decode.acceptance.compiled import CompiledRule, PCGDigitRule
from pcgtts.runtime.lm.digit_head import host_draw_digit_codes, sample_digit_codes

DIGITS = 3  # 64 codes + the stop (64)


def random_table(seed: int, groups: int = 40, largest: int = 9) -> DeviceGroupTable:
    """Random overlapping groups over the 64 codes, every code in at least one."""
    rng = np.random.default_rng(seed)
    members = [sorted(rng.choice(64, size=rng.integers(1, largest + 1), replace=False).tolist()) for _ in range(groups)]
    members += [[code] for code in range(64)]
    return DeviceGroupTable.from_groups(members, 64)


def scores(rows: int, seed: int) -> torch.Tensor:
    return 1.5 * torch.randn(rows, 1 + 4 * DIGITS + 1, generator=torch.Generator().manual_seed(seed))


def test_the_graphs_parts_compute_what_the_host_lane_computes():
    """The graph's factor tables, group picks, P_c / Q_c sums and digit draws against the lane's own
    functions on the same rows and uniforms (float64 both: equal to rounding)."""
    table = random_table(0)
    rule = CompiledRule(None, table, DIGITS, trials=4)
    draft_scores, target_scores, temperature = scores(3, 1), scores(4, 2), 0.8
    draft, target = DigitRows(draft_scores, DIGITS, temperature), DigitRows(target_scores, DIGITS, temperature)
    t = torch.tensor(temperature, dtype=torch.float64)
    target_tables = compiled_rule._tables(target_scores, DIGITS, t)
    codes = torch.arange(65)
    for row in range(4):  # every code's probability, the stop's included
        ours = compiled_rule._at(target_tables, torch.tensor([row]), codes[None])[0]
        np.testing.assert_allclose(ours.numpy(), target.at(row, codes.numpy()), rtol=1e-12)

    gen = torch.Generator().manual_seed(3)
    tokens, u = torch.tensor([5, 64, 17]), torch.rand(3, generator=gen, dtype=torch.float64)
    picked = compiled_rule._pick(rule.table, tokens, u)
    host = table.host
    assert picked.tolist() == acceptance_cpu._pick(host, tokens.numpy(), u.numpy()).tolist()

    p_c, q_c = compiled_rule._coarse(compiled_rule._tables(draft_scores, DIGITS, t), target_tables, torch.arange(3),
                                     picked, rule.table)
    members, weights = acceptance_cpu._members(host, picked.numpy())
    rows = np.arange(3)[:, None]
    np.testing.assert_allclose(p_c.numpy(), (draft.at(rows, members) * weights).sum(-1), rtol=1e-12)
    np.testing.assert_allclose(q_c.numpy(), (target.at(rows, members) * weights).sum(-1), rtol=1e-12)

    draw_u = torch.rand(200, DIGITS + 1, generator=gen, dtype=torch.float64)
    factors = target.factors
    for row in (0, 3):  # the graph's draws (digit_head.sample_digit_codes in float64) against the lane's
        ours = sample_digit_codes(target_scores[row], DIGITS, t, draw_u, precision=torch.float64)
        expected = host_draw_digit_codes(factors[0][row], factors[1][row], draw_u.numpy())
        assert ours.tolist() == expected.tolist()
        assert len(set(ours.tolist())) > 3


def test_everything_accepted_emits_the_bonus_draw_and_a_refusal_recovers_within_the_target():
    """Forced outcomes through `CompiledRule` (the graph run eagerly): a draft equal to the target
    with uniforms 0 keeps every proposal and emits the first draw from row L; uniforms just under 1
    against a target that puts nearly all its mass on the stop token refuse the first proposal, and
    the recovered token is one that target gives probability."""
    table = random_table(1)
    rule = CompiledRule(PCGDigitRule(DIGITS, 4), table, DIGITS, trials=4)
    target_scores = scores(4, 5)
    target = DigitRows(target_scores, DIGITS, 1.0)
    tokens = torch.tensor([3, 9, 40])
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    n, emitted = rule(tokens, DigitRows(target_scores[:3], DIGITS, 1.0), target, torch.zeros(3), gen)
    assert n == 3 and emitted[:3] == [3, 9, 40]
    gen.set_state(state)
    u = torch.rand(3 + 5 * (DIGITS + 1) + 8, generator=gen, dtype=torch.float64)
    draws = sample_digit_codes(target_scores[3], DIGITS, 1.0, u[3:3 + 5 * (DIGITS + 1)].view(5, DIGITS + 1),
                               precision=torch.float64)
    assert emitted[3] == int(draws[0])

    stopping = target_scores.clone()
    stopping[:, -1] += 30.0  # a target that stops nearly always
    stopping = DigitRows(stopping, DIGITS, 1.0)
    outcomes = set()
    for _ in range(50):
        n, emitted = rule(tokens, DigitRows(target_scores[:3], DIGITS, 1.0), stopping, torch.full((3,), 1 - 1e-7), gen)
        assert stopping.at(n, np.array([emitted[-1]]))[0] > 0
        outcomes.add((n, len(emitted)))
    assert outcomes == {(0, 1)}


def test_a_loop_judges_with_the_compiled_rule_only_where_it_applies(monkeypatch):
    """A compiled CPU target at plain temperature with digit rows: PCG with a table covering the
    codes, or SD; the host lane or the tensor rules for other rules, sampling, tables or an eager target."""
    from pcgtts.runtime.config import DecodeConfig
    from pcgtts.runtime.decode.acceptance.judge import CompiledJudge
    from pcgtts.runtime.decode.loop import loop_judge
    from pcgtts.runtime.decode.sampling import rule_digits

    table = random_table(2)
    monkeypatch.setattr(compiled_rule, "_RUNNERS", {(DIGITS, 16): "runner"})
    target = SimpleNamespace(compiled=True, drawable_digits=DIGITS, device=torch.device("cpu"))
    eager = SimpleNamespace(compiled=False, drawable_digits=DIGITS, device=torch.device("cpu"))

    def judge(policy, sampling, groups=table, lm=target):
        proposer = SimpleNamespace(row_digits=lambda s: rule_digits(lm, s))
        return loop_judge(lm, proposer, DecodeConfig(policy=policy, sampling=sampling), groups)[0]

    plain = SamplingConfig(temperature=0.8)
    pcg = judge("pcg", plain)
    assert isinstance(pcg, CompiledJudge)
    assert pcg.rule.runner == "runner" and pcg.rule.groups is table and pcg.rule.rule == "pcg"
    sd = judge("sd", plain).rule  # SD: PCG over singleton groups
    assert sd.rule == "sd" and sd.groups.num_groups == 64 and sd.groups.max_group_size == 1
    others = [judge("ssd", plain), judge("mtp-topm", plain), judge("pcg", plain, DeviceGroupTable.singletons(60)),
              judge("pcg", SamplingConfig(temperature=0.8, top_p=0.9)), judge("pcg", SamplingConfig(temperature=0.0)),
              judge("pcg", plain, lm=eager)]  # a table of another size: the lane says why
    assert not any(isinstance(j, CompiledJudge) for j in others)
    with pytest.raises(ValueError, match="group table"):  # pcg with no table never reaches a judge
        judge("pcg", plain, None)


def test_a_package_that_cannot_be_built_leaves_the_host_lane_with_a_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(compiled_rule, "_RUNNERS", {})

    def fail(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compiled_rule, "export_rule", fail)
    with caplog.at_level(logging.WARNING):
        assert compiled_rule.load_rule(random_table(3), DIGITS, 5, tmp_path) is None
    assert "no C++ compiler" in caplog.text and "runs on the host" in caplog.text

    def half_written(program, package_path, inductor_configs):  # the build fails after writing part of it
        with open(package_path, "wb") as f:
            f.write(b"half")
        raise RuntimeError("the build broke off")

    import torch._inductor

    monkeypatch.setattr(compiled_rule, "export_rule", lambda *args: None)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", half_written)
    with caplog.at_level(logging.WARNING):
        assert compiled_rule.load_rule(random_table(3), DIGITS, 6, tmp_path) is None
    assert "broke off" in caplog.text
    assert not list(tmp_path.iterdir())  # no half-written package left behind


@pytest.mark.slow
def test_the_package_computes_what_the_graph_computes_for_any_length_and_table(monkeypatch, tmp_path):
    """The AOTInductor package (draft length and table sizes symbolic) against the graph run eagerly:
    the same (n, token, ok) for draft lengths 1 to 6 on two tables of different sizes; a later load
    reads the package from the cache folder instead of building it again."""
    monkeypatch.setattr(compiled_rule, "_RUNNERS", {})
    tables = [random_table(4), random_table(5, groups=90, largest=20)]
    graph = PCGDigitRule(DIGITS, 4)
    gen = torch.Generator().manual_seed(7)
    for table in tables:
        rule = compiled_rule.load_rule(table, DIGITS, 4, tmp_path)
        for length in (1, 2, 3, 6):
            for case in range(6):
                target_scores = scores(length + 1, 10 * length + case)
                draft_scores = target_scores[:length] + torch.randn(length, 1 + 4 * DIGITS + 1, generator=gen)
                args = (draft_scores, target_scores, torch.randint(0, 65, (length,), generator=gen),
                        torch.rand(length, generator=gen),
                        torch.rand(length + 5 * (DIGITS + 1) + 8, generator=gen, dtype=torch.float64),
                        torch.tensor(0.7, dtype=torch.float64), torch.tensor(0.9, dtype=torch.float64), *rule.table)
                assert rule.runner(*args).tolist() == graph(*args).tolist(), (length, case)
    assert len(list(tmp_path.glob("*.pt2"))) == 1

    monkeypatch.setattr(compiled_rule, "_RUNNERS", {})
    monkeypatch.setattr(compiled_rule, "export_rule", lambda *a: pytest.fail("built again"))
    assert compiled_rule.load_rule(tables[0], DIGITS, 4, tmp_path) is not None
