"""The SD, SSD and PCG rules for one sequence on a CPU: the rules of acceptance.py, indexed with NumPy.

At batch 1 a verify step reads a few hundred entries of its distributions; as tensor ops that is
~300 calls at 1.5-5 µs of fixed cost each (more right after a forward has evicted the caches),
while a NumPy index over a handful of entries costs ~0.3 µs. This lane reads the same tensors
through NumPy views (no copies), keeps the 65,537-wide work (a row's CDF, the SD residual) in
torch, and draws its random numbers from the same generator in the same order and shapes as the
tensor rules: for one generator state both return the same tokens (tests/test_acceptance.py
checks that, draw for draw, so the tensor rules' statistical tests cover this lane).

`verify_one` is what the decode loops call: this lane on a CPU, the tensor rules elsewhere (and
for the greedy rule), with the outcome on the host either way.
"""

from __future__ import annotations

import numpy as np
import torch

from pcgtts.groups.device import DeviceGroupTable, HostSpans
from pcgtts.runtime.decode import acceptance
from pcgtts.runtime.decode.acceptance import outcome, verify
from pcgtts.runtime.decode.sampling import cdf_of, draw, sample_from_weights

_TINY = np.finfo(np.float32).tiny
_LANE_RULES = ("sd", "ssd", "pcg")


def verify_one(rule: str, draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
               uniforms: torch.Tensor, generator: torch.Generator, *, groups: DeviceGroupTable | None = None,
               ssd_beta: float = 0.0, thinning_trials: int = 16) -> tuple[int, list[int]]:
    """One sequence's verdict on the host: (n accepted, the n + 1 tokens to emit).

    draft_tokens [L], draft_probs [L, V], target_probs [L + 1, V], uniforms [L]: `verify`'s
    arguments without the batch dimension, and the same outcome for the same generator state."""
    if target_probs.device.type == "cpu" and rule in _LANE_RULES and draft_tokens.dim() == 1:
        if target_probs.shape[0] != draft_tokens.shape[0] + 1 or draft_probs.shape[0] != draft_tokens.shape[0]:
            raise ValueError("expected draft_tokens [L], draft_probs [L, V], target_probs [L + 1, V]")
        tokens = draft_tokens.numpy()
        if rule == "pcg":
            if groups is None:
                raise ValueError("the pcg rule needs a group table")
            return _pcg(tokens, draft_probs, target_probs, uniforms.numpy(), generator, groups, thinning_trials)
        return _sd(tokens, draft_probs, target_probs, uniforms.numpy(), generator, ssd_beta if rule == "ssd" else 0.0)
    return outcome(verify(rule, draft_tokens[None], draft_probs[None], target_probs[None], uniforms[None], generator,
                          groups=groups, ssd_beta=ssd_beta, thinning_trials=thinning_trials))


def _prefix(accept: np.ndarray) -> int:
    """Length of the all-True prefix of a [L] bool array."""
    return int(accept.argmin()) if not accept.all() else len(accept)


def _sd(tokens: np.ndarray, draft_probs: torch.Tensor, target_probs: torch.Tensor, uniforms: np.ndarray,
        generator: torch.Generator, beta: float) -> tuple[int, list[int]]:
    length = len(tokens)
    positions = np.arange(length)
    on_draft = draft_probs.numpy()[positions, tokens]
    on_target = target_probs.numpy()[positions, tokens]
    ratio = on_target / np.maximum(on_draft, _TINY)
    n = _prefix(uniforms < np.minimum(ratio, np.float32(1.0)) + np.float32(beta))
    weights = target_probs[n] if n == length else acceptance.sd_residual(target_probs[n], draft_probs[n])
    token = sample_from_weights(weights, torch.rand(1, generator=generator))
    return n, [*tokens[:n].tolist(), int(token)]


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


def _masses(probs: np.ndarray, members: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Coarse masses sum_t probs[.., t] / N(t) of K groups; probs [K, V] (one row per group) or [V]."""
    rows = np.arange(len(members))[:, None] if probs.ndim == 2 else slice(None)
    picked = probs[rows, members] if probs.ndim == 2 else probs[members]
    return (picked * weights).sum(-1)


def _uniforms64(count: int, generator: torch.Generator) -> np.ndarray:
    return acceptance._uniforms64(1, count, generator, "cpu")[0].numpy()


def _pcg(tokens: np.ndarray, draft_probs: torch.Tensor, target_probs: torch.Tensor, uniforms: np.ndarray,
         generator: torch.Generator, groups: DeviceGroupTable, trials: int) -> tuple[int, list[int]]:
    length, h = len(tokens), groups.host
    if draft_probs.shape[-1] != groups.num_tokens + 1:
        acceptance._coarse_view(groups, draft_probs.shape[-1])  # raises its error
    proposed = _pick(h, tokens, _uniforms64(length, generator))
    members, weights = _members(h, proposed)
    p_c = _masses(draft_probs.numpy(), members, weights)
    q_c = _masses(target_probs.numpy()[:length], members, weights)
    n = _prefix(uniforms < np.minimum(q_c / np.maximum(p_c, _TINY), np.float32(1.0)))
    target_row = target_probs[n]
    cdf = cdf_of(target_row[None])
    draws = draw(cdf, torch.rand(1, 1 + trials, generator=generator))[0].numpy()
    if n == length:
        return n, [*tokens.tolist(), int(draws[0])]
    token = _recover(groups, draft_probs[n], target_row, cdf, draws[1:], generator)
    return n, [*tokens[:n].tolist(), token]


def _recover(groups: DeviceGroupTable, draft_row: torch.Tensor, target_row: torch.Tensor, cdf: torch.Tensor,
             y: np.ndarray, generator: torch.Generator) -> int:
    """acceptance._recover for one row: thinning in growing rounds, then the exact residual."""
    h, draft_np, target_np = groups.host, draft_row.numpy(), target_row.numpy()
    trials = len(y)
    for round_ in range(acceptance.THINNING_ROUNDS + 1):
        if round_:
            y = draw(cdf, torch.rand(1, trials << round_, generator=generator))[0].numpy()
        candidates = _pick(h, y, _uniforms64(len(y), generator))
        members, weights = _members(h, candidates)
        p_c, q_c = _masses(draft_np, members, weights), _masses(target_np, members, weights)
        keep = np.maximum(np.float32(1.0) - p_c / np.maximum(q_c, _TINY), np.float32(0.0))
        kept = torch.rand(1, len(y), generator=generator)[0].numpy() < keep
        if kept.any():
            return int(y[kept.argmax()])
    view = acceptance._coarse_view(groups, len(target_np))
    group = acceptance._exact_residual_group(view, draft_row[None], target_row[None], generator)
    return int(acceptance._token_in_group(view, target_row[None], group, generator)[0])
