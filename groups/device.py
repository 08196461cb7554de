"""Acoustic Similarity Groups as tensors on the device the acceptance rules run on.

Two CSR tables over the speech tokens (restricted indices 0 .. num_tokens-1):

    group -> members:  group_members[group_offsets[k] : group_offsets[k+1]]   (token ids)
    token -> groups:   token_groups[token_offsets[t] : token_offsets[t+1]]     (group ids, S(t))

Ids are kept 16-bit on the device (65,536 tokens and at most 65,536 groups fit exactly). torch
has no indexable uint16, so they are stored as int16 holding the uint16 bit pattern and widened
with `widen()` right before use. Offsets are int32.

The stop token (restricted index `num_tokens`) is not in the table: the acceptance rules treat
it as its own singleton group with id `num_groups` (see runtime/decode/acceptance/), reached
through `DeviceGroupTable.spans` (int64 start/size lookups with the stop folded in, built once
per table on first use) so that the rules need no per-call special case for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np
import torch


def widen(ids16: torch.Tensor) -> torch.Tensor:
    """int16 tensor holding uint16 bit patterns -> int64 ids in [0, 65535]."""
    return ids16.to(torch.int64) & 0xFFFF


def narrow(ids: np.ndarray | torch.Tensor) -> torch.Tensor:
    """ids in [0, 65535] -> int16 tensor holding their uint16 bit patterns."""
    arr = np.asarray(ids, dtype=np.uint16)
    return torch.from_numpy(arr.view(np.int16).copy())


def token_major(group_offsets: np.ndarray, members: np.ndarray, num_tokens: int):
    """Transpose group -> members CSR into token -> groups.

    group_offsets: int64 [num_groups + 1]; members: int64 [nnz]. Returns int64 arrays
    (token_offsets [num_tokens + 1], token_groups [nnz] with group ids ascending within a
    token, groups_per_token [num_tokens]).
    """
    num_groups = len(group_offsets) - 1
    if num_groups > 65536 or num_tokens > 65536:
        raise ValueError("16-bit group tables hold at most 65,536 tokens and 65,536 groups")
    group_of_entry = np.repeat(np.arange(num_groups, dtype=np.int64), np.diff(group_offsets))
    order = np.argsort(members, kind="stable")  # entries are group-major, so groups stay ascending
    counts = np.bincount(members, minlength=num_tokens)
    token_offsets = np.concatenate([[0], np.cumsum(counts)])
    return token_offsets, group_of_entry[order], counts


@dataclass(frozen=True)
class Spans:
    """int64 lookups over both CSR tables with the stop token folded in: token `num_tokens` is the
    one member of group `num_groups`. Neither id fits the 16-bit arrays, so the stop's span points
    at entry 0 and a per-row `shift` added to the widened entry turns it into the stop's id (the
    shift is 0 for every other row). ~3 MB for 65,536 tokens and groups."""

    token: torch.Tensor  # int64 [num_tokens + 1, 2]: (first entry in token_groups, |S(t)|); the stop: (0, 1)
    token_shift: torch.Tensor  # int64 [num_tokens + 1]: + widen(token_groups[entry]) = the group id
    group: torch.Tensor  # int64 [num_groups + 1, 2]: (first entry in group_members, size); the stop's: (0, 1)
    member_shift: torch.Tensor  # int64 [num_groups + 1]: + widen(group_members[entry]) = the token id


@dataclass(frozen=True)
class HostSpans:
    """NumPy views (no copies) of a CPU table's `Spans`, its 16-bit entries read as uint16 and its
    1/N(t): what the one-sequence CPU rules index (`runtime/decode/acceptance/host.py`), where a
    NumPy index costs a fraction of a torch op's fixed overhead."""

    token: np.ndarray  # int64 [num_tokens + 1, 2]
    token_shift: np.ndarray  # int64 [num_tokens + 1]
    token_groups: np.ndarray  # uint16 [nnz]
    group: np.ndarray  # int64 [num_groups + 1, 2]
    member_shift: np.ndarray  # int64 [num_groups + 1]
    group_members: np.ndarray  # uint16 [nnz]
    inv_n: np.ndarray  # float32 [num_tokens + 1]


