"""A decode policy as declared types: who proposes (`Proposer`), which rule verifies (`Rule`), and
the `Policy` that pairs them under the name users write.

The name stays the user-facing setting (`DecodeConfig.policy`, `--policy`, config files, HTTP
requests); `policy(name)` resolves it once to a `Policy`, whose properties are what the loops,
the loading and the tools ask of it. `POLICIES` is the one table of names. The enums are string
valued (`Rule.PCG == "pcg"`), so a rule crosses into the tensor rules and JSON as its name.
This module imports nothing of pcgtts: every layer may read it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Proposer(enum.StrEnum):
    """Who proposes the draft tokens a step verifies (`runtime/decode/proposers.py`)."""

    NONE = "none"  # plain decoding: nothing is proposed
    DRAFT = "draft"  # a draft LM
    HEADS = "heads"  # the target's multi-token heads
    VITERBI = "viterbi"  # a Viterbi path over the heads' candidates and a code transition table
    EAGLE = "eagle"  # an EAGLE draft on the target's hidden states

    @property
    def reads_states(self) -> bool:
        """It proposes from the target's hidden states (torch, or an export that carries them)."""
        return self in (Proposer.HEADS, Proposer.VITERBI, Proposer.EAGLE)

    @property
    def uses_heads(self) -> bool:
        """It proposes with the target's multi-token heads."""
        return self in (Proposer.HEADS, Proposer.VITERBI)


class Rule(enum.StrEnum):
    """How proposals are verified (`runtime/decode/acceptance/`). NONE: a policy with no proposals;
    GREEDY: the rule every sampling rule becomes at temperature 0 (`DecodeConfig.rule`)."""

    NONE = "none"
    GREEDY = "greedy"
    SD = "sd"
    SSD = "ssd"
    PCG = "pcg"
    STRICT = "strict"
    TOPM = "topm"
    THRESHOLD = "threshold"

    @property
    def exact(self) -> bool:
        """The output follows the target's distribution (speculative sampling and its coarse-grained form)."""
        return self in (Rule.SD, Rule.SSD, Rule.PCG)

    @property
    def becomes_greedy(self) -> bool:
        """At temperature 0 it verifies greedily (`DecodeConfig.rule`): SD, SSD, PCG, and strict, whose
        argmax test greedy verification is; top-M and threshold keep their own tests."""
        return self in (Rule.SD, Rule.SSD, Rule.PCG, Rule.STRICT)


@dataclass(frozen=True)
class Policy:
    """A named pair of proposer and rule; `draft_alone`: the draft LM decodes alone (no target)."""

    name: str
    proposer: Proposer
    rule: Rule
    draft_alone: bool = False

    @property
    def plain(self) -> bool:
        """The target decodes alone, one token a step (ar)."""
        return self.proposer is Proposer.NONE and not self.draft_alone

    @property
    def speculative(self) -> bool:
        """Proposals are made and verified (a draft length applies)."""
        return self.proposer is not Proposer.NONE

    @property
    def needs_draft(self) -> bool:
        """It needs a draft LM: to propose, or to decode alone."""
        return self.proposer is Proposer.DRAFT or self.draft_alone

    @property
    def needs_groups(self) -> bool:
        """Its rule reads a group table (PCG; greedy decoding never consults one)."""
        return self.rule is Rule.PCG

    @property
    def reads_states(self) -> bool:
        """Its proposer reads the target's hidden states (heads, Viterbi, EAGLE)."""
        return self.proposer.reads_states

    @property
    def uses_heads(self) -> bool:
        """Its proposer is the target's multi-token heads (mtp-*)."""
        return self.proposer.uses_heads

    @property
    def uses_eagle(self) -> bool:
        """Its proposer is an EAGLE draft (eagle-*)."""
        return self.proposer is Proposer.EAGLE

    @property
    def runs_on_device_steps(self) -> bool:
        """Whole steps on the device (`DecodeConfig.steps_per_sync`) run it: plain target decoding and
        a draft LM's proposals."""
        return not self.draft_alone and self.proposer in (Proposer.NONE, Proposer.DRAFT)


def _table(*policies: Policy) -> dict[str, Policy]:
    return {p.name: p for p in policies}


# The policy names: aliases of (proposer, rule) on the command line, in config files and over HTTP.
POLICIES: dict[str, Policy] = _table(
    Policy("ar", Proposer.NONE, Rule.NONE),
    Policy("draft", Proposer.NONE, Rule.NONE, draft_alone=True),
    Policy("sd", Proposer.DRAFT, Rule.SD),
    Policy("ssd", Proposer.DRAFT, Rule.SSD),
    Policy("pcg", Proposer.DRAFT, Rule.PCG),
    Policy("mtp-sd", Proposer.HEADS, Rule.SD),
    Policy("mtp-pcg", Proposer.HEADS, Rule.PCG),
    Policy("mtp-strict", Proposer.HEADS, Rule.STRICT),
    Policy("mtp-topm", Proposer.HEADS, Rule.TOPM),
    Policy("mtp-threshold", Proposer.HEADS, Rule.THRESHOLD),
    Policy("mtp-viterbi", Proposer.VITERBI, Rule.TOPM),
    Policy("eagle-sd", Proposer.EAGLE, Rule.SD),
    Policy("eagle-pcg", Proposer.EAGLE, Rule.PCG),
)
POLICY_NAMES = tuple(POLICIES)


def policy(name: str) -> Policy:
    """The `Policy` a name stands for; an unknown name is a one-line ValueError listing the names."""
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"policy must be one of {POLICY_NAMES}, got {name!r}") from None


def policy_named(proposer: Proposer, rule: Rule) -> Policy:
    """The policy that pairs `proposer` with `rule` (the draft-alone policy aside); a pair no policy
    names is a ValueError listing the pairs that exist."""
    for p in POLICIES.values():
        if (p.proposer, p.rule) == (proposer, rule) and not p.draft_alone:
            return p
    pairs = ", ".join(f"{p.proposer}+{p.rule}" for p in POLICIES.values())
    raise ValueError(f"no policy pairs proposer {str(proposer)!r} with rule {str(rule)!r}; the pairs: {pairs}")


def names(where) -> tuple[str, ...]:
    """The names of the policies `where(policy)` holds for, in table order."""
    return tuple(p.name for p in POLICIES.values() if where(p))
