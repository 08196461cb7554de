"""A cheap speech head for a draft's proposals on a target whose head is large and dense.

A released LLaSA's speech head is a dense [65,536, D] matrix: on a CPU, reading it costs a tenth of
a 1B target's step, and an EAGLE draft that reads it for every proposal spends more on the head than
on its own block. Any draft distribution keeps the speculative rules exact (they read the
distribution each proposal was drawn from), so a draft may propose from a cheaper one:

    preview = U (Vᵀ f)           a rank-r factor of the head (W ≈ U Vᵀ, a truncated SVD of W)
    C       = top-c of preview   the candidate tokens
    scores  = W[C] f on C        the head's own rows for the candidates; -inf everywhere else

The low-rank preview only has to find the tokens that matter; their scores are the head's exact
ones (SVD-softmax, Shim et al., NeurIPS 2017). The preview is read as int8 (it only ranks). On the
1B-shape stand-in (rank 64, 1,024 candidates) the proposals' distribution keeps ~98 % of its
overlap with the full head's, Σ min(p, q), for a twentieth of the head's bytes. The factor is computed from the weights alone when a proposer is
built (a seeded randomised SVD: the same factor on every load), so it needs no data and no file.

The rows are the head's own: float32, or the int8 codes and per-row scales of an int8 head
(`int8.Int8Linear` keeps them for this), whose candidates are scored as that head scores them
(the state on a 127-step grid, integer products).
"""

from __future__ import annotations

import logging
import time
import weakref

import torch
from torch import nn

from pcgtts.runtime.lm.int8 import LEVELS, Int8Linear, on_grid, quantize_rows, row_maxima
from pcgtts.runtime.lm.llama import Llama

log = logging.getLogger(__name__)

RANK = 64  # the preview's rank
CANDIDATES = 1024  # tokens scored exactly per proposal
MIN_HEAD_SIZE = 1 << 25  # rows x width from which a dense head is worth replacing (65,536 x 512)


class ProposalHead:
    """`head(f [D]) -> scores [rows]` (float32, -inf outside the candidates) for a dense head's
    `rows` [rows, D] (float32, or int8 with `row_scales` [rows])."""

    def __init__(self, rows: torch.Tensor, row_scales: torch.Tensor | None = None, rank: int = RANK,
                 candidates: int = CANDIDATES, seed: int = 0):
        if rows.dim() != 2 or (rows.dtype == torch.int8) != (row_scales is not None):
            raise ValueError("a proposal head takes float rows, or int8 rows with their scales")
        self.rows, self.row_scales = rows, row_scales
        self.candidates = min(candidates, len(rows))
        weight = rows.float() * row_scales[:, None] if row_scales is not None else rows.float()
        rank = min(rank, *weight.shape)
        with torch.random.fork_rng(devices=[]):  # a seeded factor: the same proposals on every load
            torch.manual_seed(seed)
            u, s, v = torch.svd_lowrank(weight, q=rank, niter=2)
        self.down = v.T.contiguous()  # [r, D]
        self.up, self.up_scales = quantize_rows(u * s)  # [rows, r] read as int8: a quarter of the bytes; it only ranks

    @staticmethod
    def worth_it(rows: int, width: int) -> bool:
        """Whether a dense head of this size costs enough per proposal to replace."""
        return rows * width >= MIN_HEAD_SIZE

    def __call__(self, f: torch.Tensor) -> torch.Tensor:
        """f [D] -> scores [rows]; f [n, D] (several drafts' rows, a batch's) -> [n, rows], each row as
        alone. Every step runs once for all n rows: a batch's proposal costs less than n of them."""
        states = f.float().reshape(-1, f.shape[-1])  # [n, D]
        n, width = states.shape
        previews = _int8_products(self.up, states @ self.down.T)[0].T.float() * self.up_scales  # [n, rows]
        chosen = previews.topk(self.candidates, sorted=False).indices  # [n, c]
        rows = self.rows.index_select(0, chosen.view(-1))  # [n c, D]; index_select: ~7x faster than rows[chosen]
        if self.row_scales is None:
            exact = torch.bmm(rows.view(n, -1, width), states.to(rows.dtype)[:, :, None])[:, :, 0].float()
        else:  # as an int8 head computes them: f on a 127-step grid, integer products (`int8.Int8Linear`)
            products, maxima = _int8_products(rows, states)  # [n c, n]: row i's candidates against state i
            own = products.view(n, -1, n).diagonal(dim1=0, dim2=2).T  # [n, c]
            exact = own.float() * self.row_scales.index_select(0, chosen.view(-1)).view(n, -1) * (maxima / LEVELS)
        scores = previews.new_full(previews.shape, float("-inf")).scatter_(1, chosen, exact)
        return scores[0] if f.dim() == 1 else scores


def _int8_products(rows: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [m, k] int8 times each of x [k] or [n, k] put on a 127-step grid (`int8.on_grid`) ->
    (int32 [m, n], max |x| [n, 1] or [1])."""
    maximum = row_maxima(x)
    codes = on_grid(x, maximum).to(torch.int8).reshape(-1, x.shape[-1])  # [n, k]
    n = len(codes)
    columns = torch.zeros(x.shape[-1], max(8, -(-n // 8) * 8), dtype=torch.int8)  # 8 columns: _int_mm's minimum
    columns[:, :n] = codes.T
    return torch._int_mm(rows, columns)[:, :n], maximum


_MADE: "weakref.WeakKeyDictionary[Llama, ProposalHead]" = weakref.WeakKeyDictionary()  # one per loaded target


def proposal_head_for(model: Llama) -> ProposalHead | None:
    """The cheap proposal head of `model`'s speech head (made once per model), or None where the
    head is a digit table, small enough to read whole, or on a GPU (which reads a 1B head in tens
    of microseconds: nothing to save)."""
    head = model.head
    if model.digits or model.embed_tokens.weight.device.type != "cpu" or not ProposalHead.worth_it(
            head.out_features, head.in_features):
        return None
    if model not in _MADE:
        start = time.perf_counter()
        if isinstance(head, Int8Linear):
            _MADE[model] = ProposalHead(head.rows, head.row_scales, RANK, CANDIDATES)
        elif isinstance(head, nn.Linear) and head.bias is None:
            _MADE[model] = ProposalHead(head.weight.detach(), None, RANK, CANDIDATES)
        else:
            return None
        log.info("proposal head for a %d x %d speech head: rank %d, %d candidates (%.1f s)", head.out_features,
                 head.in_features, RANK, CANDIDATES, time.perf_counter() - start)
    return _MADE[model]


__all__ = ["ProposalHead", "RANK", "CANDIDATES", "proposal_head_for"]
