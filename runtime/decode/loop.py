"""The decode loop: prompt ids -> bursts of speech codes, for every policy, in one loop.

A policy is a proposer (none, a draft LM, multi-token heads, a Viterbi path over them, an EAGLE
draft: runtime/decode/proposers.py) and a rule that verifies its proposals (runtime/decode/
acceptance/). One step:

  1. choose L (fixed, or `cost_model.DraftLengthPolicy` with `adaptive_draft`; 0 until a
     proposer that reads the target's states has seen a verified row);
  2. L = 0: one plain target step (a draw from its last row). Otherwise the proposer makes L
     proposals and the target is fed [last, x_1 .. x_L] in one pass, giving L + 1 distributions;
  3. the rule (a judge chosen once, when the loop starts) -> n accepted + one recovered or bonus
     token; the target's cache is rolled back to [.., last, x_1 .. x_n] (O(1) with the static cache);
  4. the proposer hears the verdict (a draft LM rolls its cache back; a state proposer reads the
     accepted rows' states) and the tokens are handed out, cut at the stop token and the budget.

With a minimum length (`config.min_new_tokens`), the target's rows that decide speech tokens
before it give the stop token probability 0 (`sampling.forbid_stop`) in the plain step and the
verify pass alike, so every rule verifies against the same distributions plain decoding draws from
(a proposal of the stop token there is rejected as any token the target gives 0 is).
One host sync per step: the accepted count and the tokens, read back together. At temperature 0
every rule that samples verifies greedily, so speculative output equals plain greedy decoding.
No I/O, logging or tokenization happens here; token ids in, restricted-vocabulary indices out.
Whole steps on the device (`steps_per_sync`) run in runtime/decode/device_loop.py.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Sequence

import torch

from pcgtts.groups.device import DeviceGroupTable
from pcgtts.runtime.config import DecodeConfig, check_policy
from pcgtts.runtime.decode.acceptance import RuleParams, judge_for
from pcgtts.runtime.decode.calibrate import calibrated_costs
from pcgtts.runtime.decode.cost_model import (DraftLengthPolicy, StepCosts, costed_rule, plans_draft_length,
                                              starting_counter)
from pcgtts.runtime.decode.device_loop import decode_on_device
from pcgtts.runtime.decode.policy import Proposer, Rule
from pcgtts.runtime.decode.proposers import DraftModel
from pcgtts.runtime.decode.sampling import digits_to_draw, rule_digits
from pcgtts.runtime.decode.steps import (DecodeStats, Timer, emitted, has_room, plain_step, start_sequence,
                                         verify_pass)
from pcgtts.runtime.lm.protocol import LM


def decode(target: LM, draft: LM | None, prompt_ids: torch.Tensor, config: DecodeConfig,
           generator: torch.Generator, groups: DeviceGroupTable | None = None,
           stats: DecodeStats | None = None, sync: Callable[[], None] | None = None,
           costs: StepCosts | None = None, proposer=None,
           acceptance: Sequence[float] | None = None) -> Iterator[list[int]]:
    """Yield bursts of speech codes for `prompt_ids` [T] until the stop token or a limit.

    `generator` lives on the target's device; `sync` (e.g. torch.cuda.synchronize) makes the
    per-phase timings in `stats` exact on asynchronous devices at the cost of extra syncs.
    With `config.adaptive_draft`, `costs` are the step costs the draft length is planned with
    (default: measured once per model pair by `runtime/decode/calibrate.py`) and `acceptance` the
    per-position rates it starts from (`planning.measure_acceptance`; default: the proposer's
    recorded rate, else 0.5: `cost_model.starting_counter`). The heads and EAGLE policies propose
    with `proposer` (a `proposers.HeadProposer` or `EagleProposer`) reading the target's states.
    """
    stats = stats if stats is not None else DecodeStats()
    check_decode(config, draft, groups, proposer)
    if config.steps_per_sync:
        return decode_on_device(target, draft, prompt_ids, config, generator, groups, stats)
    if not config.policy_spec.speculative:
        lm = draft if config.decodes_with_draft else target
        return _loop(lm, None, prompt_ids, config, generator, groups, stats, Timer(stats, sync), None, None)
    if config.proposer is Proposer.DRAFT:
        proposer = DraftModel(draft)
    return _loop(target, proposer, prompt_ids, config, generator, groups, stats, Timer(stats, sync), costs,
                 acceptance)


def check_decode(config: DecodeConfig, draft, groups, proposer) -> None:
    """What a policy needs, of the models handed to `decode` (`config.check_policy`)."""
    states = config.policy_spec.reads_states and proposer is not None
    check_policy(config.policy, draft=draft is not None, groups=groups is not None, heads=states, eagle=states,
                 transitions=states and config.proposer is Proposer.VITERBI and proposer.transitions is not None,
                 greedy=config.sampling.greedy)


def loop_judge(target: LM, proposer, config: DecodeConfig, groups: DeviceGroupTable | None):
    """(the judge a loop of `config` verifies with, the digit count of the target rows it reads)."""
    sampling = config.sampling
    rule = config.rule
    target_digits = rule_digits(target, sampling) if rule.exact or rule is Rule.GREEDY else 0
    if rule is Rule.GREEDY and config.proposer.uses_heads:
        target_digits = 0  # the heads' greedy verdicts read the target's dense rows
    params = RuleParams(rule, groups if rule is Rule.PCG else None, config.ssd_beta,
                        config.pcg_thinning_trials, config.mtp_top_m, config.mtp_threshold)
    judge = judge_for(params, target.device, target_digits, proposer.row_digits(sampling),
                      compiled_target=target.compiled)
    return judge, target_digits


def planned_costs(target: LM, proposer, config: DecodeConfig, groups, sync) -> StepCosts:
    """The step costs an adaptive draft length plans with, measured once per pair (`calibrate`) for
    the rule `cost_model.costed_rule` prices."""
    model = proposer.lm if isinstance(proposer, DraftModel) else proposer
    max_length = min(config.draft_length, proposer.max_proposals)
    return calibrated_costs(target, model, max_length, costed_rule(config), config.sampling, groups, sync)


def _loop(target: LM, proposer, prompt_ids: torch.Tensor, config: DecodeConfig, generator: torch.Generator,
          groups, stats: DecodeStats, timer: Timer, costs: StepCosts | None,
          acceptance: Sequence[float] | None) -> Iterator[list[int]]:
    vocab, sampling, device = target.vocab, config.sampling, target.device
    # the draft-only policy decodes with the draft: its steps count as the draft's
    field, forwards = ("time_draft", "draft_forwards") if config.decodes_with_draft else ("time_target", "target_forwards")
    plain_digits = digits_to_draw(target, sampling)
    reads_states = proposer is not None and proposer.reads_states
    max_length = min(config.draft_length, proposer.max_proposals) if proposer is not None else 0
    judge, target_digits = loop_judge(target, proposer, config, groups) if proposer is not None else (None, 0)
    length_policy = None
    if proposer is not None:
        stats.per_position_accepted = [0] * max_length
        stats.length_counts = [0] * (max_length + 1)
        if plans_draft_length(config):
            learn = costs is None  # calibrated costs are refined by the loop's own timings; given ones are kept
            costs = costs or planned_costs(target, proposer, config, groups, timer.sync)
            length_policy = DraftLengthPolicy(costs, max_length, learn=learn,
                                              counter=starting_counter(max_length, acceptance, proposer.acceptance))
            stats.costs = costs.as_dict()
    start_sequence(target, prompt_ids)
    if proposer is not None:
        proposer.start(target.length, config, prompt_ids)
    last = prompt_ids[-1:].to(device)  # the newest token; the target's cache holds everything before it
    while True:
        if stats.emitted >= config.max_new_tokens:
            stats.finish = "max_tokens"
            return
        ready = proposer is not None and proposer.ready()
        L = (length_policy.choose() if length_policy is not None else max_length) if ready else 0
        if not (has_room(target, L + 1) and (proposer is None or proposer.has_room(L))):
            stats.finish = "cache_full"
            return
        start = target.length

        if L == 0:  # a plain step: one target forward and one draw
            token, hidden, t0 = plain_step(target, last, sampling, plain_digits, generator, timer, field,
                                           with_hidden=reads_states, first=stats.emitted,
                                           min_tokens=config.min_new_tokens)
            n, tokens = 0, [int(token)]  # the step's one host sync
            stats.trace.append((timer("time_verify", t0), 1))
        else:
            # 1. L proposals; 2. one target pass over [last, x_1 .. x_L]; 3. the verdict.
            t0 = time.perf_counter()
            proposals, draft_rows = proposer.propose(L, last, sampling, generator)
            if proposer.counts_draft_forwards:
                stats.draft_forwards += L
            stats.catchup_tokens = proposer.catchup_tokens
            timer("time_draft", t0)
            ids = torch.cat([last, vocab.restricted_to_token_ids(proposals)])
            target_rows, hidden, t0 = verify_pass(target, ids, sampling, target_digits, timer, reads_states,
                                                  keep_logits=config.rule in (Rule.STRICT, Rule.TOPM),
                                                  first=stats.emitted, min_tokens=config.min_new_tokens)
            n, tokens = judge(proposals, draft_rows, target_rows, generator)  # the step's one host sync
            target.rollback(start + 1 + n)
            stats.trace.append((timer("time_verify", t0), n + 1))
            stats.drafted += L
            stats.accepted += n
            for i in range(n):
                stats.per_position_accepted[i] += 1
        # 4. The proposer hears the verdict; the tokens are handed out.
        if proposer is not None:
            proposer.accepted(start, L, n, tokens, hidden)
            stats.length_counts[L] += 1
        stats.steps += 1
        setattr(stats, forwards, getattr(stats, forwards) + 1)
        if length_policy is not None:
            length_policy.record(L, n, timer.take())
            stats.learned_costs = length_policy.costs
        last = vocab.token_ids(tokens[n:], device)

        tokens = emitted(tokens, vocab.stop_index, config.max_new_tokens, stats)
        if tokens:
            yield tokens
        if stats.finish:
            return
