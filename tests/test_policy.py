"""The policy table (`runtime/decode/policy.py`): each name's proposer and rule, the properties the
call sites ask of a policy, and the one resolution of a name (`DecodeConfig.policy_spec`)."""

from __future__ import annotations

import dataclasses

import pytest

from pcgtts.runtime.config import DEVICE_STEP_POLICIES, DecodeConfig, SamplingConfig, check_policy
from pcgtts.runtime.decode.acceptance import RuleParams
from pcgtts.runtime.decode.policy import POLICIES, Proposer, Rule, policy, policy_named

PAIRS = {  # name -> (proposer, rule), as the command line documents them
    "ar": ("none", "none"), "draft": ("none", "none"),
    "sd": ("draft", "sd"), "ssd": ("draft", "ssd"), "pcg": ("draft", "pcg"),
    "mtp-sd": ("heads", "sd"), "mtp-pcg": ("heads", "pcg"), "mtp-strict": ("heads", "strict"),
    "mtp-topm": ("heads", "topm"), "mtp-threshold": ("heads", "threshold"), "mtp-viterbi": ("viterbi", "topm"),
    "eagle-sd": ("eagle", "sd"), "eagle-pcg": ("eagle", "pcg"),
}


def test_every_name_resolves_to_its_proposer_and_rule():
    assert list(POLICIES) == list(PAIRS)
    for name, (proposer, rule) in PAIRS.items():
        spec = policy(name)
        assert (spec.name, spec.proposer, spec.rule) == (name, Proposer(proposer), Rule(rule))
        assert DecodeConfig(policy=name, adaptive_draft=False).policy_spec is spec


def test_the_properties_the_call_sites_ask():
    def names(where):
        return {name for name in PAIRS if where(policy(name))}

    assert names(lambda p: p.plain) == {"ar"}
    assert names(lambda p: p.draft_alone) == {"draft"}
    assert names(lambda p: p.needs_draft) == {"draft", "sd", "ssd", "pcg"}
    assert names(lambda p: p.speculative) == set(PAIRS) - {"ar", "draft"}
    assert names(lambda p: p.needs_groups) == {"pcg", "mtp-pcg", "eagle-pcg"}
    assert names(lambda p: p.reads_states) == {n for n in PAIRS if n.startswith(("mtp-", "eagle-"))}
    assert names(lambda p: p.uses_heads) == {n for n in PAIRS if n.startswith("mtp-")}
    assert names(lambda p: p.uses_eagle) == {"eagle-sd", "eagle-pcg"}
    assert names(lambda p: p.runs_on_device_steps) == set(DEVICE_STEP_POLICIES) == {"ar", "sd", "ssd", "pcg"}


def test_an_unknown_name_is_a_one_line_error():
    for bad in ("fast", "", None, ["sd"]):
        with pytest.raises(ValueError, match=r"^policy must be one of \('ar', 'draft', 'sd'.*got ") as err:
            policy(bad)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="policy must be one of"):
        DecodeConfig(policy="fast")


def test_a_pair_names_its_policy():
    assert policy_named(Proposer.DRAFT, Rule.PCG).name == "pcg"
    assert policy_named(Proposer.NONE, Rule.NONE).name == "ar"  # not the draft alone
    with pytest.raises(ValueError, match="no policy pairs proposer 'draft' with rule 'topm'; the pairs: none"):
        policy_named(Proposer.DRAFT, Rule.TOPM)


def test_the_rule_verified_is_greedy_at_temperature_zero_for_the_rules_that_sample():
    greedy = SamplingConfig(temperature=0.0)
    for name, (_, rule) in PAIRS.items():
        config = DecodeConfig(policy=name, adaptive_draft=False)
        assert config.rule is Rule(rule) and config.proposer is policy(name).proposer
        cold = dataclasses.replace(config, sampling=greedy).rule
        assert cold is (Rule.GREEDY if rule in ("sd", "ssd", "pcg", "strict") else Rule(rule))
    assert Rule.PCG == "pcg" and f"{Proposer.EAGLE}" == "eagle"  # names cross into the tensor rules and JSON


def test_rule_params_take_the_rule_or_its_name():
    assert RuleParams("sd").rule is Rule.SD and RuleParams(Rule.TOPM, top_m=2).rule is Rule.TOPM
    with pytest.raises(ValueError):
        RuleParams("fast")


def test_check_policy_names_what_each_policy_needs():
    none = dict(draft=False, groups=False, heads=False, transitions=False, eagle=False)
    check_policy("ar", **none)
    for name, missing in (("draft", "a draft model"), ("sd", "a draft model"), ("mtp-sd", "multi-token heads"),
                          ("eagle-pcg", "EAGLE draft")):
        with pytest.raises(ValueError, match=f"policy '{name}' needs .*{missing}"):
            check_policy(name, **none)
    with pytest.raises(ValueError, match="'mtp-viterbi' needs a code transition table"):
        check_policy("mtp-viterbi", **{**none, "heads": True})
    with pytest.raises(ValueError, match="'pcg' needs a group table"):
        check_policy("pcg", **{**none, "draft": True})
    check_policy("pcg", **{**none, "draft": True}, greedy=True)  # greedy decoding reads no group table


def test_one_answer_to_whether_a_decode_plans_its_draft_length():
    from pcgtts.runtime.decode.batch import check_batchable
    from pcgtts.runtime.decode.cost_model import plans_draft_length

    for name in PAIRS:
        for adaptive in (True, False):
            config = DecodeConfig(policy=name, adaptive_draft=adaptive)
            assert plans_draft_length(config) == (adaptive and name not in ("ar", "draft"))
            if name in DEVICE_STEP_POLICIES:  # whole steps on the device take a fixed length
                if plans_draft_length(config):
                    with pytest.raises(ValueError, match="needs a fixed draft length"):
                        dataclasses.replace(config, steps_per_sync=4)
                else:
                    assert dataclasses.replace(config, steps_per_sync=4).steps_per_sync == 4
            check_batchable(config, draft=True)  # a batch runs either (it plans with its shared passes)


def test_a_plan_prices_the_rule_a_step_costs():
    from pcgtts.runtime.decode.cost_model import costed_rule

    priced = {name: costed_rule(DecodeConfig(policy=name)) for name in PAIRS if name not in ("ar", "draft")}
    assert priced == {"sd": Rule.SD, "ssd": Rule.SSD, "pcg": Rule.PCG, "mtp-sd": Rule.SD, "mtp-pcg": Rule.PCG,
                      "mtp-strict": Rule.SD, "mtp-topm": Rule.SD, "mtp-threshold": Rule.SD, "mtp-viterbi": Rule.SD,
                      "eagle-sd": Rule.SD, "eagle-pcg": Rule.PCG}
    cold = SamplingConfig(temperature=0.0)
    assert {costed_rule(DecodeConfig(policy=name, sampling=cold)) for name in priced} == {Rule.GREEDY}
