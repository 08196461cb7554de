"""The SD, SSD and PCG rules for one sequence on a CPU: the rules of `tensor.py`, indexed with NumPy.

At batch 1 a verify step reads a few hundred entries of its distributions; as tensor ops that is
~300 calls at 1.5-5 µs of fixed cost each (more right after a forward has evicted the caches),
while a NumPy index over a handful of entries costs ~0.3 µs. This lane reads the distributions
through the rows of `runtime/decode/rows.py`: over `DenseRows` it draws from each row's float64
CDF, as the tensor rules do, so for one generator state it returns their tokens draw for draw
(tests/test_acceptance.py) and their statistical tests cover it. Over `DigitRows` the recovered
token is drawn by thinning (draw y from the target, keep it with probability (1 - p(y)/q(y))+ for
SD: exactly the normalised residual; PCG as `tensor._recover`), with the dense residual as the
rare last resort. The compiled rule (`compiled.py`) finishes its unfinished recoveries here (`recover`).
"""

from __future__ import annotations

import numpy as np
import torch

from pcgtts.groups.device import DeviceGroupTable, HostSpans
from pcgtts.runtime.decode.acceptance.coarse import (CoarseView, coarse_view, exact_residual_group, group_members,
                                                     pick_group, token_in_group, uniforms64)
from pcgtts.runtime.decode.acceptance.tensor import THINNING_ROUNDS, sd_residual
from pcgtts.runtime.decode.rows import DenseRows, DigitRows, Rows
from pcgtts.runtime.decode.sampling import sample_from_weights

_TINY = np.finfo(np.float32).tiny


def judge(rule: str, draft_tokens: torch.Tensor, draft: Rows, target: Rows, uniforms: torch.Tensor,
          generator: torch.Generator, *, groups: DeviceGroupTable | None = None, ssd_beta: float = 0.0,
          thinning_trials: int = 16) -> tuple[int, list[int]]:
    """One sequence's SD / SSD / PCG verdict on the host: (n accepted, the n + 1 tokens to emit).
    draft_tokens [L], uniforms [L]; draft rows [L] and target rows [L + 1] (`DenseRows` /
    `DigitRows`). With dense rows, the same outcome as `tensor.verify` for the same generator state."""
    if isinstance(draft, DigitRows) and isinstance(target, DigitRows):
        DigitRows.factor(draft, target)
    tokens, uniforms = draft_tokens.numpy(), uniforms.numpy()
    if rule == "pcg":
        if groups is None:
            raise ValueError("the pcg rule needs a group table")
        view = coarse_view(groups, target.size)  # checks the table covers the vocabulary
        return _pcg(tokens, draft, target, uniforms, generator, view, thinning_trials)
    beta = ssd_beta if rule == "ssd" else 0.0
    if isinstance(draft, DenseRows) and isinstance(target, DenseRows):
        return _sd_dense(tokens, draft.probs, target.probs, uniforms, generator, beta)
    return _sd(tokens, draft, target, uniforms, generator, beta, thinning_trials)


def greedy(tokens: np.ndarray, best: np.ndarray) -> tuple[int, list[int]]:
    """tensor.verify_greedy at batch 1 from the target's argmaxes best [L + 1]: accept while a
    proposal is the argmax, then emit the argmax."""
    n = _prefix(tokens == best[:-1])
    return n, [*tokens[:n].tolist(), int(best[n])]


def _prefix(accept: np.ndarray) -> int:
    """Length of the all-True prefix of a [L] bool array."""
    return int(accept.argmin()) if not accept.all() else len(accept)


def _accepted(on_target: np.ndarray, on_draft: np.ndarray, uniforms: np.ndarray, beta: float = 0.0) -> int:
    """How many proposals the ratio test keeps: u < min(1, target / draft) + beta, in order; never a
    token the target rules out (probability 0: a stop before the minimum length), whatever beta."""
    ratio = on_target / np.maximum(on_draft, _TINY)
    return _prefix((uniforms < np.minimum(ratio, np.float32(1.0)) + np.float32(beta)) & (on_target > 0))


def _sd_dense(tokens: np.ndarray, draft_probs: torch.Tensor, target_probs: torch.Tensor, uniforms: np.ndarray,
              generator: torch.Generator, beta: float) -> tuple[int, list[int]]:
    """tensor.verify_sd at batch 1: the residual as a dense row, one inverse-CDF draw."""
    positions = np.arange(len(tokens))
    n = _accepted(target_probs.numpy()[positions, tokens], draft_probs.numpy()[positions, tokens], uniforms, beta)
    weights = target_probs[n] if n == len(tokens) else sd_residual(target_probs[n], draft_probs[n])
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
    for round_ in range(THINNING_ROUNDS + 1):
        y = target.draw(n, trials << round_, generator)
        keep = np.maximum(1.0 - draft.at(n, y) / np.maximum(target.at(n, y), _TINY), 0.0)
        kept = torch.rand(len(y), generator=generator).numpy() < keep
        if kept.any():
            return n, [*tokens[:n].tolist(), int(y[kept.argmax()])]
    residual = sd_residual(target.row(n), draft.row(n))
    return n, [*tokens[:n].tolist(), int(sample_from_weights(residual, torch.rand(1, generator=generator)))]


def _pick(h: HostSpans, tokens: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """`coarse.pick_group` over the table's host arrays."""
    return pick_group(h.token, h.token_shift, h.token_groups, tokens, uniforms)


def _members(h: HostSpans, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`coarse.group_members` and the equal-split weights: groups [K] -> (tokens [K, W], 1/N(t) on
    members and 0 on padding [K, W]), W the largest of these groups."""
    slots = np.arange(int(h.group[groups][:, 1].max()))
    members, valid = group_members(h.group, h.member_shift, h.group_members, groups, slots)
    return members, h.inv_n[members] * valid


def _uniforms64(count: int, generator: torch.Generator) -> np.ndarray:
    return uniforms64(1, count, generator, "cpu")[0].numpy()


def _pcg(tokens: np.ndarray, draft: Rows, target: Rows, uniforms: np.ndarray, generator: torch.Generator,
         view: CoarseView, trials: int) -> tuple[int, list[int]]:
    """tensor.verify_pcg at batch 1; `view` is the table's `coarse.coarse_view`."""
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
    return n, [*tokens[:n].tolist(), recover(view, draft, target, n, trials, generator, draws[1:])]


def recover(view: CoarseView, draft: Rows, target: Rows, n: int, trials: int,
             generator: torch.Generator, y: np.ndarray | None = None, first_round: int = 0) -> int:
    """tensor._recover for row `n`: thinning in growing rounds (from `first_round`; y: round 0's
    `trials` candidates, if drawn), then the exact residual."""
    h = view.table.host
    for round_ in range(first_round, THINNING_ROUNDS + 1):
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
    group = exact_residual_group(view, draft_row, target_row, generator)
    return int(token_in_group(view, target_row, group, generator)[0])
