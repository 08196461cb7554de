"""Confidence intervals for the quality tables, and the plain-text table they are printed in.

Data flow: per-utterance metric values (one per sentence x seed, `harness.py`) go in;
`Estimate`s come out and are formatted by `format_table`.

    mean_ci        mean with a two-sided t-interval over the utterances (default 95 %)
    wilson         Wilson score interval of a pass rate (k of n cases), for the cloning bar
    pass_rate      a pass count with that interval, as {passed, n, rate, low, high}
    paired_diff    mean difference to a baseline on the SAME keys (sentence, seed), paired t-interval:
                   differences between rules are read against the spread of the differences, not
                   of the raw scores, so a small but consistent change is not lost in sentence noise
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class Estimate:
    mean: float
    low: float  # NaN when n < 2 (no spread to estimate)
    high: float
    n: int
    confidence: float = 0.95

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2.0

    def excludes_zero(self) -> bool:
        """True when the interval lies wholly on one side of 0 (a difference that is not noise)."""
        return self.n >= 2 and (self.low > 0.0 or self.high < 0.0)

    def as_dict(self) -> dict:
        nan = lambda v: None if isinstance(v, float) and math.isnan(v) else v  # noqa: E731 - JSON has no NaN
        return {"mean": nan(self.mean), "low": nan(self.low), "high": nan(self.high), "n": self.n,
                "confidence": self.confidence}

    def format(self, scale: float = 1.0, digits: int = 1, signed: bool = False) -> str:
        """"12.3 ± 1.4" (mean ± half-width of the interval), scaled (100 for percentages)."""
        if self.n == 0 or math.isnan(self.mean):
            return "-"
        sign = "+" if signed else ""
        text = f"{self.mean * scale:{sign}.{digits}f}"
        if self.n >= 2 and not math.isnan(self.half_width):
            text += f" ± {self.half_width * scale:.{digits}f}"
        return text


def _clean(values: Sequence[float | None]) -> np.ndarray:
    return np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=np.float64)


def mean_ci(values: Sequence[float | None], confidence: float = 0.95) -> Estimate:
    """Mean of the finite values and the t-interval mean ± t_{(1+c)/2, n-1} * s / sqrt(n).
    None / NaN entries (a metric undefined for that utterance) are left out and not counted."""
    from scipy import stats

    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    x = _clean(values)
    n = len(x)
    if n == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0, confidence)
    mean = float(x.mean())
    if n < 2:
        return Estimate(mean, float("nan"), float("nan"), 1, confidence)
    sem = float(x.std(ddof=1)) / math.sqrt(n)
    half = float(stats.t.ppf((1.0 + confidence) / 2.0, n - 1)) * sem
    return Estimate(mean, mean - half, mean + half, n, confidence)


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95 % by default); NaNs for n = 0."""
    if n == 0:
        return math.nan, math.nan
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def pass_rate(passed: int, n: int) -> dict:
    """{passed, n, rate, low, high}: a pass count with its Wilson 95 % interval."""
    low, high = wilson(passed, n)
    return {"passed": passed, "n": n, "rate": passed / n if n else math.nan, "low": low, "high": high}


def paired_diff(values: Mapping[Hashable, float | None], baseline: Mapping[Hashable, float | None],
                confidence: float = 0.95) -> Estimate:
    """Mean of values[k] - baseline[k] over the keys both define, with the paired t-interval.
    The keys (e.g. (sentence, seed)) must be the same set: a comparison on different
    utterances is not a paired one, so mismatched keys are an error."""
    if set(values) != set(baseline):
        only_a, only_b = set(values) - set(baseline), set(baseline) - set(values)
        raise ValueError(f"paired comparison needs the same utterances: {len(only_a)} keys only in the "
                         f"compared row, {len(only_b)} only in the baseline")
    diffs = []
    for key, value in values.items():
        base = baseline[key]
        if value is None or base is None or math.isnan(value) or math.isnan(base):
            continue
        diffs.append(value - base)
    return mean_ci(diffs, confidence)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str | None = None) -> str:
    """A plain-text table (first column left-aligned, the rest right-aligned), ready to print."""
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    if any(len(r) != len(headers) for r in cells):
        raise ValueError("every row needs one cell per header")
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    out = [title] if title else []
    out += [line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]]
    return "\n".join(out)


__all__ = ["Estimate", "mean_ci", "wilson", "pass_rate", "paired_diff", "format_table"]
