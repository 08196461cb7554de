"""The SD, SSD and PCG rules for one sequence on a CPU: the rules of acceptance.py, indexed with NumPy.

At batch 1 a verify step reads a few hundred entries of its distributions; as tensor ops that is
~300 calls at 1.5-5 µs of fixed cost each (more right after a forward has evicted the caches),
while a NumPy index over a handful of entries costs ~0.3 µs. This lane reads the distributions
through two views with one interface (probabilities at given tokens, independent draws from a
row, the dense row itself):

  DenseRows  probability rows [R, V] (any head). Draws use the row's float64 CDF, as the tensor
             rules do: for one generator state this lane returns the tensor rules' tokens, draw
             for draw (tests/test_acceptance.py), so their statistical tests cover it.
  DigitRows  a digit head's scores [R, 34] (runtime/lm/digit_head.py): each row is a product of
             per-digit softmaxes, so probabilities and exact draws cost O(8) per token and no
             65,537-wide row is built (a step's draft and target rows are factored in one pass). The recovered token is drawn by thinning (draw y from the
             target, keep it with probability (1 - p(y)/q(y))+ for SD: exactly the normalised
             residual; PCG as acceptance._recover), with the dense residual as the rare last resort.

`verify_one` is what the decode loops call: this lane on a CPU, the tensor rules elsewhere (and
for the greedy rule over dense rows; over digit rows it compares each row's argmax, taken digit by
digit), with the outcome on the host either way; a compiled CPU target's PCG and SD
steps over digit rows go to the compiled rule it is handed (runtime/decode/compiled_rule.py), which
computes this lane's arithmetic in one call and leaves it only an unfinished recovery.
"""

from __future__ import annotations

import numpy as np
import torch

from pcgtts.groups.device import DeviceGroupTable, HostSpans
from pcgtts.runtime.config import SamplingConfig
from pcgtts.runtime.decode import acceptance
from pcgtts.runtime.decode.acceptance import outcome, verify
from pcgtts.runtime.decode.sampling import cdf_of, draw, logits_to_probs, sample_from_weights
from pcgtts.runtime.lm.digit_head import (LEVELS, argmax_digit_codes, digit_halves, expand_digit_scores,
                                          host_digit_log_probs, host_draw_digit_codes)

_TINY = np.finfo(np.float32).tiny
_LANE_RULES = ("sd", "ssd", "pcg")


class DenseRows:
    """Distributions as probability rows: probs [R, V] float32."""

    def __init__(self, probs: torch.Tensor):
        self.probs, self.size = probs, probs.shape[-1]
        self.values = probs.numpy() if probs.device.type == "cpu" else None
        self._cdfs: dict[int, torch.Tensor] = {}

    def at(self, rows: np.ndarray | int, tokens: np.ndarray) -> np.ndarray:
        """Probabilities of `tokens` under `rows` (broadcast together)."""
        return self.values[rows, tokens]

    def draw(self, row: int, count: int, generator: torch.Generator) -> np.ndarray:
        """`count` independent draws from row `row` (its float64 CDF, made once)."""
        if row not in self._cdfs:
            self._cdfs[row] = cdf_of(self.probs[row][None])
        return draw(self._cdfs[row], torch.rand(1, count, generator=generator))[0].numpy()

    def row(self, row: int) -> torch.Tensor:
        return self.probs[row]

    def dense(self) -> torch.Tensor:
        return self.probs


