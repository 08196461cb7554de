"""Group tables: building (against brute force), merging, the file format and its failure modes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from pcgtts.groups.build import build_groups, merge_identical, neighbour_lists
from pcgtts.runtime.lm.checkpoint import load_speech_embeddings
from pcgtts.groups.table import GroupTable


def brute_force(emb: torch.Tensor, theta: float, top_k=None) -> list[set[int]]:
    unit = torch.nn.functional.normalize(emb.double(), dim=1)
    sims = unit @ unit.T
    out = []
    for t in range(len(emb)):
        row = sims[t].clone()
        row[t] = float("inf")
        order = row.argsort(descending=True)
        cand = order[: top_k] if top_k else order
        out.append({int(c) for c in cand if row[c] > theta})
    return out


@pytest.fixture(scope="module")
def clustered():
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(20, 16, generator=g)
    return centres[torch.randint(0, 20, (300,), generator=g)] + 0.6 * torch.randn(300, 16, generator=g)


@pytest.mark.parametrize("theta", [0.3, 0.6, 0.9])
@pytest.mark.parametrize("top_k", [None, 5])
def test_built_groups_equal_brute_force(clustered, theta, top_k):
    table = build_groups(clustered, theta, top_k=top_k, block_rows=37, progress=False)
    expected = {frozenset(s) for s in brute_force(clustered, theta, top_k)}
    got = {frozenset(table.members(k).tolist()) for k in range(table.num_groups)}
    assert got == expected
    assert table.num_groups == len(expected)  # identical sets merged, nothing else
    for t in range(table.num_tokens):  # token -> groups is the inverse of group -> members
        assert all(t in set(table.members(k).tolist()) for k in table.groups_of(t))
    assert sum(len(table.groups_of(t)) for t in range(table.num_tokens)) == len(table.group_members)


def test_membership_is_symmetric_before_merging(clustered):
    offsets, members = neighbour_lists(clustered, 0.5, block_rows=50, progress=False)
    pairs = {(t, int(m)) for t in range(300) for m in members[offsets[t]:offsets[t + 1]]}
    assert all((m, t) in pairs for t, m in pairs)
    assert all((t, t) in pairs for t in range(300))


def test_merge_removes_exactly_duplicates():
    offsets = np.array([0, 2, 4, 5, 7])
    members = np.array([1, 2, 1, 2, 3, 1, 3])
    new_off, new_mem = merge_identical(offsets, members)
    groups = [new_mem[new_off[i]:new_off[i + 1]].tolist() for i in range(len(new_off) - 1)]
    assert groups == [[1, 2], [3], [1, 3]]


def test_round_trip_is_exact(tmp_path, clustered):
    table = build_groups(clustered, 0.5, progress=False).with_model(1000, 2000, "abc")
    loaded = GroupTable.load(table.save(tmp_path / "t.pcg"))
    for name in ("group_offsets", "group_members", "token_offsets", "token_groups"):
        a, b = getattr(table, name), getattr(loaded, name)
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert loaded.header() == table.header()
    assert table.group_members.dtype == np.uint16 and table.group_offsets.dtype == np.uint32


def test_device_table_agrees_with_csr(clustered):
    table = build_groups(clustered, 0.5, progress=False)
    dev = table.to_device("cpu")
    assert dev.num_groups == table.num_groups and dev.group_members.dtype == torch.int16
    assert np.array_equal(dev.token_groups.numpy().view(np.uint16), table.token_groups)
    assert np.array_equal(dev.token_offsets.numpy(), table.token_offsets.astype(np.int32))


def test_bad_files_are_clear_errors(tmp_path, clustered):
    path = build_groups(clustered, 0.5, progress=False).with_model(10, 400, "f" * 64).save(tmp_path / "t.pcg")
    data = path.read_bytes()
    (tmp_path / "short.pcg").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="truncated"):
        GroupTable.load(tmp_path / "short.pcg")
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    (tmp_path / "flip.pcg").write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="checksum"):
        GroupTable.load(tmp_path / "flip.pcg")
    (tmp_path / "wav.pcg").write_bytes(b"RIFF" + data[4:])
    with pytest.raises(ValueError, match="magic"):
        GroupTable.load(tmp_path / "wav.pcg")
    with pytest.raises(ValueError, match="another model"):
        GroupTable.load(path, expect_fingerprint="0" * 64)
    with pytest.raises(FileNotFoundError):
        GroupTable.load(tmp_path / "missing.pcg")


def test_build_from_checkpoint_and_cli(tiny_lm_factory, tmp_path):
    import json

    from pcgtts.runtime.lm.checkpoint import load_tokenizer
    from pcgtts.cli import main
    from pcgtts.runtime.text.vocab import SpeechVocab

    model_dir = tiny_lm_factory()
    rows, vocab, fingerprint = load_speech_embeddings(model_dir)
    assert rows.shape == (512, 64) and vocab.num_speech == 512
    out = tmp_path / "g.pcg"
    assert main(["groups", "build", "--target", str(model_dir), "--theta", "0.3", "--out", str(out)]) == 0
    table = GroupTable.load(out, expect_vocab=SpeechVocab.from_tokenizer(load_tokenizer(model_dir)),
                            expect_fingerprint=fingerprint)
    assert table.num_tokens == 512 and table.stats["mean_group_size"] > 1
    other = replace(vocab, vocab_size=vocab.vocab_size + 1)
    with pytest.raises(ValueError, match="another model"):
        GroupTable.load(out, expect_vocab=other)
    assert main(["groups", "info", str(out)]) == 0
    assert json.loads(json.dumps(table.header()))["num_tokens"] == 512
