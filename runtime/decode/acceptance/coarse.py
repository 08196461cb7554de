"""Coarse-graining by Acoustic Similarity Groups: the group arithmetic every PCG form shares.

PCG (Yanuka et al., Algorithm 1, equal-split weights) reads a group table through three operations,
defined here once and used by the batched tensor rules (`tensor.py`), the one-sequence host lane
(`host.py`, NumPy arrays of the same table), the compiled graph (`compiled.py`, traced from these
very functions) and training (`CoarseMasses`, the differentiable all-groups masses):

  pick_group      K uniform over S(t) = {k : t in G_k} for a token t (the stop token is its own
                  group, id = num_groups), from one float64 uniform per token;
  group_members   the member lists of groups, padded to a width (padding repeats the last member
                  and is marked invalid), so P_c(K) = sum over members of p(t) / N(t);
  masses          P_c and Q_c of given groups under two distributions (`CoarseView.masses`), or of
                  every group at once (`CoarseView.all_masses`, float64: the exact residual's).

`pick_group` and `group_members` take the table's arrays as they are stored (16-bit entries read
as unsigned) and work on torch tensors and NumPy arrays alike.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np
import torch

from pcgtts.groups.device import DeviceGroupTable, widen
from pcgtts.runtime.decode.sampling import sample_from_weights


def _int64(x):
    return x.long() if isinstance(x, torch.Tensor) else np.asarray(x).astype(np.int64)


def _minimum(a, b):
    return torch.minimum(a, b) if isinstance(a, torch.Tensor) else np.minimum(a, b)


def pick_group(token_span, token_shift, token_groups, tokens, uniforms):
    """K uniform over S(t) for each token (any shape): token_span [V + 1, 2] (first entry, count),
    token_shift [V + 1], token_groups [nnz] (16-bit), uniforms in [0, 1) of the tokens' shape."""
    span = token_span[tokens]
    entry = span[..., 0] + _int64(uniforms * span[..., 1])
    return (_int64(token_groups[entry]) & 0xFFFF) + token_shift[tokens]


def group_members(group_span, member_shift, members16, groups, slots):
    """Member lists of groups [...] padded to len(slots) (slots = 0 .. W - 1): (tokens [..., W],
    valid [..., W]). group_span [G + 1, 2] (first entry, size), member_shift [G + 1], members16 [nnz]."""
    span = group_span[groups]
    start, last = span[..., :1], span[..., 1:] - 1
    entry = start + _minimum(slots, last)  # padding repeats the last member (the stop's shift fits it)
    return (_int64(members16[entry]) & 0xFFFF) + member_shift[groups][..., None], slots <= last


def uniforms64(batch: int, length: int, generator: torch.Generator, device) -> torch.Tensor:
    """Float64 uniforms [batch, length]: u * |S(t)| never rounds up to |S(t)| (float32 can)."""
    return torch.rand(batch, length, generator=generator, device=device, dtype=torch.float64)


