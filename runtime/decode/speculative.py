"""The decode loop: plain autoregressive, draft-only, and speculative decoding with a pluggable rule.

Cache bookkeeping (same for both models): the cache holds every token *before* the last
emitted one, `last`. A speculative step

  1. drafts L tokens: the draft is fed `last` (plus the final draft token of the previous step
     when that step accepted everything — the draft "catches up"), then each proposal in turn;
  2. verifies: the target is fed [last, x_1 .. x_L] in one pass, giving L + 1 distributions;
  3. applies the acceptance rule -> n accepted tokens + one recovered or bonus token;
  4. rolls both caches back to `start + 1 + n` (O(1) with the static cache).

One host sync per step: reading the verdict. No I/O, logging or tokenization happens here;
token ids in and restricted-vocabulary indices (speech codes) out, in bursts as accepted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from pcgtts.groups.device import DeviceGroupTable
from pcgtts.runtime.decode.acceptance import draw_uniforms, verify
from pcgtts.runtime.config import DecodeConfig
from pcgtts.runtime.lm.protocol import LM
from pcgtts.runtime.decode.sampling import logits_to_probs, sample


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
    time_verify: float = 0.0
    trace: list[tuple[float, int]] = field(default_factory=list)  # per step: (perf_counter, tokens made)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "trace"}
        out["acceptance_rate"] = self.acceptance_rate
        out["mean_accepted_length"] = self.mean_accepted_length
        return out


class _Timer:
    """Accumulates wall time into a stats field; `sync` makes device work count (CUDA)."""

    def __init__(self, stats: DecodeStats, sync: Callable[[], None] | None):
        self.stats, self.sync = stats, sync

    def __call__(self, name: str, start: float) -> float:
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        setattr(self.stats, name, getattr(self.stats, name) + now - start)
        return now


def decode(target: LM, draft: LM | None, prompt_ids: torch.Tensor, config: DecodeConfig,
           generator: torch.Generator, groups: DeviceGroupTable | None = None,
           stats: DecodeStats | None = None, sync: Callable[[], None] | None = None) -> Iterator[list[int]]:
    """Yield bursts of speech codes for `prompt_ids` [T] until the stop token or a limit.

    `generator` lives on the target's device; `sync` (e.g. torch.cuda.synchronize) makes the
    per-phase timings in `stats` exact on asynchronous devices at the cost of extra syncs.
    """
    stats = stats if stats is not None else DecodeStats()
    if config.policy == "ar":
        return _autoregressive(target, prompt_ids, config, generator, stats, sync, "target")
    if draft is None:
        raise ValueError(f"policy {config.policy!r} needs a draft model")
    if config.policy == "draft":
        return _autoregressive(draft, prompt_ids, config, generator, stats, sync, "draft")
    if config.policy == "pcg" and groups is None and not config.sampling.greedy:
        raise ValueError("policy 'pcg' needs a group table")
    return _speculative(target, draft, prompt_ids, config, generator, groups, stats, sync)


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
    while True:
        if stats.emitted >= config.max_new_tokens:
            stats.finish = "max_tokens"
            return
        if not _room(lm, 1):
            stats.finish = "cache_full"
            return
        t0 = time.perf_counter()
        logits = lm.forward(last)[-1]
        t0 = timer(field_name, t0)
        token = sample(logits_to_probs(logits, config.sampling), generator)
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
        last = vocab.restricted_to_token_ids(token.view(1))


def _speculative(target: LM, draft: LM, prompt_ids, config, generator, groups, stats, sync) -> Iterator[list[int]]:
    timer = _Timer(stats, sync)
    vocab, L, sampling = target.vocab, config.draft_length, config.sampling
    rule = "greedy" if sampling.greedy else config.policy
    stats.per_position_accepted = [0] * L
    device = target.device
    for lm in (target, draft):
        _start(lm, prompt_ids)
    feed_draft = prompt_ids[-1:].to(device)  # tokens the draft has not seen yet
    last = feed_draft
    while True:
        if stats.emitted >= config.max_new_tokens:
            stats.finish = "max_tokens"
            return
        if not (_room(target, L + 1) and _room(draft, L + 1)):
            stats.finish = "cache_full"
            return
        start = target.length  # == draft.length after the catch-up below

        # 1. Draft L proposals.
        t0 = time.perf_counter()
        draft_tokens = torch.empty(L, dtype=torch.long, device=device)
        draft_probs = []
        logits = draft.forward(feed_draft)[-1]
        for i in range(L):
            probs = logits_to_probs(logits, sampling)
            draft_tokens[i] = sample(probs, generator)
            draft_probs.append(probs)
            if i < L - 1:
                logits = draft.forward(vocab.restricted_to_token_ids(draft_tokens[i:i + 1]))[-1]
        stats.draft_forwards += L
        t0 = timer("time_draft", t0)

        # 2. Verify all proposals in one target pass.
        draft_ids = vocab.restricted_to_token_ids(draft_tokens)
        target_logits = target.forward(torch.cat([last, draft_ids]))  # [L + 1, V_r]
        stats.target_forwards += 1
        t0 = timer("time_target", t0)

        # 3. Accept / reject.
        target_probs = logits_to_probs(target_logits, sampling)
        verdict = verify(rule, draft_tokens[None], torch.stack(draft_probs)[None], target_probs[None],
                         draw_uniforms(1, L, generator, device), generator, groups=groups,
                         ssd_beta=config.ssd_beta, thinning_trials=config.pcg_thinning_trials)
        n = int(verdict.num_accepted[0])  # the step's one host sync (with the tokens below)
        tokens = verdict.tokens[0, : n + 1].tolist()
        stats.trace.append((timer("time_verify", t0), n + 1))
        stats.steps += 1
        stats.drafted += L
        stats.accepted += n
        for i in range(n):
            stats.per_position_accepted[i] += 1

        # 4. Roll both caches back to [.., last, x_1 .. x_n]; the draft catches up if n == L.
        target.rollback(start + 1 + n)
        draft.rollback(min(draft.length, start + 1 + n))
        new = verdict.tokens[0, n:n + 1]
        feed_draft = vocab.restricted_to_token_ids(
            torch.cat([draft_tokens[L - 1:], new]) if n == L else new)
        last = vocab.restricted_to_token_ids(new)

        if vocab.stop_index in tokens:
            tokens = tokens[: tokens.index(vocab.stop_index)]
            stats.finish = "stop"
        room = config.max_new_tokens - stats.emitted
        if len(tokens) > room:
            tokens = tokens[:room]
        stats.emitted += len(tokens)
        if tokens:
            yield tokens
        if stats.finish:
            return
