"""Viterbi path selection over multi-token-head proposals: pure functions over tensors.

Setting (seed 004, "MTP with Viterbi speculative decoding", Algorithm 1): n heads give, in one
target pass, log-distributions S_1..S_n over the V codes of the next n positions. Heads beyond
the first never saw the tokens before their own position, so their per-position argmaxes can
disagree with each other. A first-order Markov model of codes, log Q(i, j) from
runtime/decode/transitions.py, ties neighbouring positions together, and the proposal is the path that
maximises

    score(x_1..x_n) = init(x_1) + S_1(x_1) + sum_{t=2..n} [ log Q(x_{t-1}, x_t) + S_t(x_t) ]

by max-product dynamic programming in log space (delta_t(j) = max_i [delta_{t-1}(i) + Q(i, j)]
+ S_t(j), a back-pointer per state, then back-tracking), vectorised over states; only the n
positions are a Python loop.

Candidate reduction: searching all V = 65,536 states costs O(n V^2). Like the paper, the states
are restricted to the union of every position's top-k codes, m <= k * n of them, and the
transition block is gathered for those only: O(n m^2) time, O(n m) back-pointers.

Deviation from Algorithm 1: the paper starts from delta_1 = S_1. `viterbi_propose` also scores
the step from the last emitted code, init(x_1) = log Q(prev, x_1) (pass `initial=None` to
`viterbi` for the paper's start).

Ties are broken deterministically toward lower indices: the last state is the lowest index with
the best final score, and each back-pointer the lowest predecessor index reaching its best. So
among equally scored paths the result is the smallest when compared from the last position
backwards (candidates are sorted ascending, so this is also "lowest code" at each step).

Not exact in distribution: this is a MAP search, a deterministic proposal, never a sample of the
heads' (or the target's) distribution. Its use is as the proposer of policy `mtp-viterbi`: the
heads propose, Viterbi picks the path, and the target verifies it in its next pass. What comes
out is then decided by the verification rule (runtime/decode/acceptance/): top-M / threshold
verification (the paper's setting) is not exact either; a rule that treats the proposal as a
point mass (SD with one-hot draft probabilities) keeps the target's distribution.
"""

from __future__ import annotations

import torch

from pcgtts.runtime.decode.transitions import TransitionTable


def candidate_set(head_logprobs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Union of each position's top-k codes and every position's log-prob of each of them.

    head_logprobs: [n, V] -> (cands [m] int64 ascending, unique; cand_logprobs [n, m]), m <= k n.
    """
    if head_logprobs.dim() != 2 or head_logprobs.shape[0] < 1 or head_logprobs.shape[1] < 1:
        raise ValueError(f"head_logprobs must be [n, V] with n, V >= 1, got shape {tuple(head_logprobs.shape)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    k = min(top_k, head_logprobs.shape[1])
    top = head_logprobs.topk(k, dim=-1).indices  # [n, k]
    cands = torch.unique(top.reshape(-1), sorted=True)  # [m]
    return cands, head_logprobs[:, cands]  # [m], [n, m]


def viterbi(emission: torch.Tensor, transition: torch.Tensor,
            initial: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Best state path through a lattice, max-product in log space.

    emission: [n, m] log-scores of state j at position t; transition: [m, m] log-score of
    i -> j between consecutive positions; initial: [m] added at the first position (None: 0).
    Returns (path [n] int64 state indices, score: 0-d tensor, the path's total log-score).
    Half-precision inputs are computed in float32; -inf entries are allowed (NaN is not).
    """
    if emission.dim() != 2 or emission.shape[0] < 1 or emission.shape[1] < 1:
        raise ValueError(f"emission must be [n, m] with n, m >= 1, got shape {tuple(emission.shape)}")
    n, m = emission.shape
    if transition.shape != (m, m):
        raise ValueError(f"transition must be [{m}, {m}] to match emission [{n}, {m}], got {tuple(transition.shape)}")
    if initial is not None and initial.shape != (m,):
        raise ValueError(f"initial must be [{m}], got {tuple(initial.shape)}")
    dtype = torch.promote_types(emission.dtype, transition.dtype)
    if initial is not None:
        dtype = torch.promote_types(dtype, initial.dtype)
    if not dtype.is_floating_point:
        raise ValueError(f"viterbi needs floating-point log-scores, got {dtype}")
    if dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32
    emission, transition = emission.to(dtype), transition.to(dtype)

    states = torch.arange(m, device=emission.device)
    into = transition.t().contiguous()  # [m (to j), m (from i)]: reductions run along the last dim
    delta = emission[0] if initial is None else initial.to(dtype) + emission[0]  # [m]
    pointers = []  # n - 1 tensors [m]: best predecessor of each state
    for t in range(1, n):
        scores = delta[None, :] + into  # [m (to j), m (from i)]
        best = scores.amax(dim=-1)  # [m]
        pointers.append(_lowest_where(scores == best[:, None], states, m))
        delta = best + emission[t]
    score = delta.amax()
    last = _lowest_where(delta == score, states, m)  # 0-d
    path = [last]
    for back in reversed(pointers):
        path.append(back[path[-1]])
    return torch.stack(path[::-1]), score


def _lowest_where(mask: torch.Tensor, index: torch.Tensor, fill: int) -> torch.Tensor:
    """Lowest `index` where `mask` holds along the last dim (explicit: ties never depend on a kernel)."""
    return torch.where(mask, index, fill).amin(dim=-1)


def viterbi_propose(head_logprobs: torch.Tensor, table: TransitionTable, prev_token: int | torch.Tensor,
                    top_k: int) -> torch.Tensor:
    """The n codes Viterbi picks after the already-emitted `prev_token`.

    head_logprobs: [n, V] (row t: the log-distribution for position t + 1 after prev_token);
    the path maximises log Q(prev, x_1) + S_1(x_1) + sum_t [log Q(x_{t-1}, x_t) + S_t(x_t)]
    over the candidate set. Returns tokens [n] int64 on head_logprobs' device.
    """
    if head_logprobs.dim() != 2:
        raise ValueError(f"head_logprobs must be [n, V], got shape {tuple(head_logprobs.shape)}")
    if head_logprobs.shape[1] != table.vocab_size:
        raise ValueError(f"head distributions have {head_logprobs.shape[1]} codes, "
                         f"the transition table {table.vocab_size}")
    prev = torch.as_tensor(prev_token, device=table.device).reshape(1)  # [1]; range checked by log_prob
    cands, emission = candidate_set(head_logprobs, top_k)  # [m], [n, m]
    on_table = cands.to(table.device)
    transition = table.log_prob(on_table, on_table).to(emission.device)  # [m, m]
    initial = table.log_prob(prev, on_table)[0].to(emission.device)  # [m]
    path, _ = viterbi(emission, transition, initial)  # [n]
    return cands[path]
