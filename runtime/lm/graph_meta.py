"""`pcgtts-lm.json`: what an exported LM graph / engine is, written beside it by `pcgtts export`.

The runtime reads it instead of guessing from the graph: layer and head counts size the KV
buffers, the vocabulary block is checked against the tokenizer shipped in the same folder,
and the fingerprint of the speech-token embeddings is checked against a group table's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from pcgtts.runtime.text.vocab import SpeechVocab

log = logging.getLogger(__name__)

META_FILE = "pcgtts-lm.json"
FORMAT = "pcgtts-lm"
VERSION = 1
# extra["check"] while an export is made in its staging folder (its numeric check loads it there); the check's
# result replaces it, or an export made without a check drops it, before it is published
PENDING_CHECK = {"pending": True}


@dataclass(frozen=True)
class GraphMeta:
    graph: str  # file name of the ONNX graph or TensorRT engine, relative to the folder
    kind: str  # "onnx" | "tensorrt"
    dtype: str  # dtype of the KV cache tensors ("float32", "float16", "bfloat16")
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: SpeechVocab
    max_length: int  # suggested cache capacity (the graph itself accepts any)
    opset: int
    fingerprint: str  # embedding fingerprint of the speech rows (groups/build.py)
    source: str  # where the weights came from
    extra: dict = dataclasses.field(default_factory=dict)  # numeric check, profiles, versions

    @property
    def state_size(self) -> int:
        """The width of last_hidden_state's rows: the hidden size, wider when the step returns an EAGLE
        draft's tapped layers too (`extra["state_size"]`, export/onnx_lm.py)."""
        return self.extra.get("state_size", self.extra["hidden_size"])

    def save(self, folder: str | Path) -> Path:
        record = {"format": FORMAT, "version": VERSION, **dataclasses.asdict(self)}
        path = Path(folder) / META_FILE
        path.write_text(json.dumps(record, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, folder: str | Path, kind: str, force: bool = False) -> "GraphMeta":
        """Read and validate `folder`'s metadata; an export whose recorded numeric check failed is
        refused unless `force`."""
        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"exported model directory not found: {folder}")
        path = folder / META_FILE
        if not path.is_file():
            raise ValueError(f"{folder} is not an exported pcgtts model: no {META_FILE} "
                             f"(make one with `pcgtts export {'onnx' if kind == 'onnx' else 'tensorrt'}`)")
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is corrupt: {err}") from None
        if record.get("format") != FORMAT or record.get("version") != VERSION:
            raise ValueError(f"{path}: unsupported format {record.get('format')!r} v{record.get('version')}")
        if record.get("kind") != kind:
            raise ValueError(f"{folder} holds a {record.get('kind')!r} export, not {kind!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        record = {k: v for k, v in record.items() if k in fields}
        record["vocab"] = SpeechVocab(**record["vocab"])
        meta = cls(**record)
        if not (folder / meta.graph).is_file():
            raise FileNotFoundError(f"{folder}: {meta.graph} listed in {META_FILE} is missing")
        check_recorded(meta.extra.get("check"), folder, force)
        return meta

    def check_tokenizer(self, vocab: SpeechVocab, where: str) -> None:
        if vocab != self.vocab:
            raise ValueError(f"{where}: the graph was exported for vocabulary {self.vocab}, "
                             f"but the tokenizer beside it gives {vocab}")


def peek_record(folder: str | Path) -> dict | None:
    """`folder`'s pcgtts-lm.json as read, before any model loads: None when there is none (a
    checkpoint, say), {} when it is unreadable (the loader, `GraphMeta.load`, reports that)."""
    path = Path(folder) / META_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def exported_kind(folder: str | Path) -> str | None:
    """The kind of export ("onnx" | "tensorrt") `folder` holds, or None when it holds none; an
    unreadable record counts as "onnx", so that its loader says what is wrong with it."""
    record = peek_record(folder)
    return None if record is None else record.get("kind", "onnx")


def check_recorded(check: dict | None, folder: Path, force: bool) -> None:
    """Refuse an export whose numeric check against PyTorch failed (unless forced); warn if unchecked.
    An export still being made (`PENDING_CHECK`: it reads its own staged graph) passes."""
    if check is None:
        log.warning("%s was exported without a numeric check against PyTorch", folder)
    elif check == PENDING_CHECK:
        return
    elif not check.get("ok", False) and not force:
        raise ValueError(f"{folder}: this export failed its numeric check against PyTorch "
                         f"(max diff {check.get('max_abs_diff')}, tolerance {check.get('tolerance')}); "
                         "export it again, or load it with force_export=True")
