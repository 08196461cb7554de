"""Building Acoustic Similarity Groups from the target model's speech-token embeddings.

    G(t) = {t' : cos(E[t], E[t']) > theta}         (t itself always included)

optionally capped to t's `top_k` most similar tokens, then identical sets merged, so the
table holds M <= N distinct groups. Similarities are computed in row blocks (the full
65,536 x 65,536 matrix would take 16 GB), on CPU or GPU, keeping only the entries above
theta; memory is one block plus the output, and the output grows with the mean group size:
`estimate_groups` predicts it from a sample of rows before anything is built, `build_groups`
refuses (with the estimate and the fix) past `max_bytes`, and `theta_for_mean_size` picks
theta for a target mean group size (the paper's tables average ~140 members).
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
    for start in tqdm(range(0, n, step), desc="groups", unit="block",
                      disable=None if progress else True):  # a bar on a terminal only
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


BYTES_PER_ENTRY = 48  # peak while building: int64 rows + cols, their mirror, the sort order and merge keys


def _sample_similarities(embeddings: torch.Tensor, sample_rows: int, seed: int = 0) -> torch.Tensor:
    """Cosine similarities of `sample_rows` random rows to every row: [S, N], each row sorted descending."""
    n = embeddings.shape[0]
    unit = torch.nn.functional.normalize(embeddings.float(), dim=1)
    rows = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: min(sample_rows, n)]
    sims = unit[rows] @ unit.T
    sims[torch.arange(len(rows)), rows] = float("inf")  # t in G(t)
    return sims.sort(dim=1, descending=True).values


def _mean_size(sorted_sims: torch.Tensor, theta: float, top_k: int | None) -> float:
    counts = (sorted_sims > theta).sum(1)
    if top_k is not None:
        counts = counts.clamp(max=top_k)
    return float(counts.float().mean())


def estimate_groups(embeddings: torch.Tensor, theta: float, top_k: int | None = None,
                    sample_rows: int = 256) -> dict:
    """Predicted mean group size, table entries and peak build memory, from a sample of rows."""
    mean = _mean_size(_sample_similarities(embeddings, sample_rows), theta, top_k)
    entries = int(round(mean * embeddings.shape[0]))
    return {"theta": theta, "top_k": top_k, "mean_group_size": mean, "entries": entries,
            "build_bytes": entries * BYTES_PER_ENTRY, "sample_rows": min(sample_rows, embeddings.shape[0])}


def theta_for_mean_size(embeddings: torch.Tensor, mean_size: float, top_k: int | None = None,
                        sample_rows: int = 256) -> float:
    """The theta whose groups average `mean_size` members (estimated on sampled rows; bisection)."""
    if mean_size < 1:
        raise ValueError(f"mean group size must be >= 1, got {mean_size}")
    if top_k is not None and mean_size > top_k:
        raise ValueError(f"mean group size {mean_size} cannot exceed the cap top_k={top_k}")
    sims = _sample_similarities(embeddings, sample_rows)
    low, high = -1.0, 1.0 - 1e-6  # mean size decreases in theta: >= mean at low, < at high
    for _ in range(40):
        mid = (low + high) / 2
        if _mean_size(sims, mid, top_k) >= mean_size:
            low = mid
        else:
            high = mid
    return round(low, 4)


def build_groups(embeddings: torch.Tensor, theta: float, top_k: int | None = None, device="cpu",
                 block_rows: int | None = None, progress: bool = True, max_bytes: int | None = None) -> GroupTable:
    """Distinct ASGs of the speech tokens from their embedding rows [N, H].

    With `max_bytes`, the table is estimated first and a ValueError (with the estimate and the
    fix) is raised instead of building one whose build would need more memory."""
    if max_bytes is not None:
        est = estimate_groups(embeddings, theta, top_k)
        log.info("group table estimate: %s", json.dumps(est))
        if est["build_bytes"] > max_bytes:
            raise ValueError(
                f"theta={theta:g}{'' if top_k is None else f', top_k={top_k}'} would make groups of "
                f"~{est['mean_group_size']:.0f} members on average ({est['entries']:,} entries, "
                f"~{est['build_bytes'] / 2**20:,.0f} MiB to build; budget {max_bytes / 2**20:,.0f} MiB): "
                f"raise theta, cap the groups (--top-k), or choose theta by size (--mean-size 140)")
    offsets, members = neighbour_lists(embeddings, theta, top_k, device, block_rows, progress)
    group_offsets, group_members = merge_identical(offsets, members)
    table = GroupTable.from_groups_csr(group_offsets, group_members, embeddings.shape[0], theta, top_k)
    log.info("groups at theta=%.3f: %s", theta, json.dumps(table.stats))
    return table
