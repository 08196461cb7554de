"""Measuring the `StepCosts` of a loaded target/draft pair (or target/heads), once per pair, for the adaptive draft length.

Times real forwards of 1 .. L_max + 1 tokens on both models (at the start of the cache, which
the decode loop's prefill then overwrites), the rule on the vocabulary's size, and one
sampling step; the median of a few repeats. Each forward is timed in the state the loop leaves
the caches in: a plain (AR) target step after a target step, a verify pass after draft steps, a
draft step after a verify pass, the rule and a sampling step after a forward (on a CPU the other
work has just evicted their data from the caches: alone, a draft step of the built-in pair looks
~2x and a verify ~1.3x cheaper than in the loop, lab-v1's PCG rule 1.5x, a draw 4x).
Results are cached per (target, draft, rule, L_max) for the models' lifetime, so every utterance
of a session plans with the same costs; `Synthesizer.load` measures them before the first
utterance (`planning.prepare`). Pass `costs=` to `decode` to pin them instead, or let another
copy of the same models adopt them (`adopt_costs`: a server's workers plan alike, so a seeded
request gives the same audio whichever worker serves it).
"""

from __future__ import annotations

import logging
import statistics
import time
import weakref
from typing import Callable

import torch

from pcgtts.groups.device import DeviceGroupTable
from pcgtts.runtime.config import DecodeConfig, SamplingConfig
from pcgtts.runtime.decode.acceptance import RuleParams, draw_uniforms, judge_for
from pcgtts.runtime.decode.rows import DenseRows, DigitRows
from pcgtts.runtime.decode.cost_model import StepCosts
from pcgtts.runtime.decode.policy import Rule
from pcgtts.runtime.decode.sampling import digits_to_draw, logits_to_probs, rule_digits, sample, sample_by_digits
from pcgtts.runtime.lm.protocol import LM

log = logging.getLogger(__name__)

_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # target -> {draft -> {key -> costs}}


