"""A speech head's rows as the rules and proposers read them: probabilities, or a digit head's scores.

A step's distributions reach the acceptance rules in one of two forms with one interface
(probabilities at given tokens, independent draws from a row, the dense row itself):

  DenseRows  probability rows [R, V] (any head). Draws use the row's float64 CDF, as the tensor
             rules do, so the host lane returns the tensor rules' tokens draw for draw.
  DigitRows  a digit head's scores [R, 34] (runtime/lm/digit_head.py): each row is a product of
             per-digit softmaxes, so probabilities and exact draws cost O(8) per token and no
             65,537-wide row is built (a step's draft and target rows are factored in one pass).
"""

from __future__ import annotations

import numpy as np
import torch

from pcgtts.runtime.config import SamplingConfig
from pcgtts.runtime.decode.sampling import cdf_of, draw, logits_to_probs
from pcgtts.runtime.lm.digit_head import (LEVELS, argmax_digit_codes, digit_halves, expand_digit_scores,
                                          host_digit_log_probs, host_draw_digit_codes)


class DenseRows:
    """Distributions as probability rows: probs [R, V] float32, and the logits they came from when a
    rule ranks tokens (top-M: ranks survive temperature 0 and top-p, probabilities do not)."""

    def __init__(self, probs: torch.Tensor, logits: torch.Tensor | None = None):
        self.probs, self.logits, self.size = probs, logits, probs.shape[-1]
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
