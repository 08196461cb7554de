"""The code-transition table (`.pct`, "pcgtts transitions"): a smoothed first-order Markov model
of speech codes, Q(i, j) = P(next code j | previous code i), estimated from training code
sequences and stored sparsely (the Viterbi proposer of runtime/decode/viterbi.py reads it).

Codes are ints in [0, V), V the restricted speech vocabulary (the stop index V - 1 is just
another code). A dense V x V matrix (16 GiB in float32 at V = 65,536) is out of the question, so
each row keeps only its K most frequent successors (K = `top_k`), plus one back-off weight.

Estimation. From a corpus with unigram counts u(j) (every code occurrence, N in all) and bigram
counts c(i, j) (adjacent pairs within a sequence, c(i) = sum_j c(i, j)):

    P_uni(j)    = (u(j) + alpha) / (N + alpha V)          additive smoothing, alpha = unigram_alpha > 0
    P_big(j|i)  = c(i, j) / c(i)                          (rows with c(i) = 0 have no bigram part)
    S_i         = the <= K successors of i with the highest c(i, j) > 0 (ties: lower j first)

    stored, j in S_i:      log Q(i, j) = log((1 - lam) P_big(j|i) + lam P_uni(j))      lam = smoothing
    back-off, j not in S_i: log Q(i, j) = b_i + log P_uni(j)
                            b_i = log(R_i / U_i),  R_i = 1 - sum_{j in S_i} Q(i, j),
                                                   U_i = sum_{j not in S_i} P_uni(j)

i.e. the mass a row did not store (the interpolated bigram mass of its unstored successors plus
lam times their unigram mass) is spread over the unstored codes in proportion to the unigram.
Normalisation: every row sums to 1 over all j in [0, V) (to float32 rounding). R_i is computed
from the *stored* (float16) values, which are rounded toward -inf, so R_i >= lam U_i > 0 and
every log Q(i, j) is finite, for every (i, j); the rounding residue (below 1e-3 of a row) moves
to the back-off entries. A row never seen as a predecessor is the unigram (S_i empty, b_i = 0).
A row that stores all V codes (tiny vocabularies only) has no back-off (b_i = 0, unused); its
entries are rounded to nearest, so it sums to 1 within float16 rounding (~1e-4).

File layout, little-endian:

    8 bytes   magic b"PCGTRN\\0" + format version (1 byte)
    4 bytes   header length H (uint32)
    H bytes   JSON header: vocab_size, top_k, smoothing, unigram_alpha, nnz, indptr_dtype
              ("int32" | "int64"), successor_dtype ("uint16" if V <= 65,536 else "int32"), stats
    arrays    indptr [V+1] | successors [nnz] (ascending within each row) | logprob float16 [nnz]
              | backoff float32 [V] | log_unigram float32 [V]
    32 bytes  sha256 of everything above

About 18 MB at V = 65,536, K = 64. `load` checks magic, version and checksum before parsing
anything, then the header, the exact length and the arrays' consistency; each failure is a
one-line `ValueError`. `save` writes a temporary file and renames it into place.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from pcgtts.groups.envelope import read_arrays, read_envelope, write_envelope

MAGIC = b"PCGTRN\0"
VERSION = 1
SUFFIX = ".pct"
DEFAULT_TOP_K = 64
DEFAULT_SMOOTHING = 0.1  # lam: weight of the unigram in the interpolation
DEFAULT_UNIGRAM_ALPHA = 1.0  # additive count on every code's unigram
_DIGEST = 32
_FIXED = len(MAGIC) + 1 + 4
_MAX_VOCAB = 2**31 - 1  # successors are int32 beyond 65,536
_CHUNK = 1 << 23  # pairs counted per merge while building
_INDPTR_DTYPES = {"int32": np.int32, "int64": np.int64}
_SUCCESSOR_DTYPES = {"uint16": np.uint16, "int32": np.int32}


@dataclass(frozen=True, eq=False)
class TransitionTable:
    """CSR rows of log Q(i, j) for the stored successors, plus the back-off vectors.

    In memory (torch, on `device`): indptr int64 [V+1], successors int32 [nnz] ascending within
    each row, logprob float16 [nnz], backoff float32 [V], log_unigram float32 [V]."""

    vocab_size: int
    top_k: int
    smoothing: float
    unigram_alpha: float
    indptr: torch.Tensor
    successors: torch.Tensor
    logprob: torch.Tensor
    backoff: torch.Tensor
    log_unigram: torch.Tensor
    stats: dict = field(default_factory=dict)

    # ----------------------------------------------------------------------------- properties
    @property
    def nnz(self) -> int:
        return int(self.successors.numel())

    @property
    def device(self) -> torch.device:
        return self.indptr.device

    @property
    def max_row_length(self) -> int:
        return int(self.stats.get("max_row_length", 0))

    @property
    def successor_dtype(self) -> np.dtype:
        """The on-disk successor id type: uint16 up to 65,536 codes, int32 beyond."""
        return np.dtype(np.uint16 if self.vocab_size <= 65536 else np.int32)

    def to(self, device) -> "TransitionTable":
        move = {k: getattr(self, k).to(device) for k in ("indptr", "successors", "logprob", "backoff", "log_unigram")}
        return replace(self, **move)

    def row(self, prev: int) -> tuple[np.ndarray, np.ndarray]:
        """Stored successors of one code and their log Q (float32), for inspection."""
        lo, hi = int(self.indptr[prev]), int(self.indptr[prev + 1])
        return self.successors[lo:hi].cpu().numpy(), self.logprob[lo:hi].float().cpu().numpy()

    # ----------------------------------------------------------------------------- building
    @classmethod
    def build(cls, sequences: Iterable[np.ndarray], vocab_size: int, top_k: int = DEFAULT_TOP_K,
              smoothing: float = DEFAULT_SMOOTHING, unigram_alpha: float = DEFAULT_UNIGRAM_ALPHA) -> "TransitionTable":
        """Count codes and adjacent pairs in `sequences` (1-D integer arrays of codes in [0, V))
        and build the smoothed table described in the module docstring."""
        vocab_size = _check_params(vocab_size, top_k, smoothing, unigram_alpha)
        unigram, keys, counts, num_sequences = _count(sequences, vocab_size)
        num_tokens = int(unigram.sum())
        if num_tokens == 0:
            raise ValueError("no codes to build a transition table from (empty data)")
        v, lam = vocab_size, float(smoothing)

        # Unigram with additive smoothing; stored as float32 and used from there on, so the
        # back-off normalises against exactly what log_prob will read.
        log_unigram = np.log((unigram + unigram_alpha) / (num_tokens + unigram_alpha * v)).astype(np.float32)
        p_uni = np.exp(log_unigram.astype(np.float64))  # [V]

        prev, nxt = keys // v, keys % v  # [D] each, sorted by (prev, nxt)
        row_total = np.bincount(prev, weights=counts, minlength=v)  # [V] c(i)
        # Rank each row's successors by count (desc), then code (asc); keep the first top_k.
        order = np.lexsort((nxt, -counts, prev))
        row_start = np.searchsorted(prev[order], np.arange(v))  # first entry of each row in `order`
        rank = np.arange(order.size) - row_start[prev[order]]
        keep = np.sort(order[rank < top_k])  # back to (prev, nxt) order: successors ascending per row
        s_prev, s_next, s_count = prev[keep], nxt[keep], counts[keep]

        indptr = np.zeros(v + 1, dtype=np.int64)
        np.cumsum(np.bincount(s_prev, minlength=v), out=indptr[1:])
        lengths = np.diff(indptr)
        exact = np.log((1.0 - lam) * s_count / row_total[s_prev] + lam * p_uni[s_next])  # [nnz] float64
        # Rows with a back-off round down (the back-off takes up the difference); a row that
        # stores every code has nowhere to put it, so it rounds to nearest.
        full = lengths[s_prev] == v
        logprob = np.where(full, exact.astype(np.float16), _round_down_f16(exact))

        stored = np.bincount(s_prev, weights=np.exp(logprob.astype(np.float64)), minlength=v)  # [V] sum_S Q
        stored_uni = np.bincount(s_prev, weights=p_uni[s_next], minlength=v)  # [V] sum_S P_uni
        remaining = np.maximum(1.0 - stored, np.finfo(np.float64).tiny)  # R_i >= lam U_i > 0
        unstored_uni = np.maximum(p_uni.sum() - stored_uni, np.finfo(np.float64).tiny)  # U_i
        backoff = np.where(lengths < v, np.log(remaining / unstored_uni), 0.0).astype(np.float32)

        stats = {
            "num_sequences": num_sequences, "num_tokens": num_tokens, "num_pairs": int(counts.sum()),
            "distinct_pairs": int(keys.size), "rows_with_successors": int((row_total > 0).sum()),
            "max_row_length": int(lengths.max()) if v else 0,
            # share of the corpus's bigrams that fall on stored entries
            "stored_pair_share": float(s_count.sum() / max(int(counts.sum()), 1)),
        }
        return cls._from_numpy(v, top_k, lam, float(unigram_alpha), indptr, s_next, logprob, backoff, log_unigram,
                               stats)

    @classmethod
    def _from_numpy(cls, vocab_size, top_k, smoothing, unigram_alpha, indptr, successors, logprob, backoff,
                    log_unigram, stats) -> "TransitionTable":
        stats = dict(stats)
        lengths = np.diff(np.asarray(indptr, dtype=np.int64))
        stats["max_row_length"] = int(lengths.max()) if lengths.size else 0
        stats["nnz"] = int(len(successors))
        return cls(int(vocab_size), int(top_k), float(smoothing), float(unigram_alpha),
                   torch.from_numpy(np.asarray(indptr, dtype=np.int64).copy()),
                   torch.from_numpy(np.asarray(successors, dtype=np.int32).copy()),
                   torch.from_numpy(np.asarray(logprob, dtype=np.float16).copy()),
                   torch.from_numpy(np.asarray(backoff, dtype=np.float32).copy()),
                   torch.from_numpy(np.asarray(log_unigram, dtype=np.float32).copy()), stats)

    # ----------------------------------------------------------------------------- lookup
    def log_prob(self, prev: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
        """Dense block of log Q: prev [m], nxt [m'] (integer codes in [0, V)) -> float32 [m, m'],
        on the table's device. Vectorised: each row's stored successors are gathered into a
        padded [m, W] block (W = longest row <= top_k) and searched for the m' codes at once."""
        prev, nxt = self._codes(prev, "prev"), self._codes(nxt, "nxt")
        m, w = prev.numel(), self.max_row_length
        backed = self.backoff[prev][:, None] + self.log_unigram[nxt][None, :]  # [m, m']
        if w == 0 or m == 0 or nxt.numel() == 0:
            return backed
        start = self.indptr[prev]  # [m]
        slot = torch.arange(w, device=prev.device)
        valid = slot < (self.indptr[prev + 1] - start)[:, None]  # [m, W]
        entry = (start[:, None] + slot).clamp_(max=self.nnz - 1)  # [m, W]
        succ = torch.where(valid, self.successors[entry].long(), self.vocab_size)  # ascending, padded with V
        pos = torch.searchsorted(succ, nxt.expand(m, -1).contiguous()).clamp_(max=w - 1)  # [m, m']
        hit = succ.gather(1, pos) == nxt[None, :]  # padding (V) never matches a code
        stored = self.logprob[entry.gather(1, pos)].float()  # [m, m']
        return torch.where(hit, stored, backed)

    def _codes(self, codes: torch.Tensor, name: str) -> torch.Tensor:
        codes = torch.as_tensor(codes, device=self.device)
        if codes.dim() != 1:
            raise ValueError(f"{name} must be a 1-D tensor of codes, got shape {tuple(codes.shape)}")
        if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
            raise ValueError(f"{name} must hold integer codes, got {codes.dtype}")
        codes = codes.long()
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.vocab_size):
            raise ValueError(f"{name} has a code outside [0, {self.vocab_size})")
        return codes

    # ----------------------------------------------------------------------------- file
    def header(self) -> dict:
        return {
            "format": "pcgtts-transitions", "version": VERSION, "vocab_size": self.vocab_size,
            "top_k": self.top_k, "smoothing": self.smoothing, "unigram_alpha": self.unigram_alpha,
            "nnz": self.nnz, "indptr_dtype": _indptr_name(self.nnz),
            "successor_dtype": self.successor_dtype.name, "stats": self.stats,
        }

    def _disk_arrays(self) -> list[np.ndarray]:
        head = self.header()
        return [self.indptr.cpu().numpy().astype(_INDPTR_DTYPES[head["indptr_dtype"]]),
                self.successors.cpu().numpy().astype(_SUCCESSOR_DTYPES[head["successor_dtype"]]),
                self.logprob.cpu().numpy().astype(np.float16),
                self.backoff.cpu().numpy().astype(np.float32),
                self.log_unigram.cpu().numpy().astype(np.float32)]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        if path.suffix != SUFFIX:
            raise ValueError(f"transition tables are saved as {SUFFIX} files, got {path.name!r}")
        return write_envelope(path, MAGIC, VERSION, self.header(), self._disk_arrays())

    @classmethod
    def load(cls, path: str | Path, expect_vocab_size: int | None = None) -> "TransitionTable":
        """Read and validate a `.pct` file; `expect_vocab_size` ties it to a model's vocabulary."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"transition table not found: {path}")
        h, data, pos = read_envelope(path, MAGIC, VERSION, "transition table")
        try:
            v, k, nnz = int(h["vocab_size"]), int(h["top_k"]), int(h["nnz"])
            lam, alpha = float(h["smoothing"]), float(h["unigram_alpha"])
            indptr_t, succ_t = _INDPTR_DTYPES[h["indptr_dtype"]], _SUCCESSOR_DTYPES[h["successor_dtype"]]
            stats = dict(h.get("stats", {}))
            _check_params(v, k, lam, alpha)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"{path}: transition table header is corrupt ({type(err).__name__}: {err})") from None
        if expect_vocab_size is not None and v != expect_vocab_size:
            raise ValueError(f"{path}: transition table covers {v} codes, the model has {expect_vocab_size}")
        sizes = [(indptr_t, v + 1), (succ_t, nnz), (np.float16, nnz), (np.float32, v), (np.float32, v)]
        arrays = read_arrays(path, data, pos, sizes, "transition table")
        indptr, succ, logprob, backoff, log_unigram = arrays
        indptr = indptr.astype(np.int64)
        lengths = np.diff(indptr)
        if indptr[0] != 0 or indptr[-1] != nnz or np.any(lengths < 0) or np.any(lengths > k):
            raise ValueError(f"{path}: inconsistent row offsets in the transition table")
        succ = succ.astype(np.int64)
        if nnz and (succ.min() < 0 or succ.max() >= v):
            raise ValueError(f"{path}: a successor lies outside the {v} codes")
        row_starts = np.zeros(nnz, dtype=bool)
        row_starts[indptr[:-1][lengths > 0]] = True
        if np.any((np.diff(succ) <= 0) & ~row_starts[1:]):
            raise ValueError(f"{path}: successors are not strictly ascending within a row")
        if not (np.all(np.isfinite(logprob)) and np.all(logprob <= 0) and np.all(np.isfinite(backoff))
                and np.all(np.isfinite(log_unigram))):
            raise ValueError(f"{path}: the transition table holds non-finite or positive log-probabilities")
        return cls._from_numpy(v, k, lam, alpha, indptr, succ, logprob, backoff, log_unigram, stats)


# --------------------------------------------------------------------------------- helpers
def _check_params(vocab_size, top_k, smoothing, unigram_alpha) -> int:
    def is_int(x):
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

    def is_real(x):
        return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)

    if not is_int(vocab_size) or not 1 <= vocab_size <= _MAX_VOCAB:
        raise ValueError(f"vocab_size must be an integer in [1, {_MAX_VOCAB}], got {vocab_size!r}")
    if not is_int(top_k) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    if not is_real(smoothing) or not 0.0 < float(smoothing) <= 1.0:
        raise ValueError(f"smoothing (the unigram interpolation weight) must be in (0, 1], got {smoothing!r}")
    if not is_real(unigram_alpha) or not 0.0 < float(unigram_alpha) < float("inf"):
        raise ValueError(f"unigram_alpha (the additive unigram count) must be positive and finite, "
                         f"got {unigram_alpha!r}")
    return int(vocab_size)


def _as_codes(seq, vocab_size: int, index: int) -> np.ndarray:
    """One sequence -> int64 [T], or a ValueError naming it."""
    arr = np.asarray(seq)
    if arr.ndim != 1:
        raise ValueError(f"sequence {index} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"sequence {index} must hold integer codes, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"sequence {index} has code {bad} outside [0, {vocab_size})")
    return arr.astype(np.int64, copy=False)


def _count(sequences: Iterable[np.ndarray], v: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Unigram counts [V] and the distinct pair keys prev * V + next (sorted) with their counts,
    merged every _CHUNK pairs so memory follows the number of distinct pairs, not the corpus."""
    if isinstance(sequences, (np.ndarray, torch.Tensor)) and sequences.ndim == 1:
        raise ValueError("sequences must be an iterable of 1-D code arrays, got a single 1-D array")
    unigram = np.zeros(v, dtype=np.int64)
    keys, counts = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    codes, pairs, pending = [], [], 0
    num_sequences = -1

    def flush():
        nonlocal keys, counts, unigram
        if codes:
            unigram += np.bincount(np.concatenate(codes), minlength=v)
        if pairs:
            both = np.concatenate([keys, *pairs])
            weights = np.concatenate([counts, np.ones(both.size - keys.size, dtype=np.int64)])
            keys, inverse = np.unique(both, return_inverse=True)
            counts = np.bincount(inverse.reshape(-1), weights=weights, minlength=keys.size).astype(np.int64)
        codes.clear()
        pairs.clear()

    for num_sequences, seq in enumerate(sequences):
        arr = _as_codes(seq, v, num_sequences)
        codes.append(arr)
        if arr.size > 1:
            pairs.append(arr[:-1] * v + arr[1:])
        pending += arr.size
        if pending >= _CHUNK:
            flush()
            pending = 0
    flush()
    return unigram, keys, counts, num_sequences + 1


def _round_down_f16(x: np.ndarray) -> np.ndarray:
    """float64 -> the largest float16 <= x (so stored probabilities never exceed the exact ones)."""
    h = x.astype(np.float16)
    up = h.astype(np.float64) > x
    h[up] = np.nextafter(h[up], np.float16(-np.inf))
    return h


def _indptr_name(nnz: int) -> str:
    return "int32" if nnz < 2**31 else "int64"
