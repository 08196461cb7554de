"""The pieces of a decode step that every loop shares: counters, timing, a plain step, a verify pass.

No I/O, logging or tokenization here: token ids in, restricted-vocabulary indices (speech codes) out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from pcgtts.runtime.decode.cost_model import StepCosts
from pcgtts.runtime.decode.rows import DenseRows, DigitRows, Rows
from pcgtts.runtime.decode.sampling import forbid_stop, logits_to_probs, sample, sample_by_digits
from pcgtts.runtime.lm.protocol import LM


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


class Timer:
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


def start_sequence(lm: LM, prompt_ids: torch.Tensor) -> None:
    """Cache every prompt token but the last, which the first step feeds."""
    if len(prompt_ids) > 1:
        lm.prefill(prompt_ids[:-1])
    else:
        lm.rollback(0)


def has_room(lm: LM, needed: int) -> bool:
    return lm.length + needed <= lm.max_length


def plain_step(lm: LM, ids: torch.Tensor, sampling, digits: int, generator: torch.Generator, timer: Timer,
               field_name: str, with_hidden: bool = False, first: int = 0,
               min_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """Forward `ids` and draw the next token, speech token number `first` (no stop before
    `min_tokens`: `sampling.forbid_stop`) -> (token [], the final-normed states [T, D] when
    `with_hidden` or drawing by digit (else None), the time after the forward was timed)."""
    t0 = time.perf_counter()
    if digits:  # no 65,537-wide row at all
        scores, hidden = lm.forward_scores(ids)
        t0 = timer(field_name, t0)
        return draw_next(scores[-1:], sampling, digits, generator, first, min_tokens), hidden, t0
    logits, hidden = lm.forward_hidden(ids) if with_hidden else (lm.forward(ids), None)
    t0 = timer(field_name, t0)
    return draw_next(logits[-1:], sampling, 0, generator, first, min_tokens), hidden, t0


def draw_next(row: torch.Tensor, sampling, digits: int, generator: torch.Generator, first: int = 0,
              min_tokens: int = 0) -> torch.Tensor:
    """A plain step's draw from its last row [1, W] (a digit head's scores when `digits` > 0, else the
    logits): speech token number `first`, no stop before `min_tokens` (`sampling.forbid_stop`) -> token []."""
    row = forbid_stop(row, first, min_tokens)[0]
    if digits:
        return sample_by_digits(row, digits, sampling.temperature, generator)
    return sample(logits_to_probs(row, sampling), generator)


def verify_pass(lm: LM, ids: torch.Tensor, sampling, digits: int, timer: Timer, with_hidden: bool,
                keep_logits: bool, first: int = 0, min_tokens: int = 0) -> tuple[Rows, torch.Tensor | None, float]:
    """The target's pass over [last, x_1 .. x_L] -> (its L + 1 distributions as the rules read them:
    digit scores (`digits` > 0) or probabilities, the final-normed states [L + 1, D] when
    `with_hidden` (else None), the time after the forward was timed as "time_target"). Row i decides
    speech token number `first + i`: no stop before `min_tokens` (`sampling.forbid_stop`), so every
    rule reads the same constrained distributions a plain step draws from."""
    t0 = time.perf_counter()
    if digits:  # the exact rules read the target's digit scores: no [L + 1, V] rows at all
        scores, hidden = lm.forward_scores(ids)
        scores = forbid_stop(scores, first, min_tokens)
        return DigitRows(scores, digits, sampling.temperature), hidden, timer("time_target", t0)
    logits, hidden = lm.forward_hidden(ids) if with_hidden else (lm.forward(ids), None)  # [L + 1, V], [L + 1, D]
    t0 = timer("time_target", t0)
    logits = forbid_stop(logits, first, min_tokens)
    return DenseRows(logits_to_probs(logits, sampling), logits if keep_logits else None), hidden, t0


def emitted(tokens: list[int], stop_index: int, max_new_tokens: int, stats: DecodeStats) -> list[int]:
    """A step's tokens as they are handed out: cut at the stop token (finish "stop") and at the
    token budget; counted in `stats.emitted`."""
    if stop_index in tokens:
        tokens = tokens[: tokens.index(stop_index)]
        stats.finish = "stop"
    tokens = tokens[: max_new_tokens - stats.emitted]
    stats.emitted += len(tokens)
    return tokens
