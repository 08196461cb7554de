"""The exported X-codec2 decoder on ONNX Runtime: the same `decode(codes)` as `runtime/audio/codec.py`'s
`Codec`, so the windowed streaming decoder runs on either unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pcgtts.runtime.audio.chunk import SAMPLE_RATE, SAMPLES_PER_TOKEN
from pcgtts.runtime.audio.codec import SpeechCodec
from pcgtts.runtime.lm.graph_meta import check_recorded

CODEC_META = "pcgtts-codec.json"


def is_exported_codec(folder: str | Path) -> bool:
    return (Path(folder) / CODEC_META).is_file()


class OrtCodec:
    """The exported decoder (a `SpeechCodec` that cannot encode: voices come from `pcgtts voice add`)."""

    sample_rate = SAMPLE_RATE
    samples_per_token = SAMPLES_PER_TOKEN
    can_encode = False

    def __init__(self, folder: str | Path, meta: dict | None = None, threads: int | None = None,
                 force: bool = False):
        """threads: onnxruntime's intra-op threads (None: its default), as the LM's sessions get
        (`runtime/config.py: cpu_threads`); its pool does not spin between windows."""
        from pcgtts.runtime.lm.onnxruntime import open_session

        folder = Path(folder)
        if meta is None:
            path = folder / CODEC_META
            if not path.is_file():
                raise ValueError(f"{folder} is not an exported codec decoder: no {CODEC_META} "
                                 f"(make one with `pcgtts export codec`)")
            meta = json.loads(path.read_text())
            check_recorded(meta.get("check"), folder, force)
        if meta.get("format") != "pcgtts-codec" or meta.get("samples_per_token") != SAMPLES_PER_TOKEN:
            raise ValueError(f"{folder}: not a pcgtts X-codec2 decoder export ({meta.get('format')!r})")
        self.source_dir = folder
        source = Path(meta["source"]) if meta.get("source") else None
        # The Hugging Face checkpoint it was exported from, if still there: what can encode references.
        self.checkpoint_dir = source if source is not None and (source / "config.json").is_file() else None
        self.session = open_session(folder / meta["graph"], torch.device("cpu"), threads)

    def decode(self, codes) -> np.ndarray:
        """codes: int [T] in [0, 65536) -> float32 [320 T] at 16 kHz."""
        codes = np.asarray(codes, dtype=np.int64).reshape(1, -1)
        if codes.size == 0:
            return np.zeros(0, np.float32)
        if codes.min() < 0 or codes.max() >= 65536:
            raise ValueError("codec indices must lie in [0, 65536)")
        return self.session.run(["audio"], {"codes": codes})[0][0]

    def decode_batch(self, codes) -> np.ndarray:
        """codes: int [B, T] -> float32 [B, 320 T]: in one run where the graph's batch axis is dynamic,
        else (`pcgtts export codec` fixes it at 1) window by window."""
        codes = np.asarray(codes, dtype=np.int64)
        if codes.ndim != 2:
            raise ValueError(f"decode_batch takes codes [B, T], got shape {codes.shape}")
        if isinstance(self.session.get_inputs()[0].shape[0], int) or not codes.size:
            return SpeechCodec.decode_batch(self, codes) if len(codes) else np.zeros((0, 0), np.float32)
        if codes.min() < 0 or codes.max() >= 65536:
            raise ValueError("codec indices must lie in [0, 65536)")
        return self.session.run(["audio"], {"codes": codes})[0]

    def encode(self, samples: np.ndarray) -> np.ndarray:
        raise ValueError(f"{self.source_dir} is an exported codec decoder and cannot encode audio: make a voice "
                         "file with `pcgtts voice add` and the Hugging Face X-codec2 checkpoint, then pass voice=")
