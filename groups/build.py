"""Building Acoustic Similarity Groups from the target model's speech-token embeddings.

    G(t) = {t' : cos(E[t], E[t']) > theta}         (t itself always included)

optionally capped to t's `top_k` most similar tokens, then identical sets merged, so the
table holds M <= N distinct groups. Similarities are computed in row blocks (the full
65,536 x 65,536 matrix would take 16 GB), on CPU or GPU, keeping only the entries above
theta; memory stays bounded by one block plus the output.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import torch

from pcgtts.groups.table import GroupTable

log = logging.getLogger(__name__)


def embedding_fingerprint(rows: torch.Tensor) -> str:
    """sha256 of the rows rounded to bfloat16, so fp32 and bf16 loads of one checkpoint agree."""
    data = rows.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy()
    return hashlib.sha256(f"{tuple(rows.shape)}".encode() + data.tobytes()).hexdigest()


def _block_rows(num_tokens: int, device: torch.device) -> int:
    # ~256 MB of float32 similarities per block on CPU, 1 GB on a GPU.
    budget = (1 << 28) if device.type == "cpu" else (1 << 30)
    return max(1, min(num_tokens, budget // (4 * num_tokens)))


def neighbour_lists(embeddings: torch.Tensor, theta: float, top_k: int | None = None, device="cpu",
                    block_rows: int | None = None, progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """G(t) for every t, unmerged, as CSR (offsets int64 [N + 1], members int64 sorted per row)."""
    from tqdm.auto import tqdm

    if embeddings.dim() != 2 or embeddings.shape[0] == 0:
        raise ValueError(f"expected a non-empty [N, H] embedding matrix, got {tuple(embeddings.shape)}")
    if not -1.0 <= theta < 1.0:
        raise ValueError(f"theta must lie in [-1, 1), got {theta}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    device = torch.device(device)
    n = embeddings.shape[0]
    unit = torch.nn.functional.normalize(embeddings.to(device, torch.float32), dim=1)
    step = block_rows or _block_rows(n, device)
    capped = top_k is not None and top_k < n
    rows_out, cols_out = [], []
    for start in tqdm(range(0, n, step), desc="groups", unit="block", disable=not progress):
        stop = min(n, start + step)
        # Cosine is symmetric: without a top-k cap only the upper triangle (columns >= start)
        # is computed and the pairs are mirrored below, halving the matrix products.
        first_col = 0 if capped else start
        sims = unit[start:stop] @ unit[first_col:].T  # [b, N - first_col]
        local = torch.arange(stop - start, device=device)
        sims[local, local + start - first_col] = float("inf")  # t in G(t) whatever rounding does
        if capped:
            values, cols = sims.topk(top_k, dim=1)
            keep = values > theta
            rows = local[:, None].expand_as(cols)[keep]
            cols = cols[keep]
        else:
            rows, cols = (sims > theta).nonzero().unbind(1)
            upper = cols + first_col >= rows + start  # the diagonal block's lower half comes from mirroring
            rows, cols = rows[upper], cols[upper]
        rows_out.append((rows + start).cpu())
        cols_out.append((cols + first_col).cpu())
    rows = torch.cat(rows_out).numpy().astype(np.int64)
    cols = torch.cat(cols_out).numpy().astype(np.int64)
    if not capped:
        off_diag = rows != cols
        rows, cols = np.concatenate([rows, cols[off_diag]]), np.concatenate([cols, rows[off_diag]])
    order = np.lexsort((cols, rows))
    counts = np.bincount(rows, minlength=n)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), cols[order]


def merge_identical(offsets: np.ndarray, members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keep one copy of each distinct member list (in order of first appearance)."""
    n = len(offsets) - 1
    sizes = np.diff(offsets)
    rng = np.random.default_rng(0x5EED)
    # Two independent multiplicative hashes of the sorted member list, plus its size.
    keys = []
    for _ in range(2):
        weights = rng.integers(1, 2**61, size=max(int(members.max()) + 1, 1), dtype=np.uint64) | np.uint64(1)
        h = weights[members] * (members.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15))
        keys.append(np.add.reduceat(h, offsets[:-1]) if len(members) else np.zeros(n, np.uint64))
    table = np.stack([sizes.astype(np.uint64), keys[0], keys[1]], 1)
    _, first, inverse = np.unique(table, axis=0, return_index=True, return_inverse=True)
    rep = first[inverse.reshape(-1)]
    # Verify hash matches exactly; a (vanishingly rare) collision keeps both lists.
    dup = rep != np.arange(n)
    if dup.any():
        rows = np.nonzero(dup)[0]
        lens = sizes[rows]
        a = np.repeat(offsets[rows], lens) + _ranges(lens)
        b = np.repeat(offsets[rep[rows]], lens) + _ranges(lens)
        differs = np.add.reduceat((members[a] != members[b]).astype(np.int64), np.concatenate([[0], np.cumsum(lens)[:-1]]))
        rep[rows[differs > 0]] = rows[differs > 0]
    keep = np.nonzero(rep == np.arange(n))[0]
    new_sizes = sizes[keep]
    new_offsets = np.concatenate([[0], np.cumsum(new_sizes)])
    new_members = members[np.repeat(offsets[keep], new_sizes) + _ranges(new_sizes)]
    return new_offsets, new_members


def _ranges(lengths: np.ndarray) -> np.ndarray:
    """[0..l0), [0..l1), ... concatenated."""
    total = int(lengths.sum())
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total) - starts


def build_groups(embeddings: torch.Tensor, theta: float, top_k: int | None = None, device="cpu",
                 block_rows: int | None = None, progress: bool = True) -> GroupTable:
    """Distinct ASGs of the speech tokens from their embedding rows [N, H]."""
    offsets, members = neighbour_lists(embeddings, theta, top_k, device, block_rows, progress)
    group_offsets, group_members = merge_identical(offsets, members)
    table = GroupTable.from_groups_csr(group_offsets, group_members, embeddings.shape[0], theta, top_k)
    log.info("groups at theta=%.3f: %s", theta, json.dumps(table.stats))
    return table
