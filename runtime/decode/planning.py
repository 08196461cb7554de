"""What a loop plans with, measured before the first utterance: step costs and starting acceptance.

`prepare` measures the step costs an adaptive draft length plans with (`calibrate`), compiles a
proposer's graphs and builds a compiled rule's package, so that the first utterance's time to
first audio pays for none of it; `measure_acceptance` decodes a calibration sentence once at a
fixed draft length for the per-position acceptance each utterance starts from.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from pcgtts.groups.device import DeviceGroupTable
from pcgtts.runtime.config import DecodeConfig
from pcgtts.runtime.decode.cost_model import (MEASURED_PRIOR_WEIGHT, StepCosts, conditional_acceptance,
                                              plans_draft_length)
from pcgtts.runtime.decode.loop import decode, loop_judge, planned_costs
from pcgtts.runtime.decode.policy import Proposer, Rule
from pcgtts.runtime.decode.proposers import DraftModel
from pcgtts.runtime.decode.steps import DecodeStats
from pcgtts.runtime.lm.protocol import LM


def prepare(target: LM, draft: LM | None, config: DecodeConfig, groups: DeviceGroupTable | None = None,
            proposer=None, sync: Callable[[], None] | None = None) -> StepCosts | None:
    """Measure now what `decode` with `config` would measure in its first step: the step costs an
    adaptive draft length plans with (`calibrate.calibrated_costs`, kept while the models live).
    `Synthesizer.load` calls it so that the first utterance's time to first audio does not pay
    for it (nor for compiling a proposer's graphs, `warm_up`, or a compiled rule's package). None
    when `config` plans nothing (a fixed draft length, or no draft to plan)."""
    if not config.policy_spec.speculative or (config.proposer is Proposer.DRAFT and draft is None):
        return None
    if config.proposer is Proposer.DRAFT:
        proposer = DraftModel(draft)
    elif proposer is None:
        return None
    else:
        proposer.warm_up(config)
        proposer.start(0, config)  # how it draws proposals under `config`: the rows the judge reads
    if config.rule is not Rule.PCG or groups is not None:
        loop_judge(target, proposer, config, groups)  # a compiled rule's package is built or loaded now
    if not plans_draft_length(config):
        return None
    return planned_costs(target, proposer, config, groups, sync)


def measure_acceptance(target: LM, draft: LM | None, prompt_ids: torch.Tensor, config: DecodeConfig,
                       groups: DeviceGroupTable | None = None, proposer=None, seed: int = 0,
                       loop_step: dict | None = None) -> tuple[float, ...]:
    """Per-position acceptance P(i accepted | 1..i-1 were) of `config`'s rule and sampling on this
    pair, from one seeded decode of `prompt_ids` at the fixed draft length: where an adaptive draft
    length starts each utterance (`cost_model.starting_counter`), instead of a guess its own steps
    must first disprove (at 0.5, lab-v2's eagle-pcg parked 77-93 % of its steps on AR).
    Positions tried fewer than `MEASURED_PRIOR_WEIGHT` times are left out (the counter takes the
    previous position's rate for them). Deterministic given the models, so seeded utterances repeat.

    `loop_step` (filled when given): {"length": the draft length most steps ran, "seconds": the mean
    seconds a step spent in each timed part (`DecodeStats` names, as `DraftLengthPolicy.record`
    takes them)}, from the second step on (the first also prefills the draft)."""
    fixed = replace(config, adaptive_draft=False)
    stats = DecodeStats()
    generator = torch.Generator(device=target.device).manual_seed(seed)
    parts = ("time_draft", "time_target", "time_verify")
    first = None  # the counters after the first step
    for _ in decode(target, draft, prompt_ids, fixed, generator, groups, stats, proposer=proposer):
        if first is None:
            first = (stats.steps, *(getattr(stats, name) for name in parts))
    if loop_step is not None and first is not None and stats.steps > first[0]:
        n = stats.steps - first[0]
        loop_step["length"] = max(range(len(stats.length_counts)), key=stats.length_counts.__getitem__)
        loop_step["seconds"] = {name: (getattr(stats, name) - t) / n for name, t in zip(parts, first[1:])}
    speculative_steps = sum(stats.length_counts[1:])
    rates = conditional_acceptance(stats.per_position_accepted, speculative_steps)
    tried = [speculative_steps, *stats.per_position_accepted[:-1]]
    return tuple(rate for rate, n in zip(rates, tried) if n >= MEASURED_PRIOR_WEIGHT)  # tried never grows: a prefix
