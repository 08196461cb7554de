"""The group-table file (`.pcg`): Acoustic Similarity Groups in two 16-bit CSR tables.

Layout of a file, little-endian:

    8 bytes   magic b"PCGGRP\\0" + format version (1 byte)
    4 bytes   header length H (uint32)
    H bytes   JSON header: theta, top_k, model identity (speech offset, vocabulary size,
              number of speech tokens, embedding fingerprint), array lengths, summary stats
    arrays    group_offsets uint32 [M+1] | group_members uint16 [nnz]
    32 bytes  sha256 of everything above

Token and group ids are uint16 (65,536 speech tokens and at most 65,536 groups fit exactly),
offsets uint32: about 18.6 MB for 65,536 tokens with a mean group of ~140. Only group ->
members is stored; token -> groups (the same entries, transposed) is derived at load in about
a second, which halves the file. Loading checks the
magic, version, length, checksum, array consistency and, when asked, that the table was built
for the model in hand; each failure is a `ValueError` naming the problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from pcgtts.groups.device import DeviceGroupTable, token_major
from pcgtts.groups.envelope import read_arrays, read_envelope, write_envelope

MAGIC = b"PCGGRP\0"
VERSION = 1
_DIGEST = 32


@dataclass(frozen=True, eq=False)
class GroupTable:
    group_offsets: np.ndarray  # uint32 [M + 1]
    group_members: np.ndarray  # uint16 [nnz], sorted within each group
    token_offsets: np.ndarray  # uint32 [N + 1]
    token_groups: np.ndarray  # uint16 [nnz], S(t) sorted within each token
    theta: float
    top_k: int | None = None
    # Identity of the model the groups came from (-1 / "" until attached).
    speech_offset: int = -1
    vocab_size: int = -1
    fingerprint: str = ""
    stats: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_offsets) - 1

    @property
    def num_groups(self) -> int:
        return len(self.group_offsets) - 1

    @classmethod
    def from_groups_csr(cls, group_offsets: np.ndarray, group_members: np.ndarray, num_tokens: int,
                        theta: float, top_k: int | None = None) -> "GroupTable":
        """Derive token -> groups from group -> members and compute the summary statistics."""
        group_offsets = np.asarray(group_offsets, dtype=np.int64)
        members = np.asarray(group_members, dtype=np.int64)
        token_offsets, token_groups, _ = token_major(group_offsets, members, num_tokens)
        table = cls(group_offsets.astype(np.uint32), members.astype(np.uint16), token_offsets.astype(np.uint32),
                    token_groups.astype(np.uint16), float(theta), top_k)
        return replace(table, stats=table._summary())

    def _summary(self) -> dict:
        sizes = np.diff(self.group_offsets.astype(np.int64))
        per_token = np.diff(self.token_offsets.astype(np.int64))
        return {
            "num_tokens": self.num_tokens,
            "num_groups": self.num_groups,
            "mean_group_size": float(sizes.mean()) if sizes.size else 0.0,
            "max_group_size": int(sizes.max()) if sizes.size else 0,
            "mean_groups_per_token": float(per_token.mean()) if per_token.size else 0.0,
            "max_groups_per_token": int(per_token.max()) if per_token.size else 0,
            "bytes": int(self.group_offsets.nbytes + self.group_members.nbytes),  # on disk
            "device_bytes": int(sum(a.nbytes for a in self._arrays())),  # both directions
        }

    def with_model(self, speech_offset: int, vocab_size: int, fingerprint: str) -> "GroupTable":
        return replace(self, speech_offset=speech_offset, vocab_size=vocab_size, fingerprint=fingerprint)

    def members(self, group: int) -> np.ndarray:
        return self.group_members[self.group_offsets[group]:self.group_offsets[group + 1]]

    def groups_of(self, token: int) -> np.ndarray:
        return self.token_groups[self.token_offsets[token]:self.token_offsets[token + 1]]

    def to_device(self, device="cpu") -> DeviceGroupTable:
        return DeviceGroupTable.from_csr(self.group_offsets, self.group_members, self.num_tokens, device)

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return (self.group_offsets, self.group_members, self.token_offsets, self.token_groups)

    def header(self) -> dict:
        return {
            "format": "pcgtts-groups", "version": VERSION, "theta": self.theta, "top_k": self.top_k,
            "num_tokens": self.num_tokens, "num_groups": self.num_groups,
            "nnz": int(len(self.group_members)), "speech_offset": self.speech_offset,
            "vocab_size": self.vocab_size, "fingerprint": self.fingerprint, "stats": self.stats,
        }

    def save(self, path: str | Path) -> Path:
        return write_envelope(path, MAGIC, VERSION, self.header(), (self.group_offsets, self.group_members))

    @classmethod
    def load(cls, path: str | Path, expect_vocab=None, expect_fingerprint: str | None = None) -> "GroupTable":
        """Read and validate a table; `expect_vocab` (SpeechVocab) / fingerprint tie it to a model."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"group table not found: {path}")
        header, data, pos = read_envelope(path, MAGIC, VERSION, "group table")
        try:
            m, n, nnz = (int(header[k]) for k in ("num_groups", "num_tokens", "nnz"))
            header["theta"], header["top_k"], header["speech_offset"], header["vocab_size"], header["fingerprint"]
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: group table header is corrupt ({type(err).__name__}: {err})") from None
        arrays = read_arrays(path, data, pos, [(np.uint32, m + 1), (np.uint16, nnz)], "group table")
        group_offsets, group_members = arrays
        if group_offsets[0] != 0 or group_offsets[-1] != nnz or np.any(np.diff(group_offsets.astype(np.int64)) <= 0):
            raise ValueError(f"{path}: inconsistent group offsets")
        if nnz and int(group_members.max()) >= n:
            raise ValueError(f"{path}: a group member lies outside the {n} speech tokens")
        table = cls.from_groups_csr(group_offsets, group_members, n, header["theta"], header["top_k"])
        table = replace(table, speech_offset=header["speech_offset"], vocab_size=header["vocab_size"],
                        fingerprint=header["fingerprint"])
        if expect_vocab is not None:
            table.check_model(expect_vocab.num_speech, expect_vocab.speech_offset, expect_vocab.vocab_size, path)
        if expect_fingerprint is not None and expect_fingerprint != table.fingerprint:
            raise ValueError(f"{path}: group table was built for another model "
                             f"(embedding fingerprint {table.fingerprint[:12]}…, this model {expect_fingerprint[:12]}…)")
        return table

    def check_model(self, num_speech: int, speech_offset: int, vocab_size: int, where="group table") -> None:
        mine = (self.num_tokens, self.speech_offset, self.vocab_size)
        theirs = (num_speech, speech_offset, vocab_size)
        if mine != theirs:
            raise ValueError(f"{where} was built for another model: (speech tokens, speech offset, vocabulary) = "
                             f"{mine} in the table, {theirs} in the model")
