"""The acceptance rules as batched tensor functions with fixed-shape outputs: the reference form.

Any batch, any device. The recovered token's residual is computed only where it is needed: on a
CPU, where a host sync is free, only for the rows that rejected a proposal (`_rejected_rows`; a
step that accepted everything samples just the bonus token); with `sync_free` (the default on
other devices, and what a captured CUDA graph needs) every row computes it with fixed shapes and
`torch.where` selects, so the host never reads device data. The package docstring states the rules.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pcgtts.groups.device import DeviceGroupTable
from pcgtts.runtime.decode.acceptance.coarse import (CoarseView, coarse_view, exact_residual_group, token_in_group,
                                                     uniforms64)
from pcgtts.runtime.decode.sampling import cdf_of, draw, sample_from_weights

RULES = ("greedy", "sd", "ssd", "pcg")
PLACEHOLDER = -1  # output slots after the recovered / bonus token
THINNING_ROUNDS = 8  # CPU: extra batches of thinning trials (doubling: up to 2^9 x the first) before the exact fallback


class Verdict(NamedTuple):
    tokens: torch.Tensor  # [B, L + 1] int64: accepted, then one recovered/bonus token, then -1
    num_accepted: torch.Tensor  # [B] int64 in [0, L]
    groups: torch.Tensor | None = None  # [B, L + 1] group emitted per slot (pcg only; -1 where none)


def outcome(verdict: Verdict) -> tuple[int, list[int]]:
    """The first sequence's verdict on the host: (n accepted, the n + 1 tokens to emit), in one sync."""
    n, *row = torch.cat([verdict.num_accepted[:1], verdict.tokens[0]]).tolist()
    return n, row[: n + 1]


def draw_uniforms(batch: int, length: int, generator: torch.Generator, device) -> torch.Tensor:
    return torch.rand(batch, length, generator=generator, device=device)


def _sync_free(sync_free: bool | None, like: torch.Tensor) -> bool:
    return default_sync_free(like.device) if sync_free is None else sync_free


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """accept: [B, L] bool -> length of the all-True prefix [B]."""
    return accept.long().cumprod(-1).sum(-1)