@dataclass(frozen=True)
class DeviceGroupTable:
    group_offsets: torch.Tensor  # int32 [num_groups + 1]
    group_members: torch.Tensor  # int16 [nnz] (uint16 token ids)
    token_offsets: torch.Tensor  # int32 [num_tokens + 1]
    token_groups: torch.Tensor  # int16 [nnz] (uint16 group ids)
    num_tokens: int
    num_groups: int
    max_group_size: int  # longest member list: fixed gather width for P_c / Q_c
    max_groups_per_token: int  # largest |S(t)|
    inv_groups_per_token: torch.Tensor  # float32 [num_tokens + 1]: 1/N(t), and 1 for the stop token

    @property
    def device(self) -> torch.device:
        return self.group_members.device

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.group_offsets, self.group_members, self.token_offsets, self.token_groups)
        )

    @cached_property
    def spans(self) -> Spans:
        """The stop-folded int64 lookups the acceptance rules gather through (made on first use)."""
        def folded(offsets: torch.Tensor, entries: torch.Tensor, stop_id: int) -> tuple[torch.Tensor, torch.Tensor]:
            start = offsets.long()
            span = torch.stack([start[:-1], start[1:] - start[:-1]], dim=1)
            span = torch.cat([span, span.new_tensor([[0, 1]])])
            shift = torch.zeros(len(span), dtype=torch.int64, device=offsets.device)
            shift[-1] = stop_id - widen(entries[:1])[0]
            return span, shift

        token, token_shift = folded(self.token_offsets, self.token_groups, self.num_groups)
        group, member_shift = folded(self.group_offsets, self.group_members, self.num_tokens)
        return Spans(token, token_shift, group, member_shift)

    @cached_property
    def host(self) -> HostSpans:
        """`spans` and the entries as NumPy views (a table on the CPU only)."""
        if self.device.type != "cpu":
            raise ValueError(f"host views need a table on the CPU, this one is on {self.device}")
        s = self.spans
        return HostSpans(s.token.numpy(), s.token_shift.numpy(), self.token_groups.numpy().view(np.uint16),
                         s.group.numpy(), s.member_shift.numpy(), self.group_members.numpy().view(np.uint16),
                         self.inv_groups_per_token.numpy())

    def groups_per_token(self) -> torch.Tensor:
        """N(t) = |S(t)| for every speech token. int32 [num_tokens]"""
        return self.token_offsets[1:] - self.token_offsets[:-1]

    def to(self, device: torch.device | str) -> "DeviceGroupTable":
        move = lambda t: t.to(device)  # noqa: E731
        return DeviceGroupTable(
            move(self.group_offsets), move(self.group_members), move(self.token_offsets),
            move(self.token_groups), self.num_tokens, self.num_groups,
            self.max_group_size, self.max_groups_per_token, move(self.inv_groups_per_token),
        )

    @classmethod
    def from_csr(
        cls,
        group_offsets: np.ndarray,  # uint32/int [num_groups + 1]
        group_members: np.ndarray,  # uint16/int [nnz]
        num_tokens: int,
        device: torch.device | str = "cpu",
    ) -> "DeviceGroupTable":
        """Build both directions from the group -> members CSR (the token -> groups side is derived)."""
        group_offsets = np.asarray(group_offsets, dtype=np.int64)
        members = np.asarray(group_members, dtype=np.int64)
        sizes = np.diff(group_offsets)
        if (sizes <= 0).any():
            raise ValueError("every group must have at least one member")
        if members.size and (members.min() < 0 or members.max() >= num_tokens):
            raise ValueError("group member outside the speech vocabulary")
        token_offsets, token_groups, counts = token_major(group_offsets, members, num_tokens)
        if (counts == 0).any():
            raise ValueError(f"{int((counts == 0).sum())} speech tokens belong to no group")
        return cls(
            group_offsets=torch.from_numpy(group_offsets.astype(np.int32)).to(device),
            group_members=narrow(members).to(device),
            token_offsets=torch.from_numpy(token_offsets.astype(np.int32)).to(device),
            token_groups=narrow(token_groups).to(device),
            num_tokens=num_tokens,
            num_groups=len(sizes),
            max_group_size=int(sizes.max()),
            max_groups_per_token=int(counts.max()),
            inv_groups_per_token=torch.from_numpy(np.concatenate([1.0 / counts, [1.0]]).astype(np.float32)).to(device),
        )

    @classmethod
    def from_groups(
        cls, groups: Sequence[Sequence[int]], num_tokens: int, device: torch.device | str = "cpu"
    ) -> "DeviceGroupTable":
        """From explicit member lists (tests, small vocabularies)."""
        offsets = np.concatenate([[0], np.cumsum([len(g) for g in groups])])
        members = np.concatenate([np.asarray(sorted(g), dtype=np.int64) for g in groups])
        return cls.from_csr(offsets, members, num_tokens, device)

    @classmethod
    def singletons(cls, num_tokens: int, device: torch.device | str = "cpu") -> "DeviceGroupTable":
        """Every token its own group: PCG then reduces to standard speculative sampling."""
        return cls.from_csr(np.arange(num_tokens + 1), np.arange(num_tokens), num_tokens, device)