def _medians(fns: list[Callable[[], object]], repeats: int, sync: Callable[[], None] | None,
             setups: list[Callable[[], object] | None]) -> list[float]:
    """Median time of each of `fns` over `repeats` calls (after one warm-up), each after its untimed
    setup, taken in rounds (every fn once per round): a burst of load from elsewhere on the machine
    then spoils one sample of each instead of every sample of one (lab-v1's 1-token forward once
    planned 4.75 ms in a load where the same calibration gives 3.6-3.8, and the plan kept it)."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(repeats + 1):
        for fn, setup, out in zip(fns, setups, times):
            if setup is not None:
                setup()
            if i == 0:
                fn()  # warm-up
                continue
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            fn()
            if sync is not None:
                sync()
            out.append(time.perf_counter() - t0)
    return [statistics.median(out) for out in times]


def _median_seconds(fn: Callable[[], object], repeats: int, sync: Callable[[], None] | None,
                    setup: Callable[[], object] | None = None) -> float:
    """Median time of `fn` over `repeats` calls (after one warm-up), each after an untimed `setup`."""
    return _medians([fn], repeats, sync, [setup])[0]


# Cached tokens the forwards are timed after: mid-utterance with a voice prompt (~150-250 reference
# codes + text), not an empty cache. onnxruntime's buffer then has 512 slots, as in the loop: its
# graph attends over the whole buffer, and at 128 (a 256-slot buffer) lab-v1's 4-token verify timed
# 1.9 ms against 2.5 ms in the loop.
_CONTEXT = 320


def _forward_costs(lm: LM, counts: range, repeats: int, sync, setup: Callable[[int], object] | None = None,
                   scores: bool = False, plain_after_plain: bool = False) -> tuple[float, ...]:
    """Median time of a forward of k tokens after `_CONTEXT` cached ones, for k in `counts`, each
    after an untimed `setup(k)` (what the loop runs before such a forward). Not made non-decreasing
    in k: a longer pass can cost less (lab-v2's compiled target: 3 tokens 4.2 ms, 4 tokens 4.0, so
    a clamp planned every L = 3 verify at the 3-token cost). `scores`: the
    forward returns a digit head's scores, as the loop's forwards do when the rules read them.
    `plain_after_plain`: a 1-token forward is timed right after an untimed one instead (a target's
    plain steps follow plain steps, not a proposal or a longer pass)."""
    context = min(_CONTEXT, lm.max_length - max(counts))
    ids = lm.vocab.restricted_to_token_ids(torch.zeros(context + max(counts), dtype=torch.long, device=lm.device))
    lm.rollback(0)
    if context > 0:
        lm.prefill(ids[:context])

    def run(k: int) -> None:
        lm.rollback(context)
        lm.forward_scores(ids[:k]) if scores else lm.forward(ids[:k])

    def before(k: int) -> None:
        if plain_after_plain and k == 1:
            run(1)
        elif setup is not None:
            setup(k)

    medians = _medians([lambda k=k: run(k) for k in counts], 2 * repeats + 1, sync, [lambda k=k: before(k) for k in counts])
    lm.rollback(0)
    return tuple(medians)


def _one_step(lm: LM) -> Callable[[], None]:
    """An untimed forward of one token at slot 1 of `lm`'s cache: it puts the processor's caches in
    the state a step of `lm` leaves them in (at slot 1, not 0: a compiled LM steps through its
    graph from there; `runtime/lm/torch_lm.py`)."""
    ids = lm.vocab.restricted_to_token_ids(torch.zeros(1, dtype=torch.long, device=lm.device))

    def step() -> None:
        if lm.length == 0:
            lm.forward(ids)
        lm.rollback(1)
        lm.forward(ids)

    return step


def _rule_and_sample_costs(target: LM, max_length: int, rule: str, sampling: SamplingConfig,
                           groups: DeviceGroupTable | None, repeats: int, sync,
                           draft_digits: int = 0) -> tuple[float, float]:
    """The rule at L = max_length and one AR sampling step, on random rows in the form the loop hands
    them over: probabilities over the vocabulary, or a digit head's scores (`sampling.rule_digits`).
    Each is timed after an untimed target step, as in the loop: on lab-v1 (CPU) the rule costs
    0.27 ms repeated back to back and 0.39-0.42 ms right after a forward, a draw 0.02 vs 0.08 ms."""
    device, vocab_size, digits = target.device, target.vocab.num_speech + 1, rule_digits(target, sampling)
    gen = torch.Generator(device=device).manual_seed(0)

    def random_output(count: int, digit_count: int) -> torch.Tensor:  # a forward's scores or logits
        return torch.randn(count, 1 + 4 * digit_count + 1 if digit_count else vocab_size, generator=gen, device=device)

    def rows(output: torch.Tensor, digit_count: int):  # as the loop makes the rules' rows from it
        if digit_count:
            return DigitRows(output, digit_count, sampling.temperature)
        return DenseRows(logits_to_probs(output, sampling))

    target_output, draft_output = random_output(max_length + 1, digits), random_output(max_length, draft_digits)
    # A random draft is rejected at once (the recovery's work every time); one equal to the target is
    # accepted throughout (no recovery). The loop lies between: the rule's cost is the mean of the two
    # (from rejections alone lab-v1's PCG rule planned 0.52-0.54 ms against 0.38-0.40 in the loop).
    cases = [(draft_output, draft_digits)]
    if draft_digits == digits:
        cases.append((target_output[:max_length], digits))
    cases = [(output, count, rows(output, count).dense().argmax(-1)) for output, count in cases]

    judges = {}
    rule = Rule(rule)
    if rule is not Rule.PCG or groups is not None:
        params = RuleParams(rule, groups if rule is Rule.PCG else None, thinning_trials=DecodeConfig.pcg_thinning_trials)
        judges = {count: judge_for(params, device, digits, count, compiled_target=target.compiled)
                  for count in {case[1] for case in cases}}

    def rule_step(output, count, tokens) -> None:
        # Both row sets are made afresh, as each verify makes them (a digit head's rows factor on first use).
        judges[count](tokens, rows(output, count), rows(target_output, digits), gen,
                      draw_uniforms(1, max_length, gen, device)[0])

    after_step = _one_step(target)
    rule_cost = (statistics.mean(_medians([lambda case=case: rule_step(*case) for case in cases], repeats, sync,
                                          [after_step] * len(cases)))
                 if rule is not Rule.PCG or groups is not None else 0.0)
    plain_digits = digits_to_draw(target, sampling)
    if plain_digits:
        scores = torch.randn(1 + 4 * plain_digits + 1, generator=gen, device=device)
        draw_one = lambda: int(sample_by_digits(scores, plain_digits, sampling.temperature, gen))  # noqa: E731
    else:
        logits = torch.randn(vocab_size, generator=gen, device=device)
        draw_one = lambda: int(sample(logits_to_probs(logits, sampling), gen))  # noqa: E731
    sample_cost = _median_seconds(draw_one, repeats, sync, setup=after_step)
    target.rollback(0)
    return rule_cost, sample_cost


def measure_costs(target: LM, draft: LM, max_length: int, rule: str, sampling: SamplingConfig,
                  groups: DeviceGroupTable | None = None, repeats: int = 3,
                  sync: Callable[[], None] | None = None) -> StepCosts:
    """Time the pair as the loop runs it: target forwards of 1 token after a target step (AR) and of
    2..max_length + 1 tokens after that many draft steps less one (a verify), draft forwards of
    1..max_length + 1 tokens after a target step, the rule at L = max_length, and one AR sampling step.
    The draft's timings are taken first: the target's then leave its cache where the loop starts."""
    started, counts = time.perf_counter(), range(1, max_length + 2)
    target_step, draft_step = _one_step(target), _one_step(draft)
    draft_digits = rule_digits(draft, sampling)
    draft_costs = _forward_costs(draft, counts, repeats, sync, setup=lambda k: target_step(), scores=draft_digits > 0)

    def drafts_before(k: int) -> None:
        for _ in range(k - 1):
            draft_step()

    target_costs = _forward_costs(target, counts, repeats, sync, setup=drafts_before,
                                  scores=rule_digits(target, sampling) > 0, plain_after_plain=True)
    costs = StepCosts(target_costs, draft_costs, *_rule_and_sample_costs(target, max_length, rule, sampling, groups,
                                                                         repeats, sync, draft_digits))
    log.info("calibrated step costs (rule %s, L_max %d) in %.2f s: %s", rule, max_length,
             time.perf_counter() - started, costs.as_dict())
    return costs


def measure_proposer_costs(target: LM, proposer, max_length: int, rule: str, sampling: SamplingConfig,
                           groups: DeviceGroupTable | None = None, repeats: int = 3,
                           sync: Callable[[], None] | None = None) -> StepCosts:
    """Time the target with a proposer that reads its hidden states (`proposers.HeadProposer` or
    `EagleProposer`): target forwards of 1..max_length + 1 tokens (each after the proposals that
    precede it in the loop), and one proposal after 1..max_length + 1
    rows, its draw included, as the 'draft' cost (flat for heads, which read one row), and for a
    proposer that chains its proposals in one call, 1..max_length of them (`StepCosts.proposals`). A proposal is
    timed right after a target step, as in the loop (the target's weights have just evicted the
    proposer's from the caches: timed alone it looks ~2x cheaper on a CPU)."""
    started, counts = time.perf_counter(), range(1, max_length + 2)
    digits = rule_digits(target, sampling)
    proposer_digits = proposer.row_digits(sampling) or 0  # the rows its proposals hand the rule
    gen = torch.Generator(device=target.device).manual_seed(0)
    # A verify of k tokens follows k - 1 proposals; a plain step follows a plain step, as in plain
    # AR and in the loop's L = 0 steps (a proposer asked for none runs nothing). Timed after a probe
    # instead, compiled lab-v1's plain step planned 2.2-2.45 ms against 2.0 in the loop, and every
    # predicted speed-up came out ~10 % high.
    target_costs = _forward_costs(target, counts, repeats, sync, scores=digits > 0, plain_after_plain=True,
                                  setup=lambda k: [proposer.probe(1, sampling, gen) for _ in range(k - 1)])
    rule_cost, sample_cost = _rule_and_sample_costs(target, max_length, rule, sampling, groups, repeats, sync,
                                                    proposer_digits)
    target_step = _one_step(target)
    draft_costs = tuple(_medians([lambda k=k: proposer.probe(k, sampling, gen) for k in counts], 2 * repeats + 1,
                                 sync, [target_step] * len(counts)))
    proposals = ()
    if proposer.chains(sampling):  # k proposals in one call cost far less than k
        proposals = tuple(_medians([lambda k=k: proposer.probe(1, sampling, gen, proposals=k) for k in counts[:-1]],
                                   2 * repeats + 1, sync, [target_step] * max_length))
    target.rollback(0)
    costs = StepCosts(target_costs, draft_costs, rule_cost, sample_cost, proposals)
    log.info("calibrated proposer costs (rule %s, L_max %d) in %.2f s: %s", rule, max_length,
             time.perf_counter() - started, costs.as_dict())
    return costs


def calibrated_costs(target: LM, draft: LM, max_length: int, rule: str, sampling: SamplingConfig,
                     groups: DeviceGroupTable | None = None, sync: Callable[[], None] | None = None) -> StepCosts:
    """`measure_costs`, once per (target, draft, rule, max_length, greedy) while both models live;
    `draft` may be a proposer from `proposers` (then `measure_proposer_costs`)."""
    if sync is None and target.device.type == "cuda":  # asynchronous: untimed without a sync
        sync = torch.cuda.synchronize
    key = (rule, max_length, sampling.greedy)
    try:
        per_draft = _CACHE.setdefault(target, weakref.WeakKeyDictionary())
        cached = per_draft.setdefault(draft, {})
    except TypeError:  # a model object that cannot be weakly referenced: measure every time
        cached = {}
    if key not in cached:
        measure = measure_costs if isinstance(draft, LM) else measure_proposer_costs
        cached[key] = measure(target, draft, max_length, rule, sampling, groups, sync=sync)
    return cached[key]


def keep_costs(target: LM, measured: StepCosts, planned: StepCosts) -> None:
    """Plan `target` with `planned` wherever the costs kept for it (with any draft or proposer) are
    `measured` (e.g. `cost_model.in_loop_costs` of them)."""
    try:
        per_draft = _CACHE.get(target, {})
    except TypeError:  # a model object that cannot be weakly referenced: nothing is kept for it
        return
    for kept in per_draft.values():
        for key, costs in kept.items():
            if costs is measured:
                kept[key] = planned


def adopt_costs(target: LM, draft, source_target: LM, source_draft) -> int:
    """Plan `target` with `draft` (or a proposer) with every cost measured so far for
    `source_target` with `source_draft`, replacing its own: for copies of the same models on the
    same machine. -> how many measurements were adopted."""
    try:
        measured = _CACHE.get(source_target, {}).get(source_draft, {})
        _CACHE.setdefault(target, weakref.WeakKeyDictionary())[draft] = dict(measured)
    except TypeError:  # a model object that cannot be weakly referenced: it measures every time
        return 0
    return len(measured)