class DigitRows:
    """Distributions given by digit-head scores [R, 1 + digits * 4 + 1] at `temperature` (plain
    sampling: no top-p), in factored form (`digit_head.host_digit_log_probs`), computed on first
    use (`factor` does several row sets in one pass: a verify step's draft and target rows). A
    code's log-probability is one entry of a table over its high digits plus one over its low
    digits (4**4 entries each for 8 digits), so `at` costs two lookups per token; the stop token
    is the high table's extra entry (less the low table's entry 0, which its low digits select)."""

    def __init__(self, scores: torch.Tensor, digits: int, temperature: float):
        self.scores, self.digits, self.temperature = scores, digits, temperature
        self.values = scores.numpy()
        self.size = LEVELS ** digits + 1
        self.low_bits = 2 * (digits // 2)  # log2 of the low table's size (4 levels: 2 bits per digit)
        self.mask = (1 << self.low_bits) - 1
        # (per-digit log-softmaxes [R, n, 4], log P(stop) [R], high table [R, 4**(n - n/2) + 1],
        # low table [R, 4**(n/2)]), float64
        self._factors: tuple[np.ndarray, ...] | None = None

    @staticmethod
    def factor(*row_sets: "DigitRows") -> None:
        """Factor every unfactored row set, in one pass when they share digits and temperature, so
        the dozen NumPy calls are paid once a step rather than once per row set."""
        todo = [rows for rows in row_sets if rows._factors is None]
        if len({(rows.digits, rows.temperature) for rows in todo}) > 1:
            for rows in todo:
                DigitRows.factor(rows)
            return
        if not todo:
            return
        first = todo[0]
        values = np.concatenate([rows.values for rows in todo]) if len(todo) > 1 else first.values
        per_digit, speech, stop = host_digit_log_probs(values, first.digits, first.temperature)  # float64
        high, low = digit_halves(per_digit, speech)  # [R, 4**(n - n/2)], [R, 4**(n/2)]
        high = np.concatenate([high, (stop - low[:, 0])[:, None]], axis=1)  # stop: high index 4**(n - n/2)
        start = 0
        for rows in todo:
            end = start + len(rows.values)
            rows._factors = (per_digit[start:end], stop[start:end], high[start:end], low[start:end])
            start = end

    @property
    def factors(self) -> tuple[np.ndarray, ...]:
        if self._factors is None:
            DigitRows.factor(self)
        return self._factors

    def argmax(self) -> np.ndarray:
        """Each row's most likely token [R], digit by digit (`digit_head.argmax_digit_codes`): all the
        greedy rule reads of a row, at any temperature and with nothing factored."""
        return argmax_digit_codes(self.values, self.digits)

    def at(self, rows: np.ndarray | int, tokens: np.ndarray) -> np.ndarray:
        """Probabilities of `tokens` under `rows` (broadcast together)."""
        _, _, high, low = self.factors
        return np.exp(high[rows, tokens >> self.low_bits] + low[rows, tokens & self.mask])

    def draw(self, row: int, count: int, generator: torch.Generator) -> np.ndarray:
        uniforms = torch.rand(count, self.digits + 1, generator=generator).numpy()
        per_digit, stop, _, _ = self.factors
        return host_draw_digit_codes(per_digit[row], stop[row], uniforms)

    def row(self, row: int) -> torch.Tensor:
        return self.dense_rows(self.scores[row])

    def dense(self) -> torch.Tensor:
        return self.dense_rows(self.scores)

    def dense_rows(self, scores: torch.Tensor) -> torch.Tensor:
        return logits_to_probs(expand_digit_scores(scores, self.digits), SamplingConfig(temperature=self.temperature))


Rows = DenseRows | DigitRows


def rows_of(probs: torch.Tensor | Rows) -> Rows:
    return probs if isinstance(probs, (DenseRows, DigitRows)) else DenseRows(probs)


def verify_one(rule: str, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | Rows,
               target_probs: torch.Tensor | Rows, uniforms: torch.Tensor, generator: torch.Generator, *,
               groups: DeviceGroupTable | None = None, ssd_beta: float = 0.0,
               thinning_trials: int = 16, compiled=None) -> tuple[int, list[int]]:
    """One sequence's verdict on the host: (n accepted, the n + 1 tokens to emit).

    draft_tokens [L], uniforms [L]; draft_probs [L, V] and target_probs [L + 1, V] as probability
    rows or `DenseRows` / `DigitRows`: `verify`'s arguments without the batch dimension (the greedy
    rule reads only the target's rows; digit rows give it their argmax digit by digit, with no
    65,537-wide row). With dense rows, the same outcome as `verify` for the same generator state.
    `compiled`: a `compiled_rule.CompiledRule`, which judges the PCG (or SD) steps it suits in one
    compiled call."""
    if rule == "greedy" and isinstance(target_probs, DigitRows):
        return _greedy(draft_tokens.numpy(), target_probs.argmax())
    draft, target = rows_of(draft_probs), rows_of(target_probs)
    if compiled is not None and compiled.suits(rule, groups, draft, target):
        return compiled(draft_tokens, draft, target, uniforms, generator)
    if isinstance(draft, DigitRows) and isinstance(target, DigitRows):
        DigitRows.factor(draft, target)
    if draft_tokens.device.type != "cpu" or rule not in _LANE_RULES:
        return outcome(verify(rule, draft_tokens[None], draft.dense()[None], target.dense()[None], uniforms[None],
                              generator, groups=groups, ssd_beta=ssd_beta, thinning_trials=thinning_trials))
    tokens, uniforms = draft_tokens.numpy(), uniforms.numpy()
    if rule == "pcg":
        if groups is None:
            raise ValueError("the pcg rule needs a group table")
        view = acceptance._coarse_view(groups, target.size)  # checks the table covers the vocabulary
        return _pcg(tokens, draft, target, uniforms, generator, view, thinning_trials)
    beta = ssd_beta if rule == "ssd" else 0.0
    if isinstance(draft, DenseRows) and isinstance(target, DenseRows):
        return _sd_dense(tokens, draft.probs, target.probs, uniforms, generator, beta)
    return _sd(tokens, draft, target, uniforms, generator, beta, thinning_trials)


def _greedy(tokens: np.ndarray, best: np.ndarray) -> tuple[int, list[int]]:
    """acceptance.verify_greedy at batch 1 from the target's argmaxes best [L + 1]: accept while a
    proposal is the argmax, then emit the argmax."""
    n = _prefix(tokens == best[:-1])
    return n, [*tokens[:n].tolist(), int(best[n])]


def _prefix(accept: np.ndarray) -> int:
    """Length of the all-True prefix of a [L] bool array."""
    return int(accept.argmin()) if not accept.all() else len(accept)


def _accepted(on_target: np.ndarray, on_draft: np.ndarray, uniforms: np.ndarray, beta: float = 0.0) -> int:
    """How many proposals the ratio test keeps: u < min(1, target / draft) + beta, in order."""
    ratio = on_target / np.maximum(on_draft, _TINY)
    return _prefix(uniforms < np.minimum(ratio, np.float32(1.0)) + np.float32(beta))


def _sd_dense(tokens: np.ndarray, draft_probs: torch.Tensor, target_probs: torch.Tensor, uniforms: np.ndarray,
              generator: torch.Generator, beta: float) -> tuple[int, list[int]]:
    """acceptance.verify_sd at batch 1: the residual as a dense row, one inverse-CDF draw."""
    positions = np.arange(len(tokens))
    n = _accepted(target_probs.numpy()[positions, tokens], draft_probs.numpy()[positions, tokens], uniforms, beta)
    weights = target_probs[n] if n == len(tokens) else acceptance.sd_residual(target_probs[n], draft_probs[n])
    token = sample_from_weights(weights, torch.rand(1, generator=generator))
    return n, [*tokens[:n].tolist(), int(token)]


def _sd(tokens: np.ndarray, draft: Rows, target: Rows, uniforms: np.ndarray, generator: torch.Generator,
        beta: float, trials: int) -> tuple[int, list[int]]:
    """SD over factored rows: the recovered token by thinning. A draw y ~ target kept with
    probability (1 - draft(y) / target(y))+ follows norm(max(0, target - draft)) exactly."""
    positions = np.arange(len(tokens))
    n = _accepted(target.at(positions, tokens), draft.at(positions, tokens), uniforms, beta)
    if n == len(tokens):
        return n, [*tokens.tolist(), int(target.draw(n, 1, generator)[0])]
    for round_ in range(acceptance.THINNING_ROUNDS + 1):
        y = target.draw(n, trials << round_, generator)
        keep = np.maximum(1.0 - draft.at(n, y) / np.maximum(target.at(n, y), _TINY), 0.0)
        kept = torch.rand(len(y), generator=generator).numpy() < keep
        if kept.any():
            return n, [*tokens[:n].tolist(), int(y[kept.argmax()])]
    residual = acceptance.sd_residual(target.row(n), draft.row(n))
    return n, [*tokens[:n].tolist(), int(sample_from_weights(residual, torch.rand(1, generator=generator)))]


def _pick(h: HostSpans, tokens: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """acceptance._pick_group: K uniform over S(t) per token, the stop in its own group."""
    span = h.token[tokens]
    return h.token_groups[span[..., 0] + (uniforms * span[..., 1]).astype(np.int64)] + h.token_shift[tokens]


def _members(h: HostSpans, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """acceptance._members and the equal-split weights: groups [K] -> (tokens [K, W], 1/N(t) on members
    and 0 on padding [K, W]), W the largest of these groups."""
    span = h.group[groups]
    last = span[:, 1:] - 1
    slot = np.arange(int(last.max()) + 1)
    members = h.group_members[span[:, :1] + np.minimum(slot, last)] + h.member_shift[groups][:, None]
    return members, h.inv_n[members] * (slot <= last)


def _uniforms64(count: int, generator: torch.Generator) -> np.ndarray:
    return acceptance._uniforms64(1, count, generator, "cpu")[0].numpy()


def _pcg(tokens: np.ndarray, draft: Rows, target: Rows, uniforms: np.ndarray, generator: torch.Generator,
         view: acceptance._CoarseView, trials: int) -> tuple[int, list[int]]:
    """acceptance.verify_pcg at batch 1; `view` is the table's acceptance._coarse_view."""
    length, h = len(tokens), view.table.host
    proposed = _pick(h, tokens, _uniforms64(length, generator))
    members, weights = _members(h, proposed)
    rows = np.arange(length)[:, None]
    p_c = (draft.at(rows, members) * weights).sum(-1)
    q_c = (target.at(rows, members) * weights).sum(-1)
    n = _accepted(q_c, p_c, uniforms)
    draws = target.draw(n, 1 + trials, generator)  # the bonus token, then the thinning candidates
    if n == length:
        return n, [*tokens.tolist(), int(draws[0])]
    return n, [*tokens[:n].tolist(), _recover(view, draft, target, n, trials, generator, draws[1:])]


def _recover(view: acceptance._CoarseView, draft: Rows, target: Rows, n: int, trials: int,
             generator: torch.Generator, y: np.ndarray | None = None, first_round: int = 0) -> int:
    """acceptance._recover for row `n`: thinning in growing rounds (from `first_round`; y: round 0's
    `trials` candidates, if drawn), then the exact residual."""
    h = view.table.host
    for round_ in range(first_round, acceptance.THINNING_ROUNDS + 1):
        if round_ or y is None:
            y = target.draw(n, trials << round_, generator)
        candidates = _pick(h, y, _uniforms64(len(y), generator))
        members, weights = _members(h, candidates)
        p_c, q_c = (draft.at(n, members) * weights).sum(-1), (target.at(n, members) * weights).sum(-1)
        keep = np.maximum(np.float32(1.0) - p_c / np.maximum(q_c, _TINY), np.float32(0.0))
        kept = torch.rand(1, len(y), generator=generator)[0].numpy() < keep
        if kept.any():
            return int(y[kept.argmax()])
    draft_row, target_row = draft.row(n)[None], target.row(n)[None]
    group = acceptance._exact_residual_group(view, draft_row, target_row, generator)
    return int(acceptance._token_in_group(view, target_row, group, generator)[0])
