"""Self-speculative decoding with multi-token heads on the target (no separate draft model).

One target pass per step does two jobs (Speech-LLaMA's "verify this step, predict the next"):

  1. the target is fed [last, x_1 .. x_l]: l proposals made by the heads in the previous step;
     its L + 1 distributions verify them with the policy's rule -> n accepted + one new token;
  2. the hidden state that predicted the new token (row n) goes through the heads, whose k
     outputs propose the l tokens after it; the cache is rolled back to [.., last, x_1 .. x_n].

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

strict, top-M, threshold and Viterbi are not exact in distribution: they trade fidelity to the
target's sampling distribution for longer accepted runs (the quality harness measures the cost).
At temperature 0, mtp-sd / mtp-pcg / mtp-strict verify greedily and equal plain greedy decoding.
No I/O, logging or tokenization here; restricted-vocabulary indices in and out, as speculative.py.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from pcgtts.runtime.config import MTP_POLICIES
from pcgtts.runtime.decode.calibrate import calibrated_costs
from pcgtts.runtime.decode.cost_model import DraftLengthPolicy, StepCosts
from pcgtts.runtime.decode.acceptance import draw_uniforms, verify, verify_threshold, verify_top_m
from pcgtts.runtime.decode.sampling import logits_to_probs, sample
from pcgtts.runtime.decode.speculative import _room, _start, emitted

EXACT_MTP_POLICIES = ("mtp-sd", "mtp-pcg")


class HeadProposer:
    """The target's multi-token heads bound to its shared speech head (torch backend)."""

    def __init__(self, heads, target, transitions=None):
        model = getattr(target, "model", None)
        if not hasattr(target, "forward_hidden") or model is None or not hasattr(model, "head"):
            raise ValueError("multi-token heads need the torch backend (the target's hidden states); "
                             f"this target is a {type(target).__name__}")
        if heads.hidden_size != model.head.in_features:
            raise ValueError(f"heads of hidden size {heads.hidden_size} do not fit this target "
                             f"(hidden size {model.head.in_features})")
        self.heads, self.model, self.transitions = heads, model, transitions

    @property
    def num_heads(self) -> int:
        return self.heads.num_heads

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, count: int) -> torch.Tensor:
        """hidden [D] -> [count, V_r] logits of the tokens 2 .. count + 1 positions ahead."""
        return self.heads.logits(hidden, self.model.logits, count)


def _propose(policy: str, head_logits: torch.Tensor, config, generator: torch.Generator, proposer: HeadProposer,
             prev_index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """head_logits [l, V] -> (proposals [l] int64, their distributions [l, V] or None)."""
    sampling = config.sampling
    if policy in EXACT_MTP_POLICIES and not sampling.greedy:
        probs = logits_to_probs(head_logits, sampling)
        return sample(probs, generator), probs
    if policy == "mtp-viterbi":
        from pcgtts.runtime.decode.viterbi import viterbi_propose

        tokens = viterbi_propose(torch.log_softmax(head_logits.float(), -1), proposer.transitions, prev_index,
                                 config.viterbi_top_k)
        return tokens.to(head_logits.device), None
    return head_logits.argmax(-1), None


def _verify(policy: str, tokens, probs, target_logits, target_probs, config, generator, groups):
    """One row of proposals against the target's l + 1 rows -> Verdict (batch of 1)."""
    sampling = config.sampling
    if policy in ("mtp-topm", "mtp-viterbi"):
        return verify_top_m(tokens[None], target_logits[None], target_probs[None], config.mtp_top_m, generator)
    if policy == "mtp-threshold":
        return verify_threshold(tokens[None], target_probs[None], config.mtp_threshold, generator)
    if policy == "mtp-strict" and not sampling.greedy:
        return verify_top_m(tokens[None], target_logits[None], target_probs[None], 1, generator)
    rule = "greedy" if sampling.greedy or policy == "mtp-strict" else policy.removeprefix("mtp-")
    return verify(rule, tokens[None], probs[None] if probs is not None else target_probs[None, :-1],
                  target_probs[None], draw_uniforms(1, len(tokens), generator, target_probs.device), generator,
                  groups=groups, thinning_trials=config.pcg_thinning_trials)


def decode_multi_token(target, proposer: HeadProposer, prompt_ids: torch.Tensor, config, generator: torch.Generator,
                       groups, stats, timer, costs: StepCosts | None = None) -> Iterator[list[int]]:
    """Yield bursts of speech codes, as `speculative.decode`; `timer` is its `_Timer`."""
    policy, sampling, vocab = config.policy, config.sampling, target.vocab
    if policy == "mtp-pcg" and groups is None and not sampling.greedy:
        raise ValueError("policy 'mtp-pcg' needs a group table")
    if policy == "mtp-viterbi" and proposer.transitions is None:
        raise ValueError("policy 'mtp-viterbi' needs a transition table (`pcgtts heads transitions`)")
    max_length = min(config.draft_length, proposer.num_heads)
    stats.per_position_accepted = [0] * max_length
    stats.length_counts = [0] * (max_length + 1)
    length_policy = None
    if config.adaptive_draft:
        if costs is None:  # the inexact rules' cost is close to SD's (one comparison per position)
            rule = "greedy" if sampling.greedy else ("pcg" if policy == "mtp-pcg" else "sd")
            costs = calibrated_costs(target, proposer, max_length, rule, sampling, groups, timer.sync)
        length_policy = DraftLengthPolicy(costs, max_length)
        stats.costs = costs.as_dict()
    _start(target, prompt_ids)
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

        # 1. Verify the proposals (none on the first step) in one target pass.
        t0 = time.perf_counter()
        ids = last if l == 0 else torch.cat([last, vocab.restricted_to_token_ids(proposals)])
        target_logits, hidden = target.forward_hidden(ids)  # [l + 1, V], [l + 1, D]
        t0 = timer("time_target", t0)
        target_probs = logits_to_probs(target_logits, sampling)
        if l == 0:
            n, tokens = 0, [int(sample(target_probs[0], generator))]
        else:
            verdict = _verify(policy, proposals, proposal_probs, target_logits, target_probs, config, generator, groups)
            n, *row = torch.cat([verdict.num_accepted, verdict.tokens[0]]).tolist()  # the step's one host sync
            tokens = row[: n + 1]
        target.rollback(start + 1 + n)
        t0 = timer("time_verify", t0)

        # 2. The heads read the state that predicted the new token and propose what follows it.
        count = max_length
        if length_policy is not None:
            length_policy.record(l, n)
            count = length_policy.choose()
        proposals, proposal_probs = None, None
        if count:
            proposals, proposal_probs = _propose(policy, proposer.logits(hidden[n], count), config, generator,
                                                 proposer, tokens[-1])
        stats.trace.append((timer("time_draft", t0), n + 1))
        stats.steps += 1
        stats.target_forwards += 1
        stats.drafted += l
        stats.accepted += n
        stats.length_counts[l] += 1
        for i in range(n):
            stats.per_position_accepted[i] += 1
        last = vocab.restricted_to_token_ids(torch.tensor(tokens[-1:], device=target.device))

        tokens = emitted(tokens, vocab.stop_index, config.max_new_tokens, stats)
        if tokens:
            yield tokens
        if stats.finish:
            return


__all__ = ["MTP_POLICIES", "EXACT_MTP_POLICIES", "HeadProposer", "decode_multi_token"]