class CoarseView(NamedTuple):
    """A group table seen from the restricted vocabulary (speech tokens + the stop token)."""

    table: DeviceGroupTable
    inv_n: torch.Tensor  # [V] float: 1 / N(t); the stop token is in exactly one group (id table.num_groups)

    def pick(self, tokens: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """`pick_group` over this table; uniforms must be float64."""
        if uniforms.dtype != torch.float64:  # float32 u * |S(t)| can round up to |S(t)|: the next token's group
            raise TypeError(f"group picks need float64 uniforms, got {uniforms.dtype}")
        t, spans = self.table, self.table.spans
        return pick_group(spans.token, spans.token_shift, t.token_groups, tokens, uniforms)

    def members(self, group: torch.Tensor, sync_free: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`group_members` of groups [...]. The width is the table's largest group size with
        `sync_free` (a fixed shape); otherwise the host reads the largest of these groups (about
        half the table's maximum on the trained voice)."""
        t, spans = self.table, self.table.spans
        width = t.max_group_size if sync_free or not group.numel() else int(spans.group[group][..., 1].max())
        slots = torch.arange(width, device=group.device)
        return group_members(spans.group, spans.member_shift, t.group_members, group, slots)

    def masses(self, first: torch.Tensor, second: torch.Tensor, group: torch.Tensor,
               sync_free: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(P_c, Q_c) of `group` under two distributions, gathering only the groups' members.
        first, second: [B, R, V] (or [B, V]); group: [B, R, ...] of the same leading dims -> two [B, R, ...]."""
        members, valid = self.members(group, sync_free)
        weights = self.inv_n[members] * valid  # 1/N(t) on members, 0 on padding
        flat = members.reshape(*first.shape[:-1], -1)
        shape = members.shape
        p = (first.gather(-1, flat).view(shape) * weights).sum(-1)
        q = (second.gather(-1, flat).view(shape) * weights).sum(-1)
        return p, q

    def all_masses(self, probs: torch.Tensor) -> torch.Tensor:
        """P_c for every group (stop group last): probs [B, V] -> [B, M + 1], float64.

        Differences of a float64 cumulative sum over the group-major member list: no per-entry
        group index (8 bytes per table entry), exact enough for masses down to ~1e-15."""
        t = self.table
        scaled = (probs * self.inv_n).double()
        entries = scaled[:, widen(t.group_members)]  # [B, nnz]
        cdf = torch.nn.functional.pad(entries.cumsum(-1), (1, 0))
        offsets = t.group_offsets.long()
        masses = cdf[:, offsets[1:]] - cdf[:, offsets[:-1]]
        return torch.cat([masses, scaled[:, -1:]], dim=1)


def coarse_view(groups: DeviceGroupTable, vocab_size: int) -> CoarseView:
    """The table over distributions of `vocab_size` entries (its speech tokens + stop), checked."""
    if vocab_size != groups.num_tokens + 1:
        raise ValueError(f"group table covers {groups.num_tokens} speech tokens but the distributions have "
                         f"{vocab_size} entries (expected speech tokens + stop)")
    return CoarseView(groups, groups.inv_groups_per_token)


def exact_residual_group(view: CoarseView, draft_row: torch.Tensor, target_row: torch.Tensor,
                         generator: torch.Generator) -> torch.Tensor:
    """K ~ normalised [Q_c - P_c]_+ computed over every group. [B, V] x 2 -> [B]"""
    q_all = view.all_masses(target_row)
    residual = (q_all - view.all_masses(draft_row)).clamp_min(0)
    # An all-zero residual means Q_c == P_c, where no rejection can happen; fall back to Q_c.
    residual = torch.where(residual.sum(-1, keepdim=True) <= 0, q_all, residual)
    return sample_from_weights(residual, torch.rand(residual.shape[0], generator=generator, device=residual.device))


def token_in_group(view: CoarseView, target_row: torch.Tensor, group: torch.Tensor,
                   generator: torch.Generator, sync_free: bool = False) -> torch.Tensor:
    """t in G_K with probability proportional to target(t)/N(t). target_row [B, V], group [B] -> [B]."""
    members, valid = view.members(group, sync_free)
    weights = target_row.gather(1, members) * view.inv_n[members] * valid
    pick = sample_from_weights(weights, torch.rand(group.shape[0], generator=generator, device=group.device))
    return members.gather(1, pick[:, None]).squeeze(1)


class CoarseMasses:
    """P_c(k) = sum_{t in G_k} p(t) / N(t) for rows of p as one sparse [groups, V] product in float32:
    differentiable and fast enough to train on (`CoarseView.all_masses` is the rule's float64 form,
    ~0.2 s a row against ~15 ms for a training step's forward and backward)."""

    def __init__(self, view: CoarseView):
        table = view.table
        members = widen(table.group_members)
        self.inv_n = view.inv_n.float()
        with warnings.catch_warnings():  # "sparse CSR support is in beta": products by a dense matrix are what we use
            warnings.simplefilter("ignore", UserWarning)
            self.members = torch.sparse_csr_tensor(table.group_offsets.long(), members,
                                                   torch.ones(len(members), device=members.device),
                                                   size=(table.num_groups, len(self.inv_n)), check_invariants=True)

    @classmethod
    def load(cls, path, vocab, fingerprint: str, device) -> "CoarseMasses":
        """The masses of the .pcg table at `path`, checked to be this target's (`vocab`, `fingerprint`)."""
        from pcgtts.groups.table import GroupTable

        table = GroupTable.load(path, expect_vocab=vocab, expect_fingerprint=fingerprint)
        return cls(coarse_view(table.to_device(device), vocab.restricted_size))

    def __call__(self, probs: torch.Tensor) -> torch.Tensor:
        """probs [R, V] -> P_c [R, M + 1] (the stop token's own group last)."""
        scaled = probs.float() * self.inv_n
        return torch.cat([(self.members @ scaled.T).T, scaled[:, -1:]], dim=1)
