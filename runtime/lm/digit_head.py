"""Digit-factorised speech heads: a head whose 4**8 speech rows are sums of per-digit rows costs 34 rows.

X-codec2 codes are 8 FSQ digits of 4 levels (transformers' basis: digit d of code c is
(c // 4**d) % 4). A target trained with a factorised speech head (the lab's, `train/lm.py`) is
exported in the released layout as a plain 65,536-row matrix whose row c is exactly
`base + sum_d delta[d, digit_d(c)]`. `find_digit_table` recognises such a matrix at load time
(every row is checked) and returns the 1 + 8 * 4 rows that reproduce it; `expand_digit_scores`
turns their scores into the 65,536 logits with 7 broadcast adds instead of a 65,536-row matmul.
Any other head (a released LLaSA's, a random one) fails the check and is used as stored.

Table layout, [1 + digits * levels + 1, hidden]: the base row (code 0), then for each digit d
(least significant first) its `levels` deltas, then the stop row.
"""

from __future__ import annotations

import math

import numpy as np
import torch

LEVELS = 4  # X-codec2's FSQ: 4 levels per digit


def digit_count(num_speech: int, levels: int = LEVELS) -> int | None:
    """n with levels**n == num_speech (n >= 2), or None when the speech vocabulary is not a digit grid."""
    n, size = 0, 1
    while size < num_speech:
        n, size = n + 1, size * levels
    return n if size == num_speech and n >= 2 else None


