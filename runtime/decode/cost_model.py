"""The cost model of speculative decoding, and the draft-length policy that follows it.

Pure arithmetic, no tensors: measured per-forward costs (`StepCosts`, from
`runtime/decode/calibrate.py` or given) and per-position acceptance (`AcceptanceCounter`, kept
by the decode loop) -> predicted tokens/s for every draft length L in 0..L_max, where 0 is a
plain autoregressive target step. `DraftLengthPolicy` picks the best L each step, turns
speculation off when no L beats AR, and probes with L = 1 now and then to re-estimate.

Model of one speculative step with draft length L (a_i = P(position i accepted | 1..i-1 were)):

    tokens(L) = 1 + sum_{k=1..L} prod_{i<=k} a_i                   (accepted + recovered/bonus)
    time(L)   = propose(L) + P(all L accepted) (draft(2) - draft(1)) + target(L + 1) + rule
    time(0)   = target(1) + sample                                  (tokens(0) = 1)

(the middle term: after a fully accepted step the draft is fed two tokens). propose(L) is L draft
steps, L draft(1), unless the draft proposes its L tokens in one call (a compiled chain: a fixed
cost per call plus a little per token) and they were timed as such (`StepCosts.proposals`). This is the
i.i.d. formula of Leviathan et al. with the product of per-position rates instead of alpha^k.

Draft-length planning, what lives where: here, the decisions (`plans_draft_length`: whether a
decode chooses L step by step; `costed_rule`: which rule's cost a plan prices a step at) and the
choice of L (`DraftLengthPolicy`), and what a step costs a stream that shares its passes with
others in a batch (`SharedPassCosts`, over the pass times `PassTimes` keeps); `calibrate.py`
measures the step costs; `planning.py` measures them and the starting acceptance before the first
utterance; `runtime/planner.py` keeps both per loaded model set; `loop.py` runs the chosen lengths.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from pcgtts.runtime.decode.policy import Proposer, Rule

if TYPE_CHECKING:
    from pcgtts.runtime.config import DecodeConfig


def plans_draft_length(config: "DecodeConfig") -> bool:
    """Whether a decode of `config` chooses its draft length step by step (`DraftLengthPolicy`):
    adaptive, with a policy that proposes. The loop, the planner and the checks of the settings and
    of a batch (whole steps on the device and a batch take a fixed length) all go by this answer."""
    return config.adaptive_draft and config.policy_spec.speculative


def costed_rule(config: "DecodeConfig") -> Rule:
    """The rule whose cost a plan of `config` prices each speculative step at: greedy at temperature 0,
    PCG, a draft LM's own rule (SD, SSD); SD for the rest, whose rules cost about what SD costs (one
    comparison per position)."""
    if config.sampling.greedy:
        return Rule.GREEDY
    if config.rule is Rule.PCG or config.proposer is Proposer.DRAFT:
        return config.rule
    return Rule.SD


def _interpolate(table: tuple[float, ...], tokens: int) -> float:
    """Cost of a forward of `tokens` tokens from costs measured at 1..len(table) tokens; linear beyond."""
    if tokens <= len(table):
        return table[tokens - 1]
    slope = table[-1] - table[-2] if len(table) > 1 else table[-1]
    return table[-1] + max(slope, 0.0) * (tokens - len(table))


@dataclass(frozen=True)
class StepCosts:
    """Seconds per operation for one target/draft pair on one device."""

    target_forward: tuple[float, ...]  # target forward of k tokens, k = 1 .. len (k = L + 1 is a verify)
    draft_forward: tuple[float, ...]  # draft forward of k tokens (k = 1: a draft step; more: catching up)
    rule: float = 0.0  # probabilities + acceptance rule + recovered/bonus sampling, per verify step
    sample: float = 0.0  # probabilities + sampling one token, per AR step
    # k proposals drafted in one call, k = 1 .. len (a draft that chains them: `propose`); empty: k draft steps
    proposals: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_forward", tuple(float(x) for x in self.target_forward))
        object.__setattr__(self, "draft_forward", tuple(float(x) for x in self.draft_forward))
        object.__setattr__(self, "proposals", tuple(float(x) for x in self.proposals))
        if len(self.target_forward) < 2 or not self.draft_forward:
            raise ValueError("StepCosts needs target costs for >= 2 token counts and draft costs for >= 1")
        values = (*self.target_forward, *self.draft_forward, *self.proposals, self.rule, self.sample)
        if not all(math.isfinite(v) and v >= 0 for v in values) or min(self.target_forward) <= 0:
            raise ValueError(f"costs must be finite and >= 0 (target > 0), got {values}")

    def target(self, tokens: int) -> float:
        return _interpolate(self.target_forward, tokens)

    def draft(self, tokens: int) -> float:
        return _interpolate(self.draft_forward, tokens)

    def propose(self, count: int) -> float:
        """Time to draft `count` proposals (after the draft has read the accepted rows)."""
        return _interpolate(self.proposals, count) if self.proposals else count * self.draft(1)

    @property
    def ar_step(self) -> float:
        return self.target(1) + self.sample

    def catch_up(self, missed: int) -> float:
        """Extra draft time to feed `missed` tokens it skipped while speculation was off."""
        return self.draft(1 + missed) - self.draft(1) if missed > 0 else 0.0

    def as_dict(self) -> dict:
        out = {"target_forward": list(self.target_forward), "draft_forward": list(self.draft_forward),
               "rule": self.rule, "sample": self.sample}
        return {**out, "proposals": list(self.proposals)} if self.proposals else out


class PassTimes:
    """What a batch's forwards of one model cost (`batched.StepGate` records them, a batched stream's
    plan reads them: `SharedPassCosts`): seconds per pass by the tokens it carried, all its rows
    together (a running mean per count), and the rows (streams) a pass carries (a running mean)."""

    WEIGHT = 0.1  # weight of one pass in the running means

    def __init__(self):
        self.seconds: dict[int, float] = {}
        self.rows = 1.0
        self.passes = 0
        self._ratio: dict[int, tuple[int, float]] = {}  # id of a one-stream table -> (passes, `_level` of it)

    def record(self, rows: int, tokens: int, seconds: float) -> None:
        """One pass of `rows` streams' forwards, `tokens` tokens in all, that took `seconds`."""
        if rows < 1 or tokens < 1 or not math.isfinite(seconds) or seconds <= 0:
            return
        old = self.seconds.get(tokens)
        self.seconds[tokens] = seconds if old is None else old + self.WEIGHT * (seconds - old)
        self.rows += self.WEIGHT * (rows - self.rows)
        self.passes += 1

    @property
    def streams(self) -> int:
        """The streams a pass carries, as a whole number (1: a stream has the passes to itself)."""
        return max(1, round(self.rows))

    def pass_seconds(self, tokens: int, alone: tuple[float, ...]) -> float:
        """A pass of `tokens` tokens in all: measured, or the one-stream forward of that many tokens
        (`alone`, a `StepCosts` table) times the level the measured passes ran at against it."""
        if tokens in self.seconds:
            return self.seconds[tokens]
        return _interpolate(alone, tokens) * self._level(alone)

    def _level(self, alone: tuple[float, ...]) -> float:
        """The median ratio of the measured passes to `alone`'s forward of as many tokens (1 before any)."""
        kept = self._ratio.get(id(alone))
        if kept is None or kept[0] != self.passes:
            ratios = sorted(s / _interpolate(alone, n) for n, s in list(self.seconds.items()))
            kept = (self.passes, ratios[len(ratios) // 2] if ratios else 1.0)
            self._ratio[id(alone)] = kept
        return kept[1]


@dataclass(frozen=True)
class SharedPassCosts(StepCosts):
    """One stream's step costs in a batch, where its forwards share a pass with the other streams'
    (`batch.SlotSeat`: its loop plans its adaptive draft length with these).

    The model of a batched pass: it reads every weight once and does each row's work, so a pass of
    N tokens in all costs about what one stream's forward of N tokens costs (`passes`' measurements,
    the one-stream table scaled to their level where a count was not measured). With B streams in
    the pass all verifying k tokens (the plan's assumption: the others plan as this one does), a
    pass carries B k tokens and every stream waits for it, so one stream's forward of k tokens costs
    its share, pass(B k) / B: the weights' read is split B ways and each token adds the pass's
    marginal time. Why this and not the stream's own wait, pass(others + k): that would charge a
    stream nothing for the time its extra tokens cost every other stream of the pass, and make
    speculation look better the more streams share it; the share is what the batch's throughput
    pays. As B grows the read's share vanishes and a token of a verify costs the same marginal time
    as a plain step's token: a speculative step then pays L + 1 tokens' time for its expected
    tokens(L) < L + 1, so the plan falls to plain decoding (L = 0), as it must. A draft LM's forwards
    also meet at the gate and are shared like the target's (`draft_passes`), and so are an
    attention-free EAGLE draft's proposals, B rows a call (`proposal_passes`: a proposal costs its
    share of a call carrying every stream's); the heads' proposals and the rule are one stream's own
    work, priced as measured. Alone (B = 1) a stream plans with its given costs unchanged, so a
    seeded stream alone in the batch chooses what it chooses on the one-stream lane."""

    passes: PassTimes | None = None
    draft_passes: PassTimes | None = None
    proposal_passes: PassTimes | None = None

    def target(self, tokens: int) -> float:
        return _shared(self.passes, self.target_forward, tokens)

    def draft(self, tokens: int) -> float:
        return _shared(self.draft_passes, self.draft_forward, tokens)

    def propose(self, count: int) -> float:
        streams = self.passes.streams if self.passes is not None else 1
        if self.proposal_passes is None or streams == 1:
            return super().propose(count)
        return count * self.proposal_passes.pass_seconds(streams, (super().propose(1),)) / streams


def _shared(passes: PassTimes | None, alone: tuple[float, ...], tokens: int) -> float:
    """A stream's share of a pass where every stream feeds `tokens` (`SharedPassCosts`)."""
    streams = passes.streams if passes is not None else 1
    if streams == 1:
        return _interpolate(alone, tokens)
    return passes.pass_seconds(streams * tokens, alone) / streams


def shared_pass_costs(costs: StepCosts, passes: PassTimes, draft_passes: PassTimes | None = None,
                      proposal_passes: PassTimes | None = None) -> SharedPassCosts:
    """`costs` (one stream's, measured alone) as a batched stream plans with them (`SharedPassCosts`)."""
    return SharedPassCosts(costs.target_forward, costs.draft_forward, costs.rule, costs.sample, costs.proposals,
                           passes=passes, draft_passes=draft_passes, proposal_passes=proposal_passes)


def pays_in_batch(costs: StepCosts, acceptance: Sequence[float] | None, max_length: int, passes: PassTimes,
                  streams: int, margin: float = 0.05, proposal_passes: PassTimes | None = None) -> bool:
    """Whether a stream starting a sentence beside `streams` - 1 others (or alone) would speculate: its
    plan at the starting `acceptance` (None: 0.5 a position), with its forwards' share of passes
    carrying all `streams` (`SharedPassCosts`; `proposal_passes` where its proposals share calls too),
    beats plain decoding by `margin` (the adaptive policy's switch-on margin). When it does not, the
    sentence decodes plainly on the batch's own steps, which carry every plain stream in one pass
    with none of a speculative loop's per-stream work."""
    view = copy.copy(passes)
    view.rows = float(max(streams, 1))  # alone: the one-stream costs as they are
    per_length = predict(shared_pass_costs(costs, view, proposal_passes=proposal_passes), acceptance or (0.5,),
                         max_length)
    best = fastest(per_length)
    return best > 0 and per_length[best] >= (1 + margin) * per_length[0]


def survival(acceptance: Sequence[float], length: int) -> list[float]:
    """P(positions 1..k all accepted) for k = 1..length; positions past the list reuse its last rate."""
    out, p = [], 1.0
    for k in range(length):
        a = acceptance[min(k, len(acceptance) - 1)] if acceptance else 0.0
        p *= min(max(a, 0.0), 1.0)
        out.append(p)
    return out


def expected_tokens(acceptance: Sequence[float], length: int) -> float:
    """Expected tokens emitted by one verify step of draft length `length` (bonus included)."""
    return 1.0 + sum(survival(acceptance, length))


def step_seconds(costs: StepCosts, acceptance: Sequence[float], length: int) -> float:
    """Expected time of one step of draft length `length` (0: an AR step)."""
    if length == 0:
        return costs.ar_step
    all_accepted = survival(acceptance, length)[-1]
    return (costs.propose(length) + all_accepted * (costs.draft(2) - costs.draft(1))
            + costs.target(length + 1) + costs.rule)


def predict(costs: StepCosts, acceptance: Sequence[float], max_length: int) -> list[float]:
    """Predicted tokens/s for L = 0 .. max_length: `expected_tokens` / `step_seconds` for each L, with
    the survival products computed once (the policy asks every decode step: on the built-in voice's
    1.7 ms step, planning from scratch for every L had cost ~4 % of the step)."""
    alive = survival(acceptance, max_length)
    out, accepted = [1.0 / costs.ar_step], 0.0
    fed_two = costs.draft(2) - costs.draft(1)
    for n in range(1, max_length + 1):
        accepted += alive[n - 1]  # sum(alive[:n]), added in the same order as expected_tokens
        out.append((1.0 + accepted) / (costs.propose(n) + alive[n - 1] * fed_two + costs.target(n + 1) + costs.rule))
    return out


def best_length(costs: StepCosts, acceptance: Sequence[float], max_length: int) -> int:
    """The L in 0..max_length with the most predicted tokens/s (the shortest among ties)."""
    return fastest(predict(costs, acceptance, max_length))


def fastest(per_length: Sequence[float], shortest: int = 0) -> int:
    """The L >= `shortest` with the most predicted tokens/s in `per_length` (the shortest among ties)."""
    return max(range(shortest, len(per_length)), key=lambda n: (per_length[n], -n))


class AcceptanceCounter:
    """Running per-position acceptance: a_i = (accepted_i + w p_i) / (tried_i + w).

    Position i is *tried* in a step when the draft proposed it and 1..i-1 were accepted. The
    prior p_i is `prior[i]`, or past the end of `prior` the previous position's estimate (so
    estimates exist for lengths never run); w is `prior_weight`, the prior's worth in steps.
    Counts decay by `decay` per step, so the estimate follows an utterance whose acceptance drifts.
    """

    def __init__(self, max_length: int, prior: Sequence[float] = (0.5,), prior_weight: float = 2.0,
                 decay: float = 0.98):
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        if not (prior and all(0 <= p <= 1 for p in prior) and prior_weight > 0 and 0 < decay <= 1):
            raise ValueError("need 1 or more prior rates in [0, 1], prior_weight > 0, 0 < decay <= 1")
        self.prior, self.prior_weight, self.decay = tuple(float(p) for p in prior), prior_weight, decay
        self.tried = [0.0] * max_length
        self.accepted = [0.0] * max_length

    def update(self, length: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= length <= len(self.tried):
            raise ValueError(f"bad step: {num_accepted} accepted of {length} (max {len(self.tried)})")
        for i in range(len(self.tried)):
            self.tried[i] *= self.decay
            self.accepted[i] *= self.decay
        for i in range(min(num_accepted + 1, length)):
            self.tried[i] += 1.0
            self.accepted[i] += float(i < num_accepted)

    def rates(self, optimism: float = 0.0) -> list[float]:
        """Per-position estimates; `optimism` z > 0 adds z standard errors to each (an upper
        confidence bound: what the evidence does not yet rule out)."""
        out, rate = [], self.prior[0]
        for i, (tried, accepted) in enumerate(zip(self.tried, self.accepted)):
            prior = self.prior[i] if i < len(self.prior) else rate
            rate = (accepted + self.prior_weight * prior) / (tried + self.prior_weight)
            out.append(min(1.0, rate + optimism * math.sqrt(rate * (1 - rate) / (tried + self.prior_weight))))
        return out


def conditional_acceptance(per_position_accepted: Sequence[int], speculative_steps: int) -> list[float]:
    """a_i = P(position i accepted | 1..i-1 accepted) from counts of accepted proposals per position
    over `speculative_steps` steps (exact for a fixed L; for an adaptive run, steps that drafted
    fewer positions make the later rates an under-estimate); 0 for a position never tried."""
    rates, tried = [], speculative_steps
    for accepted in per_position_accepted:
        rates.append(accepted / tried if tried else 0.0)
        tried = accepted
    return rates


# What a measured starting acceptance (`measure_acceptance`: one fixed-length utterance at load) is
# worth against an utterance's own steps, in steps. Simulated on lab-v2's eagle-pcg costs and rates
# (`benchmarks/simulate_length_policy.py`): from the 0.5 prior the policy reached
# 1.06x AR in model time; from the measured rates 1.11x at weight 2, 1.14x at 6, 1.15x at 8 and 10
# (fixed L = 3: 1.13x). More weight slows the move away from a start that is wrong for the voice.
MEASURED_PRIOR_WEIGHT = 8.0


def starting_counter(max_length: int, measured: Sequence[float] | None,
                     recorded: float | None) -> AcceptanceCounter:
    """The acceptance an adaptive draft length starts an utterance from: `measured` per-position
    rates for this pair, rule and sampling if there are any (weighted as `MEASURED_PRIOR_WEIGHT`
    steps), else the draft's `recorded` rate (from its trainer: SD's, for every rule), else 0.5."""
    if measured:
        return AcceptanceCounter(max_length, prior=measured, prior_weight=MEASURED_PRIOR_WEIGHT)
    return AcceptanceCounter(max_length, prior=(recorded if recorded is not None else 0.5,))


def counted_seconds(costs: StepCosts, length_counts: Sequence[int], catchup_tokens: int) -> float:
    """Time the cost model charges for a finished decode: `length_counts[L]` steps of draft length
    L (0 = AR) plus the draft's catch-up on `catchup_tokens` tokens (fed late, at its per-token
    rate). What the adaptive policy is judged by in tests: model time, not wall time."""
    steps = sum(count * (costs.ar_step if n == 0 else costs.propose(n) + costs.target(n + 1) + costs.rule)
                for n, count in enumerate(length_counts))
    return steps + costs.catch_up(catchup_tokens)


def _rebuilt(costs: StepCosts, **changes) -> StepCosts:
    """`dataclasses.replace(costs, **changes)` without `__post_init__`'s conversion and checks, for the
    policy's per-step updates, whose values are convex combinations or positive multiples of valid
    ones (`_moved`, `_scaled`): building a checked StepCosts twice a step had cost ~35 µs of it."""
    new = object.__new__(StepCosts)
    for name in ("target_forward", "draft_forward", "proposals"):
        object.__setattr__(new, name, tuple(changes[name]) if name in changes else getattr(costs, name))
    for name in ("rule", "sample"):
        object.__setattr__(new, name, changes.get(name, getattr(costs, name)))
    return new


def _moved(costs: StepCosts, length: int, seconds: dict[str, float], timed: dict, rate: float) -> StepCosts:
    """`costs` with the parts `seconds` measured for one step of draft length `length` moved toward
    the measurements; `timed` counts the measurements of each entry (("target", k), ("draft", 0) or
    ("proposals", L - 1), "rule", "sample") and is updated. An entry's n-th measurement moves it by max(1 / n, `rate`): the
    first replaces the load-time value, the next ones average, then `rate` follows drift (a part
    timed only by the rare probes would otherwise need dozens of probes to leave a wrong value)."""
    def toward(key, old: float, new: float | None) -> float:
        if new is None or not math.isfinite(new) or new < 0:
            return old
        timed[key] = timed.get(key, 0) + 1
        return old + max(1.0 / timed[key], rate) * (new - old)

    target = list(costs.target_forward)
    if length < len(target) and seconds.get("time_target"):
        target[length] = toward(("target", length), target[length], seconds["time_target"])
    if length == 0:
        return _rebuilt(costs, target_forward=target, sample=toward("sample", costs.sample, seconds.get("time_verify")))
    draft, proposals = list(costs.draft_forward), list(costs.proposals)
    if seconds.get("time_draft") and length <= len(proposals):  # the step's proposals, drafted in one call
        proposals[length - 1] = toward(("proposals", length - 1), proposals[length - 1], seconds["time_draft"])
    elif seconds.get("time_draft"):
        draft[0] = toward(("draft", 0), draft[0], seconds["time_draft"] / length)
    return _rebuilt(costs, target_forward=target, draft_forward=draft, proposals=proposals,
                    rule=toward("rule", costs.rule, seconds.get("time_verify")))


def _scaled(costs: StepCosts, loaded: StepCosts, timed: dict) -> StepCosts:
    """`costs` with every entry the loop has not timed yet set to its load-time value times the ratio
    the loop measured for the target's forwards it did time (their median). In the loop every part
    runs above its load-time cost (the other work evicts its data from the caches); learning only
    the parts that run would make those that do not look cheap by comparison: on the built-in
    voice, with speculation off, the AR step rose 20 % toward its in-loop cost while the untimed
    speculative step kept its load-time cost, until the policy switched on for a gain that was not there."""
    ratios = sorted(costs.target_forward[k] / loaded.target_forward[k]
                    for k in range(len(loaded.target_forward)) if ("target", k) in timed)
    if not ratios:
        return costs
    f = ratios[len(ratios) // 2]
    target = [c if ("target", k) in timed else loaded.target_forward[k] * f for k, c in enumerate(costs.target_forward)]
    draft = [c if ("draft", k) in timed else loaded.draft_forward[k] * f for k, c in enumerate(costs.draft_forward)]
    proposals = [c if ("proposals", k) in timed else loaded.proposals[k] * f for k, c in enumerate(costs.proposals)]
    return _rebuilt(costs, target_forward=target, draft_forward=draft, proposals=proposals,
                    rule=costs.rule if "rule" in timed else loaded.rule * f,
                    sample=costs.sample if "sample" in timed else loaded.sample * f)


def in_loop_costs(costs: StepCosts, length: int, seconds: dict[str, float]) -> StepCosts:
    """`costs` with the parts a decode at draft length `length` timed inside its loop (`seconds`: a
    step's mean, as `DraftLengthPolicy.record` takes them) in place of their isolated timings, and every
    part it did not time scaled by the target's in-loop ratio (`_scaled`). Isolated timings undercount
    the loop's (lab-v2's three chained EAGLE proposals 0.62 ms alone, 1.05 ms in the loop; its PCG rule
    0.15 and 0.27); `DraftLengthPlanner.plan` plans with these after its calibration decode."""
    timed: dict = {}
    return _scaled(_moved(costs, length, seconds, timed, 1.0), costs, timed)


class DraftLengthPolicy:
    """Chooses L per step from the cost model; L = 0 (plain AR) when speculation cannot win.

    While speculation is off, one probe step with L = 1 runs every `probe_interval` AR steps
    to re-estimate acceptance. The interval is the shortest one whose expected extra cost
    (a rejected L = 1 step plus the draft's catch-up on the skipped tokens, minus the AR step
    it replaces) stays within `probe_budget` of AR's cost per token; None (no probes: the
    utterance stays on AR) when even the longest interval would cost more, which happens
    when the draft's per-token catch-up alone exceeds the budget. Hysteresis: speculation is
    switched on when the point estimates say it wins by `margin` (the model leaves out the draft's
    catch-up on the tokens it skipped, and costs measured at load are noisy: a built-in-voice run
    planned pcg at L = 1 as 0.99x AR on a break-even estimate and achieved 0.82x),
    but switched off only when it loses even with every rate raised by `optimism` standard errors
    (so noise near the break-even point does not park the utterance on AR between rare probes).
    Deterministic given the costs and the verdicts, so a seeded run is reproducible given the
    same costs.
    """

    MAX_PROBE_INTERVAL = 1024
    LEARNING_RATE = 0.1  # weight of one measured step in the running cost estimates

    def __init__(self, costs: StepCosts, max_length: int, probe_budget: float = 0.02,
                 counter: AcceptanceCounter | None = None, optimism: float = 1.0, learn: bool = True,
                 margin: float = 0.05):
        if not 0 < probe_budget < 1:
            raise ValueError(f"probe_budget must lie in (0, 1), got {probe_budget}")
        if optimism < 0:
            raise ValueError(f"optimism must be >= 0, got {optimism}")
        if not 0 <= margin < 1:
            raise ValueError(f"margin must lie in [0, 1), got {margin}")
        self.costs, self.max_length = costs, max_length
        self._loaded, self._timed = costs, {}  # the load-time costs; how often the loop timed each entry
        self.counter = counter or AcceptanceCounter(max_length)
        self.probe_budget, self.optimism, self.learn, self.margin = probe_budget, optimism, learn, margin
        self.probe_interval = self._probe_interval(probe_budget)
        self._ar_run = 0
        self._speculating = False  # whether the last step speculated (a probe included)
        self._probing = False  # whether it was a probe

    def _probe_interval(self, budget: float) -> int | None:
        """The shortest interval k in 1..MAX_PROBE_INTERVAL whose probe (a rejected L = 1 step plus the
        draft's catch-up on k tokens, less the AR step it replaces) costs at most `budget` of AR's k + 1
        steps, or None. Past the draft's cost table the catch-up grows linearly in k, so the search
        there is solved, not scanned: scanning a thousand intervals had cost every utterance's start
        ~3 ms on the built-in voice when none was affordable."""
        costs, limit = self.costs, self.MAX_PROBE_INTERVAL
        ar = costs.ar_step
        probe = step_seconds(costs, [0.0], 1) - ar

        def affordable(k: int) -> bool:
            return probe + costs.catch_up(k) <= budget * ar * (k + 1)

        linear_from = len(costs.draft_forward)  # from here on draft(1 + k) is on the linear stretch
        for k in range(1, min(linear_from, limit) + 1):
            if affordable(k):
                return k
        table = costs.draft_forward
        slope = max(table[-1] - table[-2], 0.0) if len(table) > 1 else table[-1]
        allowed = budget * ar  # what each further interval adds to the budget
        if linear_from >= limit or slope >= allowed:  # the excess no longer shrinks with k
            return None
        # probe + table[-1] + slope * (1 + k - len) - draft(1) <= allowed * (k + 1), solved for k
        excess = probe + table[-1] + slope * (1 - linear_from) - costs.draft(1) - allowed
        k = max(linear_from + 1, math.ceil(excess / (allowed - slope)))
        while k > linear_from + 1 and affordable(k - 1):  # float rounding: the scan's answer exactly
            k -= 1
        while k <= limit and not affordable(k):
            k += 1
        return k if k <= limit else None

    def choose(self) -> int:
        rates = self.counter.rates()
        per_length = predict(self.costs, rates, self.max_length)
        length = fastest(per_length)
        if length > 0 and not self._speculating and per_length[length] < (1 + self.margin) * per_length[0]:
            length = 0  # off, and the gain it would switch on for is within the model's error
        if length == 0 and self._speculating and best_length(self.costs, self.counter.rates(self.optimism),
                                                             self.max_length) > 0:
            # Speculating, and the evidence does not yet show that it loses: stay on, at the
            # best L >= 1. (A dip of the estimate would otherwise switch it off, and while off
            # only the rare probes can switch it back on.)
            length = fastest(per_length, shortest=1)
        self._speculating = length > 0
        if length > 0:
            self._ar_run = 0
            return length
        self._ar_run += 1
        if self.probe_interval is not None and self._ar_run > self.probe_interval:
            self._ar_run, self._probing = 0, True
            return 1
        return 0

    def record(self, length: int, num_accepted: int, seconds: dict[str, float] | None = None) -> None:
        """A finished step of draft length `length`; `seconds` (optional) are its measured parts,
        as the decode loop times them: "time_draft" (all its proposals), "time_target" (the
        target's forward of length + 1 tokens) and "time_verify" (the rule, or the AR sample).
        With `learn`, each moves the cost it measures toward the measurement (`_moved`),
        so costs calibrated on a quiet machine follow what the steps really cost inside the loop
        (where the codec and the other model evict each other's weights from the caches); the costs
        of parts not run yet follow the target's measured in-loop ratio (`_scaled`)."""
        if length > 0:
            self.counter.update(length, num_accepted)
        if seconds and self.learn:
            self.costs = _scaled(_moved(self.costs, length, seconds, self._timed, self.LEARNING_RATE),
                                 self._loaded, self._timed)
            if self._probing:  # what a probe costs changed: so does how often to afford one
                self.probe_interval = self._probe_interval(self.probe_budget)
        self._probing = False