def _assemble(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
    """[B, L], [B], [B] -> tokens [B, L + 1]: draft prefix, the next token at slot n, then -1."""
    b, l = draft_tokens.shape
    slots = torch.arange(l + 1, device=draft_tokens.device).expand(b, -1)
    padded = torch.cat([draft_tokens, draft_tokens.new_full((b, 1), PLACEHOLDER)], dim=1)
    n = num_accepted[:, None]
    return torch.where(slots < n, padded, torch.where(slots == n, next_token[:, None], PLACEHOLDER))


def _row(probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """probs: [B, R, V], index: [B] -> probs[b, index[b]]: [B, V] (whole rows copied, not gathered entry by entry)."""
    b, r, v = probs.shape
    return probs.reshape(b * r, v).index_select(0, index + r * torch.arange(b, device=probs.device))


def verify_greedy(draft_tokens: torch.Tensor, target_probs: torch.Tensor) -> Verdict:
    # draft_tokens: [B, L]; target_probs: [B, L + 1, V] (one-hot at temperature 0)
    best = target_probs.argmax(-1)  # [B, L + 1]
    n = _accepted_prefix(draft_tokens == best[:, :-1])
    return Verdict(_assemble(draft_tokens, n, best.gather(1, n[:, None]).squeeze(1)), n)


def default_sync_free(device: torch.device) -> bool:
    """Whether the rules avoid host reads by default: everywhere but on a CPU, where a sync is free."""
    return device.type != "cpu"


def _rejected_rows(all_accepted: torch.Tensor, sync_free: bool) -> torch.Tensor | None:
    """Rows that need a residual: [B] bool (True = every proposal accepted) -> row indices.

    Without `sync_free` only the rejected rows are computed (none on a step that accepted
    everything). With it returns None: every row computes the residual and `torch.where`
    selects, keeping the step free of host syncs.
    """
    if sync_free:
        return None
    return (~all_accepted).nonzero().squeeze(1)


def verify_sd(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
              uniforms: torch.Tensor, generator: torch.Generator, beta: float = 0.0,
              sync_free: bool | None = None) -> Verdict:
    # draft_tokens: [B, L]; draft_probs: [B, L, V]; target_probs: [B, L + 1, V]; uniforms: [B, L]
    b, l = draft_tokens.shape
    on_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, L]
    on_target = target_probs[:, :l].gather(-1, draft_tokens[..., None]).squeeze(-1)
    # The draft never samples a token it gives probability 0; the clamp only avoids a NaN.
    ratio = on_target / on_draft.clamp_min(torch.finfo(on_draft.dtype).tiny)
    n = _accepted_prefix((uniforms < ratio.clamp(max=1.0) + beta) & (on_target > 0))  # beta never admits a 0
    target_row = _row(target_probs, n)  # [B, V]: the bonus row, or the rejected position's
    all_accepted = n == l
    rows = _rejected_rows(all_accepted, _sync_free(sync_free, n))
    if rows is None:
        weights = torch.where(all_accepted[:, None], target_row,
                              sd_residual(target_row, _row(draft_probs, n.clamp(max=l - 1))))
    elif rows.numel() == b:  # every row rejected (always, at B = 1): no row copies
        weights = sd_residual(target_row, _row(draft_probs, n))
    elif rows.numel():
        weights = target_row.clone()
        weights[rows] = sd_residual(target_row[rows], draft_probs[rows, n[rows]])
    else:
        weights = target_row  # all accepted: the bonus comes from the target itself
    next_token = sample_from_weights(weights, torch.rand(b, generator=generator, device=weights.device))
    return Verdict(_assemble(draft_tokens, n, next_token), n)


def sd_residual(target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """norm(max(0, target - draft)) unnormalised, [R, V] x 2 -> [R, V]. An all-zero residual
    happens only when target == draft (or via beta); then the target itself is the residual."""
    residual = (target_row - draft_row).clamp_min(0.0)
    return torch.where(residual.sum(-1, keepdim=True) <= 0, target_row, residual)


def _recover(view: CoarseView, draft_row: torch.Tensor, target_row: torch.Tensor, target_cdf: torch.Tensor,
             y: torch.Tensor, generator: torch.Generator, sync_free: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The recovered group K ~ [Q_c - P_c]_+ (normalised) and its token t in G_K ~ target(t)/N(t),
    for each row. draft_row, target_row: [B, V]; target_cdf: cdf_of(target_row); y: [B, T]
    independent draws from it (thinning candidates) -> (groups [B], tokens [B]).

    Thinning: draw y ~ target and K ~ uniform S(y), so (y, K) has probability target(y)/N(y) for
    y in G_K and K ~ Q_c; keep the pair with probability 1 - P_c(K)/Q_c(K). That factor depends
    on K alone, so a kept pair is exact twice over: K follows the residual and, given K, y follows
    target(t)/N(t) on G_K, which is the token PCG emits. `trials` candidates are drawn at once
    and the first kept one wins; when none is kept the residual is sampled exactly from all
    groups' masses and the token from the group. That fallback is a sparse mat-vec: cheap on a
    GPU, so with `sync_free` it is always computed and selected with `where` (no host sync); on a
    CPU a sync is free and it is computed only for the rows that need it.
    """
    (b, trials), device = y.shape, draft_row.device

    def thin(candidates_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        count = candidates_y.shape[1]
        cand = view.pick(candidates_y, uniforms64(b, count, generator, device))  # [B, T]
        p_c, q_c = view.masses(draft_row, target_row, cand, sync_free)
        keep_prob = (1.0 - p_c / q_c.clamp_min(torch.finfo(q_c.dtype).tiny)).clamp_min(0.0)
        kept = torch.rand(b, count, generator=generator, device=device) < keep_prob
        first = kept.long().argmax(-1)[:, None]
        return kept.any(-1), cand.gather(1, first).squeeze(1), candidates_y.gather(1, first).squeeze(1)

    def exact(rows_draft: torch.Tensor, rows_target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        group = exact_residual_group(view, rows_draft, rows_target, generator)
        return group, token_in_group(view, rows_target, group, generator, sync_free)

    any_kept, group, token = thin(y)
    if sync_free:
        # Sync-free: the exact residual over all groups is a cheap sparse mat-vec on a GPU.
        exact_group, exact_token = exact(draft_row, target_row)
        return torch.where(any_kept, group, exact_group), torch.where(any_kept, token, exact_token)
    # On a CPU syncs are free but the mat-vec is not (millions of entries). A rejection happens
    # with probability TV(P_c, Q_c) and each trial succeeds with probability ~TV, so repeating
    # thinning costs O(1) batches in expectation; the exact mat-vec is the rare last resort.
    for round_ in range(THINNING_ROUNDS):
        if bool(any_kept.all()):
            return group, token
        # Each round draws twice the trials of the last: the per-round cost is mostly fixed
        # (a few dozen small ops), so few, growing rounds beat many small ones.
        more = trials << (round_ + 1)
        more_y = draw(target_cdf, torch.rand(b, more, generator=generator, device=device))
        kept_now, group_now, token_now = thin(more_y)
        group, token = torch.where(any_kept, group, group_now), torch.where(any_kept, token, token_now)
        any_kept = any_kept | kept_now
    if bool(any_kept.all()):
        return group, token
    rows = (~any_kept).nonzero().squeeze(1)
    group, token = group.clone(), token.clone()
    group[rows], token[rows] = exact(draft_row[rows], target_row[rows])
    return group, token


def verify_pcg(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
               uniforms: torch.Tensor, generator: torch.Generator, groups: DeviceGroupTable,
               thinning_trials: int = 16, sync_free: bool | None = None) -> Verdict:
    # draft_tokens: [B, L]; draft_probs: [B, L, V]; target_probs: [B, L + 1, V]; uniforms: [B, L]
    b, l = draft_tokens.shape
    device = draft_tokens.device
    view = coarse_view(groups, draft_probs.shape[-1])
    sync_free = _sync_free(sync_free, draft_tokens)
    proposed = view.pick(draft_tokens, uniforms64(b, l, generator, device))  # [B, L]
    p_c, q_c = view.masses(draft_probs, target_probs[:, :l], proposed, sync_free)
    # P_c(K) > 0 because the draft sampled a member of K; the clamp only avoids a NaN.
    ratio = q_c / p_c.clamp_min(torch.finfo(p_c.dtype).tiny)
    n = _accepted_prefix(uniforms < ratio.clamp(max=1.0))

    target_row = _row(target_probs, n)  # [B, V]: the bonus row, or the rejected position's
    # One CDF of the target row serves the bonus token (all accepted) and the thinning
    # candidates (a rejection): both are independent draws from the same row.
    target_cdf = cdf_of(target_row)
    draws = draw(target_cdf, torch.rand(b, 1 + thinning_trials, generator=generator, device=device))
    bonus = draws[:, 0]
    all_accepted = n == l
    rows = _rejected_rows(all_accepted, sync_free)
    if rows is None:  # sync-free: every row computes the residual, `where` keeps the rejected ones
        draft_row = _row(draft_probs, n.clamp(max=l - 1))
        residual_group, recovered = _recover(view, draft_row, target_row, target_cdf, draws[:, 1:], generator,
                                             sync_free)
        next_token = torch.where(all_accepted, bonus, recovered)
        next_group = torch.where(all_accepted, torch.full_like(residual_group, PLACEHOLDER), residual_group)
    else:  # CPU: the residual only where a proposal was rejected
        next_token, next_group = bonus, torch.full_like(bonus, PLACEHOLDER)
        if rows.numel() == b:  # every row rejected (always, at B = 1): no row copies
            next_group, next_token = _recover(view, _row(draft_probs, n), target_row, target_cdf, draws[:, 1:],
                                              generator, sync_free)
        elif rows.numel():
            next_token, next_group = bonus.clone(), next_group.clone()
            next_group[rows], next_token[rows] = _recover(view, draft_probs[rows, n[rows]], target_row[rows],
                                                          target_cdf[rows], draws[rows, 1:], generator, sync_free)
    tokens = _assemble(draft_tokens, n, next_token)
    group_ids = _assemble(proposed, n, next_group)
    return Verdict(tokens, n, group_ids)


def verify_top_m(draft_tokens: torch.Tensor, target_scores: torch.Tensor, target_probs: torch.Tensor,
                 m: int, generator: torch.Generator) -> Verdict:
    """Speech-LLaMA's verification of head proposals: accept while each proposal is among the
    target's M highest-scoring tokens (M = 1: strict verification), then sample the next token
    from the target. Not exact in distribution for M > 1 or temperature > 0 (it favours the
    proposals); with M = 1 at temperature 0 it is greedy decoding.
    draft_tokens: [B, L]; target_scores (logits: ranks survive temperature 0): [B, L + 1, V];
    target_probs: [B, L + 1, V]."""
    b, l = draft_tokens.shape
    top = target_scores[:, :l].topk(m, dim=-1).indices  # [B, L, M]
    n = _accepted_prefix((top == draft_tokens[..., None]).any(-1))
    next_token = sample_from_weights(_row(target_probs, n), torch.rand(b, generator=generator, device=target_probs.device))
    return Verdict(_assemble(draft_tokens, n, next_token), n)


def verify_threshold(draft_tokens: torch.Tensor, target_probs: torch.Tensor, tau: float,
                     generator: torch.Generator) -> Verdict:
    """Accept while the target gives each proposal probability >= tau, then sample the next token
    from the target. Not exact in distribution. Shapes as `verify_top_m`."""
    b, l = draft_tokens.shape
    on_target = target_probs[:, :l].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, L]
    n = _accepted_prefix(on_target >= tau)
    next_token = sample_from_weights(_row(target_probs, n), torch.rand(b, generator=generator, device=target_probs.device))
    return Verdict(_assemble(draft_tokens, n, next_token), n)


def verify(rule: str, draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
           uniforms: torch.Tensor, generator: torch.Generator, *, groups: DeviceGroupTable | None = None,
           ssd_beta: float = 0.0, thinning_trials: int = 16, sync_free: bool | None = None) -> Verdict:
    """Dispatch to one rule. Shapes: draft_tokens [B, L], draft_probs [B, L, V],
    target_probs [B, L + 1, V], uniforms [B, L]. `sync_free` (default: off on a CPU, on elsewhere)
    keeps every shape fixed and every branch on the device, as a captured CUDA graph needs."""
    if draft_tokens.dim() != 2 or draft_probs.dim() != 3 or target_probs.dim() != 3:
        raise ValueError("expected draft_tokens [B, L], draft_probs [B, L, V], target_probs [B, L+1, V]")
    if target_probs.shape[1] != draft_tokens.shape[1] + 1:
        raise ValueError("target_probs must have one more row than there are draft tokens")
    if rule == "greedy":
        return verify_greedy(draft_tokens, target_probs)
    if rule == "sd":
        return verify_sd(draft_tokens, draft_probs, target_probs, uniforms, generator, sync_free=sync_free)
    if rule == "ssd":
        return verify_sd(draft_tokens, draft_probs, target_probs, uniforms, generator, beta=ssd_beta,
                         sync_free=sync_free)
    if rule == "pcg":
        if groups is None:
            raise ValueError("the pcg rule needs a group table")
        return verify_pcg(draft_tokens, draft_probs, target_probs, uniforms, generator, groups, thinning_trials,
                          sync_free)
    raise ValueError(f"unknown rule {rule!r}; expected one of {RULES}")