def code_digits(codes: torch.Tensor, digits: int, levels: int = LEVELS) -> torch.Tensor:
    """codes [...] -> their digits [..., digits], least significant first."""
    powers = levels ** torch.arange(digits, device=codes.device)
    return (codes.unsqueeze(-1) // powers) % levels


def digit_sums(per_digit: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """Every combination of per-digit values summed: [..., n, L] -> [..., L**n], indexed by the
    code whose digits pick the terms (digit 0 least significant). Tensors or NumPy arrays."""
    n = per_digit.shape[-2]
    sums = per_digit[..., n - 1, :]
    for d in range(n - 2, -1, -1):  # append less significant digits: index = high * L + low
        sums = (sums[..., :, None] + per_digit[..., d, None, :]).reshape(*sums.shape[:-1], -1)
    return sums


@torch.no_grad()
def find_digit_table(speech_rows: torch.Tensor, stop_row: torch.Tensor, levels: int = LEVELS,
                     rel_tol: float = 1e-5) -> torch.Tensor | None:
    """The [1 + n * levels + 1, D] digit table reproducing `speech_rows` [levels**n, D] and the
    stop row [D], or None when some row is not its digits' sum (checked for every row, to
    `rel_tol` of the table's largest entry: float32 rounding of an exact sum passes, anything
    else fails). Rows are read 4,096 at a time (pass a view of the checkpoint's head: a 1B model's
    65,536 x 2,048 rows are never copied whole), and an ordinary head fails on the first block."""
    n = digit_count(len(speech_rows), levels)
    if n is None:
        return None
    base = speech_rows[0].float()
    one_digit = (levels ** torch.arange(n))[:, None] * torch.arange(levels)[None, :]  # [n, L]: codes with one nonzero digit
    deltas = speech_rows[one_digit].float() - base  # [n, L, D]
    table = torch.cat([base[None], deltas.reshape(n * levels, -1), stop_row.float()[None]])
    tol = rel_tol * float((deltas + base).abs().max().clamp(min=1e-30))
    # Codes in an aligned block of levels**low share their high digits: predict the block as
    # (its high digits' deltas) + (every combination of the low digits' deltas), computed once.
    low = min(n, 6)
    block = digit_sums(deltas[:low].permute(2, 0, 1)).T  # [L**low, D]
    size = levels ** low
    for start in range(0, len(speech_rows), size):
        high = code_digits(torch.tensor(start), n, levels)[low:]
        offset = base + deltas[torch.arange(low, n), high].sum(0)
        if float((offset + block - speech_rows[start:start + size].float()).abs().max()) > tol:
            return None
    return table


def expand_digit_scores(scores: torch.Tensor, digits: int, levels: int = LEVELS) -> torch.Tensor:
    """Scores of a digit table [..., 1 + digits * levels + 1] -> restricted logits [..., levels**digits + 1]
    (speech codes in index order, then stop).

    The code's index splits into a high and a low half of its digits: the sums over each half
    (L**(n/2) values, base folded into the high half) are combined by one outer add, so a row
    costs one pass over its 65,536 speech entries (a digit-by-digit expansion makes seven)."""
    high_sums, low_sums = digit_halves(scores[..., 1:-1].unflatten(-1, (digits, levels)), scores[..., 0])
    speech = (high_sums.unsqueeze(-1) + low_sums.unsqueeze(-2)).flatten(-2)  # index = high * L**low + low
    return torch.cat([speech, scores[..., -1:]], dim=-1)


def digit_halves(per_digit: torch.Tensor | np.ndarray, base: torch.Tensor | np.ndarray):
    """Per-digit values [..., n, L] and a base [...] -> the sums over a code's high digits with the
    base folded in [..., L**(n - n//2)] and over its low digits [..., L**(n//2)]: code
    high * L**(n//2) + low is their sum."""
    low = per_digit.shape[-2] // 2
    return digit_sums(per_digit[..., low:, :]) + base[..., None], digit_sums(per_digit[..., :low, :])


def digit_log_probs(scores: torch.Tensor, digits: int, temperature: float,
                    levels: int = LEVELS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distribution softmax(expand_digit_scores(scores) / temperature) in factored form, float64:
    scores [..., 1 + digits * levels + 1] -> (per-digit log-softmaxes [..., digits, levels], log P(a
    speech code) [...], log P(stop) [...]); code c has log-probability
    log P(speech) + sum_d per_digit[d, digit_d(c)]. Every probability costs O(digits), no row is expanded."""
    z = scores.double() / temperature
    per_digit = z[..., 1:-1].unflatten(-1, (digits, levels))
    norms = per_digit.logsumexp(-1)  # [..., n]
    speech = z[..., 0] + norms.sum(-1)  # log of the summed exp over all codes
    total = torch.logaddexp(speech, z[..., -1])
    return per_digit - norms[..., None], speech - total, z[..., -1] - total


def host_digit_log_probs(scores: np.ndarray, digits: int, temperature: float,
                         levels: int = LEVELS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`digit_log_probs` in NumPy, for rows on the host (a decode step's few rows: each tensor op
    has a fixed cost of microseconds, a NumPy op a fraction of one)."""
    z = scores.astype(np.float64) / temperature
    per_digit = z[..., 1:-1].reshape(*z.shape[:-1], digits, levels)
    top = per_digit.max(-1, keepdims=True)
    norms = np.log(np.exp(per_digit - top).sum(-1)) + top[..., 0]  # [..., n]
    speech = z[..., 0] + norms.sum(-1)
    total = np.logaddexp(speech, z[..., -1])
    return per_digit - norms[..., None], speech - total, z[..., -1] - total


def host_draw_digit_codes(per_digit: np.ndarray, log_stop: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """`sample_digit_codes` in NumPy (float64) from `host_digit_log_probs`' factored form: per-digit
    log-softmaxes [..., n, L] and log P(stop) [...], uniforms [..., n + 1] (the stop coin first) ->
    restricted indices [...]; the same draws up to float rounding."""
    digits, levels = per_digit.shape[-2:]
    cdf = np.exp(per_digit).cumsum(-1)  # [..., n, L]
    digit = np.minimum((cdf <= uniforms[..., 1:, None] * cdf[..., -1:]).sum(-1), levels - 1)
    code = (digit * levels ** np.arange(digits)).sum(-1)
    return np.where(uniforms[..., 0] < np.exp(log_stop), levels ** digits, code)


def draw_digit_code(scores: list[float], digits: int, temperature: float, uniforms: list[float],
                    levels: int = LEVELS) -> int:
    """`sample_digit_codes` for one row in plain Python: scores [1 + digits * levels + 1] and
    uniforms [digits + 1] as lists -> the restricted index. One draw a decode step: after a
    forward has evicted the caches, ~40 float operations beat a dozen NumPy or tensor calls."""
    z = [value / temperature for value in scores]
    log_speech, code, place = z[0], 0, 1
    for d in range(digits):
        row = z[1 + d * levels:1 + (d + 1) * levels]
        top = max(row)
        weights = [math.exp(value - top) for value in row]
        total = sum(weights)
        log_speech += top + math.log(total)
        bound, cdf, digit = uniforms[d + 1] * total, 0.0, 0
        for weight in weights[:-1]:  # inverse CDF: the number of CDF entries <= the bound
            cdf += weight
            if cdf > bound:
                break
            digit += 1
        code += digit * place
        place *= levels
    p_stop = 1.0 / (1.0 + math.exp(min(log_speech - z[-1], 700.0))) if z[-1] > -math.inf else 0.0  # -inf: forbidden
    return levels ** digits if uniforms[0] < p_stop else code


def argmax_digit_code(scores: list[float], digits: int, levels: int = LEVELS) -> int:
    """The argmax of `expand_digit_scores(scores)` for one row in plain Python, without expanding it:
    scores [1 + digits * levels + 1] as a list -> the restricted index. A code's logit is the base plus
    one entry per digit, so the best code takes each digit's best level (the lowest on a tie, as
    argmax over the row in index order does); the stop token wins only when strictly above it."""
    code, place, best = 0, 1, scores[0]
    for d in range(digits):
        row = scores[1 + d * levels:1 + (d + 1) * levels]
        top = max(row)
        best += top
        code += row.index(top) * place
        place *= levels
    return levels ** digits if scores[-1] > best else code


def argmax_digit_codes(scores: torch.Tensor | np.ndarray, digits: int, levels: int = LEVELS):
    """`argmax_digit_code` for rows of scores [..., 1 + digits * levels + 1] (a tensor on any device,
    or a NumPy array) -> restricted indices [...] (int64)."""
    per_digit = scores[..., 1:-1].reshape(*scores.shape[:-1], digits, levels)
    if isinstance(scores, np.ndarray):
        best = per_digit.argmax(-1)  # [..., n]: the first maximum, as torch's
        code = (best * levels ** np.arange(digits)).sum(-1)
        return np.where(scores[..., -1] > per_digit.max(-1).sum(-1) + scores[..., 0], levels ** digits, code)
    top, best = per_digit.max(-1)
    code = (best * levels ** torch.arange(digits, device=scores.device)).sum(-1)
    return torch.where(scores[..., -1] > top.sum(-1) + scores[..., 0], levels ** digits, code)


def digit_kl(p_scores: torch.Tensor, q_scores: torch.Tensor, digits: int, levels: int = LEVELS) -> torch.Tensor:
    """KL(P || Q) [...] between P = softmax(expand_digit_scores(p_scores)) and Q likewise, without
    expanding a row (differentiable in both; float64).

    Given "speech", a code's digits are independent under either distribution, so

        KL = P(stop) log P(stop)/Q(stop) + P(speech) [log P(speech)/Q(speech) + sum_d KL(p_d || q_d)]

    with p_d, q_d the per-digit softmaxes: O(digits * levels) per row instead of O(levels**digits)."""
    p_digit, p_speech, p_stop = digit_log_probs(p_scores, digits, 1.0, levels)
    q_digit, q_speech, q_stop = digit_log_probs(q_scores, digits, 1.0, levels)
    per_digit = (p_digit.exp() * (p_digit - q_digit)).sum((-2, -1))
    return p_stop.exp() * (p_stop - q_stop) + p_speech.exp() * (p_speech - q_speech + per_digit)


def sample_digit_codes(scores: torch.Tensor, digits: int, temperature: float | torch.Tensor, uniforms: torch.Tensor,
                       levels: int = LEVELS, precision: torch.dtype = torch.float32) -> torch.Tensor:
    """Draws from softmax(expand_digit_scores(scores) / temperature) without expanding: the
    speech part of that distribution is a product of independent per-digit softmaxes, so a draw
    is one stop-or-speech coin and one 4-way draw per digit (exact; top-p needs the expanded row).

    scores: [..., 1 + digits * levels + 1]; uniforms: [..., digits + 1] in [0, 1) (the coin first)
    -> restricted indices [...] (levels**digits is the stop token). `precision` float64 draws as
    `draw_digit_code` does, up to rounding."""
    z = scores.to(precision) / temperature
    per_digit = z[..., 1:-1].unflatten(-1, (digits, levels))  # [..., n, L]
    speech_mass = z[..., 0] + per_digit.logsumexp(-1).sum(-1)  # log of the summed exp over all codes
    p_stop = torch.sigmoid(z[..., -1] - speech_mass)
    cdf = per_digit.softmax(-1).cumsum(-1)  # [..., n, L]
    digit = (cdf <= uniforms[..., 1:, None] * cdf[..., -1:]).sum(-1).clamp_(max=levels - 1)  # inverse CDF
    code = digit[..., -1]
    for d in range(digits - 2, -1, -1):  # code = sum_d digit_d levels**d, by Horner's rule
        code = code * levels + digit[..., d]
    return torch.where(uniforms[..., 0] < p_stop, torch.full_like(code, levels ** digits), code)
