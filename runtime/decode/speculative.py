"""The decode loop: plain autoregressive, draft-only, and speculative decoding with a pluggable rule.

Cache bookkeeping (same for both models): the cache holds every token *before* the last
emitted one, `last`. A speculative step

  1. drafts L tokens: the draft is fed `last` (plus the final draft token of the previous step
     when that step accepted everything — the draft "catches up"), then each proposal in turn;
  2. verifies: the target is fed [last, x_1 .. x_L] in one pass, giving L + 1 distributions;
  3. applies the acceptance rule -> n accepted tokens + one recovered or bonus token;
  4. rolls both caches back to `start + 1 + n` (O(1) with the static cache).

With `adaptive_draft`, L is chosen per step in 0..draft_length by `cost_model.DraftLengthPolicy`;
L = 0 is a plain target step, after which the draft is behind: the tokens it has not seen wait
in `pending` and are fed to it (in chunks) before its next proposal.

One host sync per step: the accepted count and the tokens, copied back together (on a CPU the
rules run on the host: `acceptance_cpu.verify_one`). No I/O, logging or tokenization happens here;
token ids in and restricted-vocabulary indices (speech codes) out, in bursts as accepted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

import torch

from pcgtts.groups.device import DeviceGroupTable
from pcgtts.runtime.decode import compiled_rule
from pcgtts.runtime.decode.acceptance import draw_uniforms
from pcgtts.runtime.decode.acceptance_cpu import DenseRows, DigitRows, verify_one
from pcgtts.runtime.decode.calibrate import calibrated_costs
from pcgtts.runtime.decode.cost_model import (MEASURED_PRIOR_WEIGHT, DraftLengthPolicy, StepCosts, conditional_acceptance,
                                              starting_counter)
from pcgtts.runtime.config import STATE_POLICIES, DecodeConfig, policy_rule
from pcgtts.runtime.lm.protocol import LM
from pcgtts.runtime.decode.sampling import digits_to_draw, logits_to_probs, rule_digits, sample, sample_by_digits


@dataclass
class DecodeStats:
    """Counters of one utterance. Mean accepted length counts the bonus token (vLLM's definition)."""

    steps: int = 0  # verify steps (or target steps for `ar`)
    target_forwards: int = 0
    draft_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # speech tokens yielded (the stop token excluded)
    per_position_accepted: list[int] = field(default_factory=list)  # [L]: accepted at draft position i
    finish: str = ""  # "stop" | "max_tokens" | "cache_full" | "" while running
    time_draft: float = 0.0
    time_target: float = 0.0
    time_verify: float = 0.0  # the acceptance rule (speculative steps) or sampling (AR steps)
    length_counts: list[int] = field(default_factory=list)  # [L_max + 1]: steps run with each draft length
    catchup_tokens: int = 0  # tokens the draft was fed late, after steps with speculation off
    costs: dict | None = None  # the StepCosts the adaptive draft length planned with
    learned_costs: StepCosts | None = None  # the same, moved by this utterance's own timings (its last plan)
    trace: list[tuple[float, int]] = field(default_factory=list)  # per step: (perf_counter, tokens made)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "trace"}
        out["learned_costs"] = self.learned_costs.as_dict() if self.learned_costs is not None else None
        out["acceptance_rate"] = self.acceptance_rate
        out["mean_accepted_length"] = self.mean_accepted_length
        return out


class _Timer:
    """Accumulates wall time into a stats field; `sync` makes device work count (CUDA)."""

    def __init__(self, stats: DecodeStats, sync: Callable[[], None] | None):
        self.stats, self.sync = stats, sync
        self.step: dict[str, float] = {}  # the current step's parts, until `take()`

    def __call__(self, name: str, start: float) -> float:
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        setattr(self.stats, name, getattr(self.stats, name) + now - start)
        self.step[name] = self.step.get(name, 0.0) + now - start
        return now

    def take(self) -> dict[str, float]:
        """The parts timed since the last call (what `DraftLengthPolicy.record` learns costs from)."""
        step, self.step = self.step, {}
        return step


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
    per-position rates it starts from (`measure_acceptance`; default: the draft's recorded rate, else
    0.5: `cost_model.starting_counter`). The `mtp-*`
    policies propose with `proposer` (a `multi_token.HeadProposer` or `EagleProposer`) reading the target's states.
    """
    stats = stats if stats is not None else DecodeStats()
    if config.policy in STATE_POLICIES:
        from pcgtts.runtime.decode.multi_token import decode_multi_token

        if proposer is None:
            raise ValueError(f"policy {config.policy!r} needs a proposer on the target's states (multi-token heads "
                             "for mtp-*, an EAGLE draft for eagle-*)")
        return decode_multi_token(target, proposer, prompt_ids, config, generator, groups, stats, _Timer(stats, sync),
                                  costs, acceptance)
    if config.policy != "ar" and draft is None:
        raise ValueError(f"policy {config.policy!r} needs a draft model")
    if config.policy == "pcg" and groups is None and not config.sampling.greedy:
        raise ValueError("policy 'pcg' needs a group table")
    if config.steps_per_sync:
        from pcgtts.runtime.decode.device_loop import decode_on_device

        return decode_on_device(target, draft, prompt_ids, config, generator, groups, stats)
    if config.policy == "ar":
        return _autoregressive(target, prompt_ids, config, generator, stats, sync, "target")
    if config.policy == "draft":
        return _autoregressive(draft, prompt_ids, config, generator, stats, sync, "draft")
    return _speculative(target, draft, prompt_ids, config, generator, groups, stats, sync, costs, acceptance)


def plans_draft_length(config: DecodeConfig) -> bool:
    """Whether `decode` with `config` chooses its draft length step by step (`DraftLengthPolicy`):
    adaptive, with a policy that drafts (whole steps on the device take a fixed length: `DecodeConfig`)."""
    return config.adaptive_draft and config.policy not in ("ar", "draft")


def prepare(target: LM, draft: LM | None, config: DecodeConfig, groups: DeviceGroupTable | None = None,
            proposer=None, sync: Callable[[], None] | None = None) -> StepCosts | None:
    """Measure now what `decode` with `config` would measure in its first step: the step costs an
    adaptive draft length plans with (`calibrate.calibrated_costs`, kept while the models live).
    `Synthesizer.load` calls it so that the first utterance's time to first audio does not pay
    for it (nor for compiling a proposer's graphs, `warm_up`, or a compiled rule's package:
    `compiled_rule.for_loop`). None when `config` plans nothing (a fixed draft length, or no draft
    to plan)."""
    if proposer is not None and config.policy in STATE_POLICIES:
        proposer.warm_up(config)
    # a compiled rule's package is built or loaded now (sd / pcg, and their mtp- / eagle- forms)
    compiled_rule.for_loop(target, policy_rule(config.policy), config.sampling, groups, config.pcg_thinning_trials)
    if not plans_draft_length(config):
        return None
    if config.policy in STATE_POLICIES:
        from pcgtts.runtime.decode.multi_token import planned_costs

        return planned_costs(target, proposer, config, groups, sync) if proposer is not None else None
    return _planned_costs(target, draft, config, groups, sync) if draft is not None else None


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


def _planned_costs(target: LM, draft: LM, config: DecodeConfig, groups, sync) -> StepCosts:
    rule = "greedy" if config.sampling.greedy else config.policy
    return calibrated_costs(target, draft, config.draft_length, rule, config.sampling, groups, sync)


def _start(lm: LM, prompt_ids: torch.Tensor) -> None:
    """Cache every prompt token but the last, which the first step feeds."""
    if len(prompt_ids) > 1:
        lm.prefill(prompt_ids[:-1])
    else:
        lm.rollback(0)


def _room(lm: LM, needed: int) -> bool:
    return lm.length + needed <= lm.max_length


def _autoregressive(lm: LM, prompt_ids, config, generator, stats, sync, who) -> Iterator[list[int]]:
    timer = _Timer(stats, sync)
    vocab = lm.vocab
    _start(lm, prompt_ids)
    last = prompt_ids[-1:].to(lm.device)
    field_name = "time_target" if who == "target" else "time_draft"
    digits = digits_to_draw(lm, config.sampling)
    while True:
        if stats.emitted >= config.max_new_tokens:
            stats.finish = "max_tokens"
            return
        if not _room(lm, 1):
            stats.finish = "cache_full"
            return
        token, _, t0 = _plain_step(lm, last, config.sampling, digits, generator, timer, field_name)
        index = int(token)  # the step's one host sync
        stats.trace.append((timer("time_verify", t0), 1))
        stats.steps += 1
        if who == "target":
            stats.target_forwards += 1
        else:
            stats.draft_forwards += 1
        if index == vocab.stop_index:
            stats.finish = "stop"
            return
        stats.emitted += 1
        yield [index]
        last = vocab.token_ids([index], lm.device)


def _plain_step(lm: LM, ids: torch.Tensor, sampling, digits: int, generator: torch.Generator, timer: _Timer,
                field: str, with_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """Forward `ids` and draw the next token -> (token [], the final-normed states [T, D] when
    `with_hidden` or drawing by digit (else None), the time after the forward was timed)."""
    t0 = time.perf_counter()
    if digits:  # no 65,537-wide row at all
        scores, hidden = lm.forward_scores(ids)
        t0 = timer(field, t0)
        return sample_by_digits(scores[-1], digits, sampling.temperature, generator), hidden, t0
    logits, hidden = lm.forward_hidden(ids) if with_hidden else (lm.forward(ids), None)
    t0 = timer(field, t0)
    return sample(logits_to_probs(logits[-1], sampling), generator), hidden, t0


def _rows(rows: torch.Tensor, digits: int, sampling) -> DenseRows | DigitRows:
    """Stacked rows as the rules read them: digit scores [R, 34] (digits > 0) or probabilities [R, V]."""
    return DigitRows(rows, digits, sampling.temperature) if digits else DenseRows(rows)


def _propose(lm: LM, ids: torch.Tensor, sampling, digits: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward `ids`, draw the next token -> (token [], the row it was drawn from: digit scores or probabilities)."""
    if digits:
        scores = lm.forward_scores(ids)[0][-1]
        return sample_by_digits(scores, digits, sampling.temperature, generator), scores
    probs = logits_to_probs(lm.forward(ids)[-1], sampling)
    return sample(probs, generator), probs


def _verify_pass(lm: LM, ids: torch.Tensor, sampling, digits: int, timer: _Timer, t0: float) -> DenseRows | DigitRows:
    """The target's pass over [last, x_1 .. x_L] -> its L + 1 distributions for the rule (the forward
    timed as "time_target", turning logits into probabilities as "time_verify")."""
    if digits:
        scores = lm.forward_scores(ids)[0]
        t0 = timer("time_target", t0)
        rows = DigitRows(scores, digits, sampling.temperature)
    else:
        logits = lm.forward(ids)  # [L + 1, V_r]
        t0 = timer("time_target", t0)
        rows = DenseRows(logits_to_probs(logits, sampling))
    timer("time_verify", t0)
    return rows


_CATCH_UP_CHUNK = 64  # tokens per draft forward while it catches up (bounds the [T, V] logits it returns)


def _speculative(target: LM, draft: LM, prompt_ids, config, generator, groups, stats, sync,
                 costs: StepCosts | None = None, acceptance: Sequence[float] | None = None) -> Iterator[list[int]]:
    timer = _Timer(stats, sync)
    vocab, max_length, sampling = target.vocab, config.draft_length, config.sampling
    rule = "greedy" if sampling.greedy else config.policy
    digits = digits_to_draw(target, sampling)
    target_digits, draft_digits = rule_digits(target, sampling), rule_digits(draft, sampling)
    compiled = compiled_rule.for_loop(target, rule, sampling, groups, config.pcg_thinning_trials)
    stats.per_position_accepted = [0] * max_length
    stats.length_counts = [0] * (max_length + 1)
    device = target.device
    policy = None
    if config.adaptive_draft:
        learn = costs is None  # calibrated costs are refined by the loop's own timings; given ones are kept
        costs = costs or _planned_costs(target, draft, config, groups, sync)
        policy = DraftLengthPolicy(costs, max_length, learn=learn,
                                   counter=starting_counter(max_length, acceptance, None))
        stats.costs = costs.as_dict()
    _start(target, prompt_ids)
    last = prompt_ids[-1:].to(device)  # the newest token; the target's cache holds everything before it
    # Tokens the draft has not seen yet, ending with `last`. An adaptive run prefills the draft
    # only when it first speculates (an utterance that never does skips the draft's prefill).
    draft_started = policy is None
    if draft_started:
        _start(draft, prompt_ids)
        pending = last
    else:
        pending = prompt_ids.to(device)
    # The plain steps' tokens (restricted indices) made while speculation was off: the draft's
    # catch-up, appended to `pending` only when it speculates again (no tensor ops while off).
    skipped: list[int] = []
    while True:
        if stats.emitted >= config.max_new_tokens:
            stats.finish = "max_tokens"
            return
        L = policy.choose() if policy is not None else max_length
        if not (_room(target, L + 1) and (draft.length if draft_started else 0) + len(pending) + L <= draft.max_length):
            stats.finish = "cache_full"
            return
        start = target.length

        if L == 0:  # speculation off: one plain target step; the draft falls behind by one token
            token, _, t0 = _plain_step(target, last, sampling, digits, generator, timer, "time_target")
            tokens = [int(token)]  # the step's one host sync
            stats.trace.append((timer("time_verify", t0), 1))
            n = 0
            skipped.append(tokens[0])
        else:
            # 1. Draft L proposals (catching up first on what it missed).
            t0 = time.perf_counter()
            stats.catchup_tokens += len(skipped)
            if skipped:
                pending = torch.cat([pending, vocab.token_ids(skipped, device)])
                skipped = []
            if not draft_started:  # the first speculative step: prefill what the draft missed at once
                _start(draft, pending)
                pending, draft_started = pending[-1:], True
            while len(pending) > _CATCH_UP_CHUNK + 1:
                draft.forward(pending[:_CATCH_UP_CHUNK])
                pending = pending[_CATCH_UP_CHUNK:]
            draft_tokens = torch.empty(L, dtype=torch.long, device=device)
            rows = []  # the draft's distributions (or digit scores) the proposals were drawn from
            ids = pending
            for i in range(L):
                draft_tokens[i], row = _propose(draft, ids, sampling, draft_digits, generator)
                rows.append(row)
                ids = vocab.restricted_to_token_ids(draft_tokens[i:i + 1])
            draft_rows = _rows(torch.stack(rows), draft_digits, sampling)
            stats.draft_forwards += L
            t0 = timer("time_draft", t0)

            # 2. Verify all proposals in one target pass.
            target_rows = _verify_pass(target, torch.cat([last, vocab.restricted_to_token_ids(draft_tokens)]),
                                       sampling, target_digits, timer, t0)
            t0 = time.perf_counter()

            # 3. Accept / reject; the count and the tokens come back in one host sync.
            n, tokens = verify_one(rule, draft_tokens, draft_rows, target_rows,
                                   draw_uniforms(1, L, generator, device)[0], generator, groups=groups,
                                   ssd_beta=config.ssd_beta, thinning_trials=config.pcg_thinning_trials,
                                   compiled=compiled)
            stats.trace.append((timer("time_verify", t0), n + 1))
            stats.drafted += L
            stats.accepted += n
            for i in range(n):
                stats.per_position_accepted[i] += 1

            # 4. Roll both caches back to [.., last, x_1 .. x_n]; the draft catches up if n == L.
            target.rollback(start + 1 + n)
            draft.rollback(min(draft.length, start + 1 + n))
            pending = vocab.token_ids(tokens[n - 1:] if n == L else tokens[n:], device)  # x_L's id and the new one
        stats.steps += 1
        stats.target_forwards += 1
        stats.length_counts[L] += 1
        if policy is not None:
            policy.record(L, n, timer.take())
            stats.learned_costs = policy.costs
        last = vocab.token_ids(tokens[n:], device)

        tokens = emitted(tokens, vocab.stop_index, config.max_new_tokens, stats)
        if tokens:
            yield tokens
        if stats.finish:
            return


def emitted(tokens: list[int], stop_index: int, max_new_tokens: int, stats: DecodeStats) -> list[int]:
    """A step's tokens as they are handed out: cut at the stop token (finish "stop") and at the
    token budget; counted in `stats.emitted`."""
    if stop_index in tokens:
        tokens = tokens[: tokens.index(stop_index)]
        stats.finish = "stop"
    tokens = tokens[: max_new_tokens - stats.emitted]
    stats.emitted += len(tokens)
    return tokens
