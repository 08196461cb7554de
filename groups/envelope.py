"""The binary envelope of pcgtts' table files (`.pcg` group tables, `.pct` transition tables):

    7 bytes   magic, then 1 byte format version
    4 bytes   uint32 little-endian: length H of the JSON header
    H bytes   JSON header (sorted keys)
    ...       the arrays, little-endian, in the order the format defines
    32 bytes  sha256 of everything above

Reading checks magic, version and checksum before anything is parsed, so a flipped byte anywhere
is reported as corruption rather than as whatever it would parse into. Writing is atomic.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

DIGEST = 32


def write_envelope(path: str | Path, magic: bytes, version: int, header: dict, arrays) -> Path:
    """Write header + arrays to `path` (a temporary file renamed over it)."""
    path = Path(path)
    head = json.dumps(header, sort_keys=True).encode()
    body = magic + bytes([version]) + struct.pack("<I", len(head)) + head
    body += b"".join(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes() for a in arrays)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(body + hashlib.sha256(body).digest())
        os.replace(tmp, path)  # never leave a half-written table under the real name
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_envelope(path: Path, magic: bytes, version: int, what: str) -> tuple[dict, bytes, int]:
    """(JSON header, the file's bytes, offset of the first array); ValueError naming `what`."""
    data = path.read_bytes()
    fixed = len(magic) + 1 + 4
    if len(data) < fixed + DIGEST or data[:len(magic)] != magic:
        raise ValueError(f"{path} is not a pcgtts {what} (bad magic bytes)")
    if data[len(magic)] != version:
        raise ValueError(f"{path}: {what} format version {data[len(magic)]}, this pcgtts reads {version}")
    if hashlib.sha256(data[:-DIGEST]).digest() != data[-DIGEST:]:
        raise ValueError(f"{path}: {what} checksum mismatch (the file is corrupt or truncated)")
    (head_len,) = struct.unpack("<I", data[len(magic) + 1:fixed])
    try:
        header = json.loads(data[fixed:fixed + head_len])
        if not isinstance(header, dict):
            raise TypeError("the header is not a JSON object")
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as err:
        raise ValueError(f"{path}: {what} header is corrupt ({type(err).__name__}: {err})") from None
    return header, data, fixed + head_len


def read_arrays(path: Path, data: bytes, pos: int, sizes, what: str) -> list[np.ndarray]:
    """The arrays [(dtype, count), ...] from `pos` on; the file must end right after them."""
    expected = pos + sum(np.dtype(t).itemsize * n for t, n in sizes) + DIGEST
    if len(data) != expected:
        raise ValueError(f"{path}: {what} is truncated or has trailing data ({len(data)} bytes, expected {expected})")
    arrays = []
    for dtype, count in sizes:
        arr = np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<"), count=count, offset=pos)
        arrays.append(arr.astype(dtype))
        pos += arr.nbytes
    return arrays


__all__ = ["write_envelope", "read_envelope", "read_arrays", "DIGEST"]
