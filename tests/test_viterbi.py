"""Viterbi proposals (runtime/decode/viterbi.py) and the code-transition table (runtime/decode/transitions.py)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from pcgtts.runtime.decode.transitions import MAGIC, TransitionTable
from pcgtts.runtime.decode.viterbi import candidate_set, viterbi, viterbi_propose


# --------------------------------------------------------------------------------- viterbi
def brute_force(emission, transition, initial):
    """Every path, summed in the same order as the recursion (so equal scores tie exactly).
    The expected winner: best score, then the smallest path read from the last position back."""
    n, m = emission.shape
    emission, transition = emission.tolist(), transition.tolist()  # Python floats: same IEEE sums, fast
    initial = None if initial is None else initial.tolist()
    best = None
    for path in itertools.product(range(m), repeat=n):
        s = emission[0][path[0]] if initial is None else initial[path[0]] + emission[0][path[0]]
        for t in range(1, n):
            s = s + transition[path[t - 1]][path[t]] + emission[t][path[t]]
        key = (-float(s), path[::-1])
        if best is None or key < best[0]:
            best = (key, path, float(s))
    return best[1], best[2]


def random_lattice(gen, n, m, ties):
    if ties:  # a few integer levels: many exactly equal paths
        draw = lambda *shape: torch.randint(-2, 1, shape, generator=gen).double()  # noqa: E731
    else:
        draw = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    emission, transition, initial = draw(n, m), draw(m, m), draw(m)
    if m > 1 and torch.rand((), generator=gen) < 0.3:  # forbidden transitions
        transition[torch.rand(m, m, generator=gen) < 0.3] = -math.inf
    return emission, transition, initial


@pytest.mark.parametrize("ties", [False, True])
def test_viterbi_equals_brute_force(ties):
    gen = torch.Generator().manual_seed(4 + ties)
    for trial in range(150):
        n, m = int(torch.randint(1, 5, (), generator=gen)), int(torch.randint(1, 6, (), generator=gen))
        emission, transition, initial = random_lattice(gen, n, m, ties)
        init = initial if trial % 3 else None
        path, score = viterbi(emission, transition, init)
        expected_path, expected_score = brute_force(emission, transition, init)
        assert path.dtype == torch.int64 and path.shape == (n,)
        assert tuple(path.tolist()) == expected_path, (trial, emission, transition, init)
        assert float(score) == expected_score or (math.isinf(expected_score) and math.isinf(float(score)))


def test_viterbi_ties_prefer_lowest_indices_and_checks_shapes():
    path, score = viterbi(torch.zeros(3, 4), torch.zeros(4, 4))
    assert path.tolist() == [0, 0, 0] and float(score) == 0.0
    with pytest.raises(ValueError, match="transition must be"):
        viterbi(torch.zeros(2, 3), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="initial must be"):
        viterbi(torch.zeros(2, 3), torch.zeros(3, 3), torch.zeros(2))
    with pytest.raises(ValueError, match="emission must be"):
        viterbi(torch.zeros(0, 3), torch.zeros(3, 3))


def test_candidate_set_covers_every_positions_top_k():
    gen = torch.Generator().manual_seed(0)
    for n, v, k in [(1, 10, 3), (4, 50, 5), (3, 8, 8), (2, 6, 20)]:
        head = torch.randn(n, v, generator=gen).log_softmax(-1)
        cands, logprobs = candidate_set(head, k)
        assert cands.dtype == torch.int64 and cands.numel() <= min(k, v) * n
        assert torch.equal(cands, torch.unique(cands)) and logprobs.shape == (n, cands.numel())
        assert torch.equal(logprobs, head[:, cands])
        for t in range(n):
            assert set(head[t].topk(min(k, v)).indices.tolist()) <= set(cands.tolist())
    shared = torch.tensor([[0.0, -1.0, -5.0, -9.0], [0.0, -1.0, -9.0, -5.0]])
    assert candidate_set(shared, 2)[0].tolist() == [0, 1]  # union, no duplicates
    with pytest.raises(ValueError, match="top_k"):
        candidate_set(shared, 0)


def test_viterbi_propose_follows_the_transitions_over_per_position_argmax():
    # Codes 1 and 3 alternate in the corpus; 0 and 2 occur only next to each other, rarely.
    corpus = [np.array([1, 1, 3, 3, 1, 3, 1, 1, 3] * 5), np.array([0, 2])]
    table = TransitionTable.build(corpus, vocab_size=4, top_k=4, smoothing=0.01)
    head = torch.tensor([[0.50, 0.40, 0.05, 0.05],    # position 1 alone: code 0
                         [0.05, 0.05, 0.50, 0.40]]).log()  # position 2 alone: code 2
    assert head.argmax(-1).tolist() == [0, 2]
    assert viterbi_propose(head, table, prev_token=1, top_k=2).tolist() == [1, 3]
    # With flat transitions (pure unigram of a uniform corpus) the heads' argmax wins.
    flat = TransitionTable.build([np.arange(4)], vocab_size=4, smoothing=1.0)
    assert viterbi_propose(head, flat, prev_token=1, top_k=2).tolist() == [0, 2]
    # The step from the emitted code counts: after 0 (followed only by 2), 0 -> 2 wins.
    skewed = TransitionTable.build([np.array([0, 2] * 20 + [1, 3] * 20)], vocab_size=4, smoothing=0.01)
    assert viterbi_propose(torch.tensor([[0.45, 0.0, 0.55, 0.0]]).clamp_min(1e-9).log(), skewed,
                           prev_token=0, top_k=2).tolist() == [2]
    assert viterbi_propose(torch.tensor([[0.55, 0.0, 0.45, 0.0]]).clamp_min(1e-9).log(), skewed,
                           prev_token=1, top_k=2).tolist() == [0]
    with pytest.raises(ValueError, match="codes"):
        viterbi_propose(torch.zeros(2, 5), table, prev_token=1, top_k=2)
    with pytest.raises(ValueError, match="outside"):
        viterbi_propose(head, table, prev_token=4, top_k=2)


# --------------------------------------------------------------------------------- table
CORPUS = [np.array([0, 1, 1, 2]), np.array([1, 2], dtype=np.int16)]  # V = 4: code 3 (stop) unseen


def full_matrix(table: TransitionTable) -> np.ndarray:
    codes = torch.arange(table.vocab_size)
    return table.log_prob(codes, codes).double().numpy()


def test_probabilities_match_hand_computation():
    lam = 0.2
    uni = np.array([1 + 1, 3 + 1, 2 + 1, 0 + 1]) / (6 + 4)  # add-one over N = 6 codes, V = 4
    q = np.exp(full_matrix(TransitionTable.build(CORPUS, 4, top_k=64, smoothing=lam)))
    # stored: (1 - lam) c(i,j)/c(i) + lam P_uni(j); bigrams (0,1), (1,1), (1,2) x 2
    np.testing.assert_allclose(q[1, 2], (1 - lam) * 2 / 3 + lam * uni[2], rtol=2e-3)
    np.testing.assert_allclose(q[1, 1], (1 - lam) * 1 / 3 + lam * uni[1], rtol=2e-3)
    np.testing.assert_allclose(q[0, 1], (1 - lam) + lam * uni[1], rtol=2e-3)
    # unstored in a row whose successors are all stored: lam P_uni(j), plus the few 1e-4 that
    # rounding the stored entries down to float16 hands to the back-off
    np.testing.assert_allclose(q[1, [0, 3]], lam * uni[[0, 3]], atol=5e-4)
    # rows never seen as predecessors (2, 3): the unigram
    np.testing.assert_allclose(q[2], uni, rtol=1e-5)
    np.testing.assert_allclose(q[3], uni, rtol=1e-5)

    # top_k = 1: row 1 keeps only 2; 1 -> 1's bigram mass (1/3) backs off in proportion to the unigram
    q1 = np.exp(full_matrix(TransitionTable.build(CORPUS, 4, top_k=1, smoothing=lam)))
    np.testing.assert_allclose(q1[1, 2], (1 - lam) * 2 / 3 + lam * uni[2], rtol=2e-3)
    unstored = uni[[0, 1, 3]].sum()
    np.testing.assert_allclose(q1[1, 1], uni[1] * (lam + (1 - lam) * (1 / 3) / unstored), rtol=5e-3)


@pytest.mark.parametrize("top_k", [1, 2, 3, 64])
def test_rows_are_normalised_and_finite(top_k):
    """Normalisation: sum_j Q(i, j) = 1 over all j in [0, V), for every previous code i."""
    rng = np.random.default_rng(top_k)
    v = 12
    corpus = [rng.integers(0, v - 1, size=int(rng.integers(1, 40))) for _ in range(30)]
    corpus = [np.append(s, v - 1) for s in corpus]  # the stop code at every end
    table = TransitionTable.build(corpus, v, top_k=top_k, smoothing=0.05)
    logq = full_matrix(table)
    assert np.isfinite(logq).all() and (logq < 0).all()
    np.testing.assert_allclose(np.exp(logq).sum(1), 1.0, atol=1e-3)
    assert table.max_row_length <= top_k
    # the dense block for a candidate subset is the same entries
    prev, nxt = torch.tensor([3, 0, 11, 3]), torch.tensor([5, 11, 0])
    np.testing.assert_array_equal(table.log_prob(prev, nxt).numpy(), logq[np.ix_(prev.numpy(), nxt.numpy())])


def test_file_round_trip_is_exact(tmp_path):
    table = TransitionTable.build(CORPUS * 3, 4, top_k=2, smoothing=0.3, unigram_alpha=0.5)
    path = table.save(tmp_path / "codes.pct")
    assert path.read_bytes()[:len(MAGIC)] == MAGIC and not list(tmp_path.glob("*.tmp"))
    loaded = TransitionTable.load(path, expect_vocab_size=4)
    for name in ("indptr", "successors", "logprob", "backoff", "log_unigram"):
        assert torch.equal(getattr(loaded, name), getattr(table, name)), name
    assert loaded.header() == table.header()
    np.testing.assert_array_equal(full_matrix(loaded), full_matrix(table))
    with pytest.raises(ValueError, match="covers 4 codes"):
        TransitionTable.load(path, expect_vocab_size=5)
    with pytest.raises(ValueError, match=".pct"):
        table.save(tmp_path / "codes.bin")


def test_corrupt_files_are_refused(tmp_path):
    data = TransitionTable.build(CORPUS, 4).save(tmp_path / "t.pct").read_bytes()
    cases = {"flipped": data[:60] + bytes([data[60] ^ 0x10]) + data[61:],
             "truncated": data[:-40], "magic": b"PCGGRP\0" + data[7:], "tiny": data[:10]}
    messages = {"flipped": "checksum", "truncated": "checksum", "magic": "magic", "tiny": "magic"}
    for name, blob in cases.items():
        (tmp_path / f"{name}.pct").write_bytes(blob)
        with pytest.raises(ValueError, match=messages[name]):
            TransitionTable.load(tmp_path / f"{name}.pct")


def test_bad_inputs_raise_value_errors():
    with pytest.raises(ValueError, match="outside"):
        TransitionTable.build([np.array([0, 1, 4])], 4)
    with pytest.raises(ValueError, match="outside"):
        TransitionTable.build([np.array([0, -1])], 4)
    with pytest.raises(ValueError, match="empty"):
        TransitionTable.build([], 4)
    with pytest.raises(ValueError, match="empty"):
        TransitionTable.build([np.array([], dtype=np.int64)], 4)
    with pytest.raises(ValueError, match="integer"):
        TransitionTable.build([np.array([0.0, 1.0])], 4)
    with pytest.raises(ValueError, match="1-D"):
        TransitionTable.build(np.array([0, 1, 2]), 4)
    for kwargs, match in [({"top_k": 0}, "top_k"), ({"smoothing": 0.0}, "smoothing"),
                          ({"smoothing": 1.5}, "smoothing"), ({"unigram_alpha": 0}, "unigram_alpha")]:
        with pytest.raises(ValueError, match=match):
            TransitionTable.build(CORPUS, 4, **kwargs)
    table = TransitionTable.build(CORPUS, 4)
    with pytest.raises(ValueError, match="outside"):
        table.log_prob(torch.tensor([0]), torch.tensor([4]))
    with pytest.raises(ValueError, match="1-D"):
        table.log_prob(torch.tensor([[0]]), torch.tensor([1]))


@pytest.mark.parametrize("v, dtype", [(65536, np.uint16), (70000, np.int32)])
def test_successor_width_follows_the_vocabulary(tmp_path, v, dtype):
    corpus = [np.array([v - 1, 65535, v - 1, 3, 65535, v - 1])]
    table = TransitionTable.build(corpus, v, top_k=8)
    assert table.successor_dtype == np.dtype(dtype) and table.header()["successor_dtype"] == np.dtype(dtype).name
    loaded = TransitionTable.load(table.save(tmp_path / "wide.pct"))
    assert torch.equal(loaded.successors, table.successors)
    assert set(loaded.row(v - 1)[0].tolist()) == {3, 65535}
    block = loaded.log_prob(torch.tensor([v - 1, 65535]), torch.tensor([65535, 3, v - 1, 0]))
    assert torch.equal(block, table.log_prob(torch.tensor([v - 1, 65535]), torch.tensor([65535, 3, v - 1, 0])))
    assert block[0, 0] > block[0, 3] and block[1, 2] > block[1, 1] and torch.isfinite(block).all()
