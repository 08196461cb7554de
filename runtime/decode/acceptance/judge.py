"""How a decode loop's verdicts are computed: one backend per loop, chosen when it starts.

A verdict is (n accepted, the n + 1 tokens to emit) for one sequence's proposals. The rule's
mathematics has three forms, and `judge_for` picks the one that fits the loop's device, rows and
target, once:

  GreedyDigits  temperature 0 over digit rows: each row's argmax, digit by digit (no dense row).
  Compiled      a compiled CPU target's SD / PCG over digit rows: one ahead-of-time graph
                (`compiled.py`), the host lane finishing the rare unfinished recovery.
  Host          SD / SSD / PCG on a CPU: the NumPy lane (`host.py`), dense or digit rows.
  Tensor        everything else (any device, and the inexact top-M / threshold rules): the batched
                tensor rules (`tensor.py`) at batch 1, one host read of the outcome.

Every backend draws its accept/reject uniforms first and then what its rule draws, in the order
the tensor rules do (tests/test_acceptance.py holds the host lane to them draw for draw and the
compiled graph to the lane; the statistical tests cover all three).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pcgtts.groups.device import DeviceGroupTable
from pcgtts.runtime.decode.acceptance import compiled as compiled_rules
from pcgtts.runtime.decode.acceptance import host
from pcgtts.runtime.decode.acceptance.tensor import (draw_uniforms, outcome, verify, verify_threshold,
                                                     verify_top_m)
from pcgtts.runtime.decode.policy import Rule
from pcgtts.runtime.decode.rows import DenseRows, DigitRows, Rows

EXACT_RULES = tuple(r for r in Rule if r.exact)  # the rules whose output follows the target's distribution
INEXACT_RULES = (Rule.STRICT, Rule.TOPM, Rule.THRESHOLD)  # multi-token heads' verification (Speech-LLaMA): not exact
HOST_RULES = EXACT_RULES  # what the NumPy lane computes


@dataclass(frozen=True)
class RuleParams:
    """A rule and its parameters: `rule` is one of greedy, sd, ssd, pcg, strict, topm, threshold (a
    `Rule`; its name is taken too)."""

    rule: Rule
    groups: DeviceGroupTable | None = None
    ssd_beta: float = 0.0
    thinning_trials: int = 16
    top_m: int = 1
    threshold: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "rule", Rule(self.rule))
        if self.rule is Rule.PCG and self.groups is None:
            raise ValueError("the pcg rule needs a group table")


Judge = Callable[..., tuple[int, list[int]]]
"""judge(proposals [L], the draft's rows [L] (None for argmax proposals), the target's rows [L + 1],
generator, uniforms=None) -> (n accepted, the n + 1 tokens). `uniforms` [L] decide accept / reject
for the ratio rules (drawn from `generator` first when not given; tests force outcomes with them)."""


def _uniforms(uniforms, tokens: torch.Tensor, generator) -> torch.Tensor:
    return uniforms if uniforms is not None else draw_uniforms(1, len(tokens), generator, tokens.device)[0]


def _greedy_digits(tokens: torch.Tensor, draft_rows, target_rows: DigitRows, generator,
                   uniforms=None) -> tuple[int, list[int]]:
    """Temperature 0 over digit rows: nothing is drawn."""
    return host.greedy(tokens.numpy(), target_rows.argmax())


class TensorJudge:
    """The batched tensor rules at batch 1 (`tensor.verify`, `verify_top_m`, `verify_threshold`)."""

    def __init__(self, params: RuleParams):
        self.params = params

    def __call__(self, tokens: torch.Tensor, draft_rows, target_rows: Rows, generator,
                 uniforms=None) -> tuple[int, list[int]]:
        p = self.params
        target = target_rows.dense()
        if p.rule in (Rule.TOPM, Rule.STRICT):
            scores = target_rows.logits if isinstance(target_rows, DenseRows) and target_rows.logits is not None else target
            m = p.top_m if p.rule is Rule.TOPM else 1
            return outcome(verify_top_m(tokens[None], scores[None], target[None], m, generator))
        if p.rule is Rule.THRESHOLD:
            return outcome(verify_threshold(tokens[None], target[None], p.threshold, generator))
        draft = draft_rows.dense() if draft_rows is not None else target[:-1]  # greedy reads no draft rows
        if p.rule is not Rule.GREEDY:
            uniforms = _uniforms(uniforms, tokens, generator)
        elif uniforms is None:  # the greedy rule reads none and draws nothing
            uniforms = torch.zeros(len(tokens), device=tokens.device)
        return outcome(verify(p.rule, tokens[None], draft[None], target[None], uniforms[None], generator, groups=p.groups,
                              ssd_beta=p.ssd_beta, thinning_trials=p.thinning_trials))


class HostJudge:
    """SD / SSD / PCG on the host (`host.py`)."""

    def __init__(self, params: RuleParams):
        self.params = params

    def __call__(self, tokens: torch.Tensor, draft_rows: Rows, target_rows: Rows, generator,
                 uniforms=None) -> tuple[int, list[int]]:
        p = self.params
        return host.judge(p.rule, tokens, draft_rows, target_rows, _uniforms(uniforms, tokens, generator), generator,
                          groups=p.groups,
                          ssd_beta=p.ssd_beta, thinning_trials=p.thinning_trials)


class CompiledJudge:
    """A compiled rule (`compiled.CompiledRule`) over digit rows."""

    def __init__(self, rule: "compiled_rules.CompiledRule"):
        self.rule = rule

    def __call__(self, tokens: torch.Tensor, draft_rows: DigitRows, target_rows: DigitRows, generator,
                 uniforms=None) -> tuple[int, list[int]]:
        return self.rule(tokens, draft_rows, target_rows, _uniforms(uniforms, tokens, generator), generator)


def judge_for(params: RuleParams, device: torch.device, target_digits: int, draft_digits: int | None,
              compiled_target: bool = False) -> Judge:
    """The backend of a loop whose target rows are digit rows of `target_digits` digits (0: dense
    probabilities) and whose draft rows are `draft_digits` (0: dense; None: argmax proposals, no
    rows), on `device`; `compiled_target`: the target's steps are compiled (`--compile`), which
    lets SD and PCG over digit rows of one digit count run as one compiled call."""
    rule = params.rule
    if rule in INEXACT_RULES:
        return TensorJudge(params)
    if rule is Rule.GREEDY:
        return _greedy_digits if target_digits else TensorJudge(params)
    if compiled_target and rule in (Rule.SD, Rule.PCG) and target_digits and draft_digits == target_digits:
        compiled = compiled_rules.for_rows(rule, params.groups, target_digits, params.thinning_trials)
        if compiled is not None:
            return CompiledJudge(compiled)
    if device.type != "cpu" or rule not in HOST_RULES:
        return TensorJudge(params)
    return HostJudge(params)


def verify_one(rule: str, draft_tokens: torch.Tensor, draft_probs, target_probs, uniforms: torch.Tensor,
               generator: torch.Generator, *, groups: DeviceGroupTable | None = None, ssd_beta: float = 0.0,
               thinning_trials: int = 16, compiled: "compiled_rules.CompiledRule | None" = None) -> tuple[int, list[int]]:
    """One verdict with the backend `judge_for` would choose for these rows (probability tensors,
    `DenseRows` or `DigitRows`) and the given uniforms [L]: the rules' one-call form, for tests and
    measurements (a loop chooses its judge once). `compiled`: judge with this compiled rule."""
    draft, target = _as_rows(draft_probs), _as_rows(target_probs)
    if compiled is not None:
        return CompiledJudge(compiled)(draft_tokens, draft, target, generator, uniforms)
    params = RuleParams(rule, groups, ssd_beta, thinning_trials)
    judge = judge_for(params, draft_tokens.device, _digits(target), _digits(draft))
    return judge(draft_tokens, draft, target, generator, uniforms)


def _as_rows(probs) -> Rows | None:
    return probs if probs is None or isinstance(probs, (DenseRows, DigitRows)) else DenseRows(probs)


def _digits(rows: Rows | None) -> int | None:
    return None if rows is None else rows.digits if isinstance(rows, DigitRows) else 0
