"""Self-speculative decoding from the target's own hidden states: multi-token heads or an EAGLE draft.

One target pass per step does two jobs (Speech-LLaMA's "verify this step, predict the next"):

  1. the target is fed [last, x_1 .. x_l]: l proposals made by the heads in the previous step;
     its L + 1 distributions verify them with the policy's rule -> n accepted + one new token;
  2. the proposer reads the states of the accepted rows and proposes the l tokens after the new
     one; the cache is rolled back to [.., last, x_1 .. x_n]. `HeadProposer`: the row that
     predicted the new token (row n) goes through the k heads at once. `EagleProposer`: rows
     0 .. n with the tokens chosen after them extend its one-block cache, then it proposes
     autoregressively from its own predicted states (runtime/lm/eagle.py).

The first step has no proposals (a plain target step). With `adaptive_draft`, the number of
heads used for the next step (0 = a plain target step) is chosen by the cost model, as for a
draft model (`cost_model.DraftLengthPolicy`; the heads' cost per proposal is the draft cost).
Policies (how heads propose / the rule):

  mtp-sd         sample x_i from head i          SD rule: exact (the target's distribution)
  mtp-pcg        sample x_i from head i          PCG rule: exact at group level
  mtp-strict     argmax of head i                accept while x_i is the target's argmax, then
                                                 sample from the target (greedy at T = 0)
  mtp-topm       argmax of head i                accept while x_i is in the target's top M
  mtp-threshold  argmax of head i                accept while target(x_i) >= tau
  mtp-viterbi    Viterbi path over the heads'    top-M rule, as mtp-topm
                 top-k with code transitions
                 (codec-TTS MTP; runtime/decode/viterbi.py)
  eagle-sd       sample from the EAGLE draft     SD rule: exact
  eagle-pcg      sample from the EAGLE draft     PCG rule: exact at group level

strict, top-M, threshold and Viterbi are not exact in distribution: they trade fidelity to the
target's sampling distribution for longer accepted runs (the quality harness measures the cost).
At temperature 0, mtp-sd / mtp-pcg / mtp-strict / eagle-* verify greedily and equal plain greedy decoding.
No I/O, logging or tokenization here; restricted-vocabulary indices in and out, as speculative.py.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterator, Sequence

import torch

from pcgtts.runtime.config import MTP_POLICIES, PCG_POLICIES, STATE_POLICIES, policy_rule
from pcgtts.runtime.decode import compiled_rule
from pcgtts.runtime.decode.calibrate import calibrated_costs
from pcgtts.runtime.decode.cost_model import DraftLengthPolicy, StepCosts, starting_counter
from pcgtts.runtime.decode.acceptance import draw_uniforms, outcome, verify_threshold, verify_top_m
from pcgtts.runtime.decode.acceptance_cpu import DigitRows, verify_one
from pcgtts.runtime.decode.sampling import digits_to_draw, logits_to_probs, rule_digits, sample, sample_by_digits
from pcgtts.runtime.decode.speculative import _plain_step, _room, _start, emitted

EXACT_STATE_POLICIES = ("mtp-sd", "mtp-pcg", "eagle-sd", "eagle-pcg")


class HeadProposer:
    """The target's multi-token heads on its shared speech head: `heads.TorchHeads`, or the graph
    exported with an onnxruntime target (`onnxruntime.OrtHeads`)."""

    acceptance = None  # no measured acceptance recorded with the heads: the adaptive length's default prior

    def __init__(self, step, transitions=None):
        self.step, self.transitions = step, transitions

    @classmethod
    def from_heads(cls, heads, target, transitions=None) -> "HeadProposer":
        """Loaded `MTPHeads` on their torch target."""
        from pcgtts.runtime.lm.heads import TorchHeads

        return cls(TorchHeads(heads, _state_model(target, "multi-token heads")), transitions)

    @property
    def max_proposals(self) -> int:
        return self.step.num_heads

    def start(self, first_slot: int) -> None:
        """A new utterance (the heads keep no state)."""

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, count: int) -> torch.Tensor:
        """hidden [D] -> [count, V_r] logits of the tokens 2 .. count + 1 positions ahead."""
        return self.step.logits(hidden, count)

    def chains(self, sampling) -> bool:
        """Heads propose one by one (see `EagleProposer.chains`)."""
        return False

    def warm_up(self, config) -> None:
        """Nothing to compile ahead (see `EagleProposer.warm_up`)."""

    @torch.inference_mode()
    def probe(self, rows: int, sampling, generator: torch.Generator) -> None:
        """The work of one proposal, its draw included (the cost model's draft step); the heads read one
        row whatever `rows` is."""
        step = self.step
        logits = self.logits(torch.zeros(step.hidden_size, dtype=step.dtype, device=step.device), 1)[0]
        _draw_like_a_proposal(logits, sampling, generator)

    def propose(self, policy: str, hidden: torch.Tensor, tokens: list[int], slot: int, count: int, config,
                generator: torch.Generator) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The accepted rows' states hidden [n + 1, D] and the tokens chosen after them -> (proposals
        [count] int64, their distributions [count, V] or None); (None, None) when count is 0."""
        if not count:
            return None, None
        # the final state: a row's last D entries (a target that also returns the layers an EAGLE
        # draft reads puts them first: `Llama.with_taps`)
        head_logits = self.logits(hidden[-1, -self.step.hidden_size:], count)
        sampling = config.sampling
        if policy in EXACT_STATE_POLICIES and not sampling.greedy:
            probs = logits_to_probs(head_logits, sampling)
            return sample(probs, generator), probs
        if policy == "mtp-viterbi":
            from pcgtts.runtime.decode.viterbi import viterbi_propose

            proposals = viterbi_propose(torch.log_softmax(head_logits.float(), -1), self.transitions, tokens[-1],
                                        config.viterbi_top_k)
            return proposals.to(head_logits.device), None
        return head_logits.argmax(-1), None


class EagleProposer:
    """An EAGLE draft step (`runtime/lm/eagle.py`: torch, or the onnxruntime graph) in the hidden-state loop.

    Its slot s holds the target's row at target slot `first_slot + s` (the prompt's last token is
    slot 0). Rows whose proposals were not asked for (speculation off) wait in `pending` and are
    fed with the next proposal's forward. With a `chain` (`eagle.CompiledEagleChain`, a compiled
    CPU target's), proposals drawn digit by digit are made together in one call. Proposals are
    drawn at the draft's own temperature (`eagle.proposal_temperature`), and the rows handed to the
    rule are that distribution."""

    max_proposals = 1 << 30  # any number: the draft length alone bounds it

    def __init__(self, step, chain=None):
        self.step, self.chain, self.max_length = step, chain, step.max_length
        self.acceptance = step.acceptance  # the adaptive draft length's starting estimate (None: its default)
        self.temperature_scales = step.temperature_scales  # the draft's own temperature (`proposal_sampling`)
        self.first_slot, self.length = 0, 0
        self.pending_states, self.pending_tokens = [], []
        self._warmed: set[int] = set()  # proposal counts whose chain has run once (`warm_up`)

    @classmethod
    def for_target(cls, target, eagle_file=None) -> "EagleProposer":
        """The target's EAGLE draft: `eagle_file` on a torch target, the graph exported with an
        onnxruntime target (`pcgtts export onnx`, which finds the draft next to the checkpoint)."""
        if hasattr(target, "eagle_step"):
            if eagle_file is not None:
                raise ValueError("the onnxruntime backend runs the EAGLE draft exported with the target "
                                 "(`pcgtts export onnx --eagle FILE`), not a safetensors file")
            return cls(target.eagle_step())
        from pcgtts.runtime.lm.eagle import EagleDraft

        if eagle_file is None:
            raise ValueError("an EAGLE draft file is needed (`pcgtts train eagle`)")
        model = _state_model(target, "an EAGLE draft")
        return cls.from_draft(EagleDraft.load(eagle_file, model, fingerprint=target.fingerprint), target)

    @classmethod
    def from_draft(cls, draft, target) -> "EagleProposer":
        """A loaded `EagleDraft` on its torch target (an attention-free float32 draft on a CPU steps in
        NumPy: `eagle.HostEagleStep`, half the cost of a proposal; on a compiled target with a digit
        head its proposals are chained in one compiled call: `eagle.CompiledEagleChain`)."""
        from pcgtts.runtime.lm.eagle import CompiledEagleChain, HostEagleStep, TorchEagleStep

        model = _state_model(target, "an EAGLE draft")
        if draft.feature_layers:
            target.tap_layers(draft.feature_layers)
        if not HostEagleStep.suits(draft, model):
            return cls(TorchEagleStep(draft, model, target.vocab, target.max_length))
        chained = getattr(target, "compiled", False) and model.samples_digits
        chain = CompiledEagleChain(draft, model, target.vocab) if chained else None
        return cls(HostEagleStep(draft, model, target.vocab, target.max_length), chain)

    def start(self, first_slot: int) -> None:
        self.first_slot, self.length = first_slot, 0
        self.pending_states, self.pending_tokens = [], []

    def _run(self, states: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed rows states [k, D] with the tokens chosen after them [k] at the next free slots ->
        (f of the last row [D], its head scores)."""
        start = self._take(len(tokens))
        return self.step.run(states, tokens, start)

    def _take(self, slots: int) -> int:
        """The first of the next `slots` free slots, now taken."""
        if self.length + slots > self.max_length:
            raise ValueError("the EAGLE draft's cache is full")
        self.length += slots
        return self.length - slots

    def chains(self, sampling) -> bool:
        """Whether proposals at `sampling` are made together in one call."""
        return self.chain is not None and sampling.plain

    def proposal_sampling(self, sampling):
        """`sampling` at the temperature this draft proposes at (`eagle.proposal_temperature`)."""
        from pcgtts.runtime.lm.eagle import proposal_temperature

        temperature = proposal_temperature(self.temperature_scales, sampling.temperature)
        return sampling if temperature == sampling.temperature else replace(sampling, temperature=temperature)

    def _chained(self, states: torch.Tensor, tokens: torch.Tensor, count: int, temperature: float,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """`count` proposals after rows states [k, D] (an attention-free draft reads only the last)
        in one call -> (proposals [count], their head scores [count, W])."""
        self._take(len(tokens) + count - 1)  # the slots a step-by-step proposer would use
        uniforms = torch.rand(count, self.step.digits + 1, generator=generator, device=states.device)
        return self.chain(states[-1], tokens[-1], uniforms, temperature)

    def warm_up(self, config) -> None:
        """Compile a chain's graphs for 1..config.draft_length proposals now, not in an utterance's
        first steps (a few seconds each the first time). Once per count: a seeded stream calls it
        before every utterance (`Synthesizer.plan`), where running the chains again cost ~9.5 ms."""
        if self.chains(config.sampling):
            generator = torch.Generator(device=self.step.device).manual_seed(0)
            for count in range(1, config.draft_length + 1):
                if count not in self._warmed:
                    self.probe(1, config.sampling, generator, proposals=count)
                    self._warmed.add(count)

    @torch.inference_mode()
    def probe(self, rows: int, sampling, generator: torch.Generator, proposals: int = 1) -> None:
        """The work of `proposals` proposals after `rows` rows are fed, their draws included as
        `propose` draws them (one: the cost model's draft forward of `rows` tokens; several: its
        `proposals` entry, for a chain): a digit head's scores are drawn digit by digit, never
        expanded (expanding them and a dense draw had doubled a proposal's planned cost on
        onnxruntime: 0.55-0.67 ms against 0.30 in the loop)."""
        self.start(0)
        step = self.step
        states = torch.zeros(rows, step.hidden_size, dtype=step.dtype, device=step.device)
        tokens = torch.zeros(rows, dtype=torch.long, device=step.device)
        if proposals != 1 or self.chains(sampling):
            self._propose(states, tokens.tolist(), 0, proposals, sampling, generator)
            self.start(0)
            return
        scores = self._run(states, tokens)[1]
        if step.digits and (sampling.plain or sampling.greedy):
            sample_by_digits(scores, step.digits, sampling.temperature, generator)
        else:
            _draw_like_a_proposal(step.scores_to_logits(scores), sampling, generator)
        self.start(0)

    @torch.inference_mode()
    def propose(self, policy: str, hidden: torch.Tensor, tokens: list[int], slot: int, count: int, config,
                generator: torch.Generator) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """As `HeadProposer.propose`; `slot` is the target slot of hidden's row 0."""
        return self._propose(hidden, tokens, slot, count, config.sampling, generator)

    def _propose(self, hidden: torch.Tensor, tokens: list[int], slot: int, count: int, sampling,
                 generator: torch.Generator) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        step = self.step
        self.pending_states.append(hidden.to(step.dtype))
        self.pending_tokens.extend(tokens)
        if not count:
            return None, None
        sampling = self.proposal_sampling(sampling)
        states = torch.cat(self.pending_states)
        self.length = slot - self.first_slot - (len(states) - len(hidden))  # the pending rows' first slot
        chosen = torch.tensor(self.pending_tokens, device=states.device)
        self.pending_states, self.pending_tokens = [], []
        if self.chains(sampling):
            proposals, rows = self._chained(states, chosen, count, sampling.temperature, generator)
            return proposals, DigitRows(rows, self.step.digits, sampling.temperature)
        f, scores = self._run(states, chosen)
        # A digit head at plain temperature is sampled digit by digit (greedy: its argmax, digit by
        # digit); the rules' rows are then expanded once for all proposals, after the loop.
        by_digits = bool(step.digits) and (sampling.plain or sampling.greedy)
        proposals = torch.empty(count, dtype=torch.long, device=states.device)
        rows = []  # head scores (by_digits) or distributions, one per proposal
        for i in range(count):
            if i:
                f, scores = self._run(f[None], proposals[i - 1:i])
            if by_digits:
                rows.append(scores)
                proposals[i] = sample_by_digits(scores, step.digits, sampling.temperature, generator)
            elif sampling.greedy:
                proposals[i] = step.scores_to_logits(scores).argmax(-1)
            else:
                rows.append(logits_to_probs(step.scores_to_logits(scores), sampling))
                proposals[i] = sample(rows[-1], generator)
        if not rows or sampling.greedy:  # argmax proposals: the greedy rule reads no draft rows
            return proposals, None
        rows = torch.stack(rows)
        if not by_digits:
            return proposals, rows
        if rows.device.type == "cpu":  # the rules read the scores as they are (acceptance_cpu.DigitRows)
            return proposals, DigitRows(rows, step.digits, sampling.temperature)
        return proposals, logits_to_probs(step.scores_to_logits(rows), sampling)


def _draw_like_a_proposal(logits: torch.Tensor, sampling, generator: torch.Generator) -> None:
    """A proposal's draw from dense logits [V_r] (the calibration's stand-in for `propose`'s)."""
    if sampling.greedy:
        logits.argmax(-1)
    else:
        sample(logits_to_probs(logits, sampling), generator)


def _state_model(target, what: str):
    """The target's torch `Llama` (its hidden states, embedding and head), or a clear error."""
    model = getattr(target, "model", None)
    if not hasattr(target, "forward_hidden") or model is None or not hasattr(model, "head"):
        raise ValueError(f"{what} need the torch backend (the target's hidden states); "
                         f"this target is a {type(target).__name__}")
    return model


def _verify(policy: str, tokens, probs, target_logits, target_probs, config, generator,
            groups, compiled=None) -> tuple[int, list[int]]:
    """One row of proposals [l] against the target's l + 1 rows -> (n accepted, the n + 1 tokens), on the host."""
    sampling = config.sampling
    if policy in ("mtp-topm", "mtp-viterbi"):
        return outcome(verify_top_m(tokens[None], target_logits[None], target_probs[None], config.mtp_top_m, generator))
    if policy == "mtp-threshold":
        return outcome(verify_threshold(tokens[None], target_probs[None], config.mtp_threshold, generator))
    if policy == "mtp-strict" and not sampling.greedy:
        return outcome(verify_top_m(tokens[None], target_logits[None], target_probs[None], 1, generator))
    rule = "greedy" if sampling.greedy or policy == "mtp-strict" else policy_rule(policy)
    if probs is None:  # argmax proposals carry no distributions: the greedy rule reads the target's rows alone
        probs = target_probs[:-1] if isinstance(target_probs, torch.Tensor) else None
    return verify_one(rule, tokens, probs, target_probs,
                      draw_uniforms(1, len(tokens), generator, tokens.device)[0], generator,
                      groups=groups, thinning_trials=config.pcg_thinning_trials, compiled=compiled)


def planned_costs(target, proposer: HeadProposer | EagleProposer, config, groups, sync) -> StepCosts:
    """The step costs an adaptive draft length plans with (`speculative.prepare`); the inexact rules'
    cost is close to SD's (one comparison per position)."""
    rule = "greedy" if config.sampling.greedy else ("pcg" if config.policy in PCG_POLICIES else "sd")
    max_length = min(config.draft_length, proposer.max_proposals)
    return calibrated_costs(target, proposer, max_length, rule, config.sampling, groups, sync)


def decode_multi_token(target, proposer: HeadProposer | EagleProposer, prompt_ids: torch.Tensor, config, generator: torch.Generator,
                       groups, stats, timer, costs: StepCosts | None = None,
                       acceptance: Sequence[float] | None = None) -> Iterator[list[int]]:
    """Yield bursts of speech codes, as `speculative.decode`; `timer` is its `_Timer`."""
    policy, sampling, vocab = config.policy, config.sampling, target.vocab
    if policy in PCG_POLICIES and groups is None and not sampling.greedy:
        raise ValueError(f"policy {policy!r} needs a group table")
    if policy == "mtp-viterbi" and proposer.transitions is None:
        raise ValueError("policy 'mtp-viterbi' needs a transition table (`pcgtts train transitions`)")
    max_length = min(config.draft_length, proposer.max_proposals)
    stats.per_position_accepted = [0] * max_length
    stats.length_counts = [0] * (max_length + 1)
    length_policy = None
    if config.adaptive_draft:
        learn = costs is None  # calibrated costs are refined by the loop's own timings; given ones are kept
        costs = costs or planned_costs(target, proposer, config, groups, timer.sync)
        counter = starting_counter(max_length, acceptance, proposer.acceptance)
        length_policy = DraftLengthPolicy(costs, max_length, counter=counter, learn=learn)
        stats.costs = costs.as_dict()
    digits = digits_to_draw(target, sampling)
    rows_digits = rule_digits(target, sampling) if policy in EXACT_STATE_POLICIES else 0
    compiled = compiled_rule.for_loop(target, policy_rule(policy), sampling, groups, config.pcg_thinning_trials)
    _start(target, prompt_ids)
    proposer.start(target.length)
    last = prompt_ids[-1:].to(target.device)
    proposals, proposal_probs = None, None
    while True:
        if stats.emitted >= config.max_new_tokens:
            stats.finish = "max_tokens"
            return
        l = 0 if proposals is None else len(proposals)
        if not _room(target, l + 1):
            stats.finish = "cache_full"
            return
        start = target.length

        # 1. Verify the proposals in one target pass (none: a plain step).
        if l == 0:
            token, hidden, t0 = _plain_step(target, last, sampling, digits, generator, timer, "time_target",
                                            with_hidden=True)
            n, tokens = 0, [int(token)]
        else:
            t0 = time.perf_counter()
            ids = torch.cat([last, vocab.restricted_to_token_ids(proposals)])
            if rows_digits:  # the exact rules read the target's digit scores: no [l + 1, V] rows at all
                scores, hidden = target.forward_scores(ids)
                t0 = timer("time_target", t0)
                target_logits, target_probs = None, DigitRows(scores, rows_digits, sampling.temperature)
            else:
                target_logits, hidden = target.forward_hidden(ids)  # [l + 1, V], [l + 1, D]
                t0 = timer("time_target", t0)
                target_probs = logits_to_probs(target_logits, sampling)
            n, tokens = _verify(policy, proposals, proposal_probs, target_logits, target_probs, config, generator,
                                groups, compiled)  # the step's one host sync
        target.rollback(start + 1 + n)
        t0 = timer("time_verify", t0)

        # 2. The proposer reads the accepted rows' states and proposes what follows the new token.
        count = max_length
        if length_policy is not None:
            length_policy.record(l, n, timer.take())  # this verify, and the proposals it checked
            stats.learned_costs = length_policy.costs
            count = length_policy.choose()
        proposals, proposal_probs = proposer.propose(policy, hidden[:n + 1], tokens, start, count, config, generator)
        stats.trace.append((timer("time_draft", t0), n + 1))
        stats.steps += 1
        stats.target_forwards += 1
        stats.drafted += l
        stats.accepted += n
        stats.length_counts[l] += 1
        for i in range(n):
            stats.per_position_accepted[i] += 1
        last = vocab.token_ids(tokens[-1:], target.device)

        tokens = emitted(tokens, vocab.stop_index, config.max_new_tokens, stats)
        if tokens:
            yield tokens
        if stats.finish:
            return


__all__ = ["MTP_POLICIES", "STATE_POLICIES", "EXACT_STATE_POLICIES", "EagleProposer", "HeadProposer", "decode_multi_token"]
