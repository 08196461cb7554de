"""Turning logits into the distributions the acceptance rules compare, and sampling from them.

Temperature and top-p are applied identically to draft and target: the rules' guarantees
hold for the *processed* distributions. Sampling takes an explicit `torch.Generator` and
uses inverse-CDF sampling (one uniform and a cumulative sum per row), which needs no host
sync and is cheaper on a CPU than an exponential race over 65,537 entries.
"""

from __future__ import annotations

import torch

from pcgtts.runtime.config import SamplingConfig
from pcgtts.runtime.lm.digit_head import argmax_digit_code, argmax_digit_codes, draw_digit_code, sample_digit_codes


def logits_to_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """logits: [..., V] -> float32 probabilities [..., V]. Temperature 0 gives one-hot argmax."""
    logits = logits.float()
    if sampling.greedy:
        # argmax picks the lowest index among ties, so greedy decoding is deterministic.
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p (the top token always survives).
        sorted_probs = sorted_probs.masked_fill(mass_before >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def forbid_stop(scores: torch.Tensor, first: int | torch.Tensor, minimum: int | torch.Tensor) -> torch.Tensor:
    """A minimum length: scores [..., R, W] (logits, or a digit head's scores: the stop token's column
    is the last in both) whose row i decides speech token number `first + i` (0 = the utterance's first),
    with the stop column at -inf in every row where `first + i < minimum`. Every distribution made
    from them then gives the stop token probability 0 (the rest renormalised), and no argmax picks
    it. Ints (the host loop): `scores` itself once no row is concerned; tensors (the device loop):
    no host sync, the same shapes every step."""
    if isinstance(first, int) and isinstance(minimum, int) and first >= minimum:
        return scores
    row = first + torch.arange(scores.shape[-2], device=scores.device)
    stop = scores[..., -1:].masked_fill((row < minimum).unsqueeze(-1), float("-inf"))
    return torch.cat([scores[..., :-1], stop], dim=-1)


def sample_from_weights(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. weights: [..., V] >= 0 (unnormalised); uniforms: [...] in [0, 1).

    Returns int64 indices [...]. Entries of weight 0 are never chosen: `right=True` makes a
    flat stretch of the CDF unreachable.
    """
    cdf = weights.double().cumsum(-1)
    target = uniforms.double().unsqueeze(-1) * cdf[..., -1:]
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return index.clamp_(max=weights.shape[-1] - 1)


def cdf_of(weights: torch.Tensor) -> torch.Tensor:
    """Unnormalised float64 CDF of each row, reusable for any number of draws. [B, V] -> [B, V]"""
    return weights.double().cumsum(-1)


def draw(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Independent draws from rows of `cdf_of(...)`. cdf: [B, V]; uniforms: [B, K] -> int64 [B, K]."""
    index = torch.searchsorted(cdf, uniforms.double() * cdf[:, -1:], right=True)
    return index.clamp_(max=cdf.shape[-1] - 1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row of probs [..., V] -> int64 [...]."""
    uniforms = torch.rand(probs.shape[:-1], generator=generator, device=probs.device)
    return sample_from_weights(probs, uniforms)


def sample_by_digits(scores: torch.Tensor, digits: int, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """One token from a digit table's scores [1 + 4 * digits + 1] at plain `temperature`, digit by
    digit (`digit_head.sample_digit_codes`; on a CPU its plain-Python twin, a third of the time in
    a decode loop) -> int64 []. At temperature 0 the argmax, digit by digit (`argmax_digit_code`),
    which draws nothing from `generator` (nor does greedy decoding's output depend on it)."""
    if temperature == 0.0:
        if scores.device.type == "cpu":
            return torch.tensor(argmax_digit_code(scores.tolist(), digits))
        return argmax_digit_codes(scores, digits)
    uniforms = torch.rand(digits + 1, generator=generator, device=scores.device)
    if scores.device.type == "cpu":
        return torch.tensor(draw_digit_code(scores.tolist(), digits, temperature, uniforms.tolist()))
    return sample_digit_codes(scores, digits, temperature, uniforms)


def digits_to_draw(lm, sampling) -> int:
    """n > 0 when `lm`'s plain steps take their token digit by digit (a digit head at plain
    temperature: `digit_head.sample_digit_codes`; or greedy: `digit_head.argmax_digit_codes`), else 0."""
    return lm.drawable_digits if sampling.plain or sampling.greedy else 0


def rule_digits(lm, sampling) -> int:
    """n > 0 when the rules can read `lm`'s distributions as digit scores (`rows.DigitRows`):
    a drawable digit head, on a CPU (where the rules run on the host; the greedy rule reads each
    row's argmax, digit by digit)."""
    return digits_to_draw(lm, sampling) if lm.device.type == "cpu" else 0
