"""Audio bytes for the client: the runtime's float32 16 kHz chunks -> pcm / wav / flac / SSE.

- `pcm`: raw signed 16-bit little-endian mono at `ServerConfig.sample_rate` (24 kHz by default,
  which is what OpenAI's `pcm` means), streamed as generated.
- `wav`: a 44-byte header whose RIFF and data sizes are 0xFFFFFFFF ("unknown length", read by
  ffmpeg, soundfile/libsndfile, browsers and Python's `wave` up to the real end), then the pcm stream.
- `flac`: FLAC needs the whole signal for its header, so it is encoded once generation ends
  (one body, sent when complete): use pcm or wav to stream.
Resampling (soxr, streaming) keeps state across chunks, so chunk seams stay continuous.
"""

from __future__ import annotations

import base64
import io
import json
import struct

import numpy as np

from pcgtts.runtime.audio.chunk import SAMPLE_RATE

FORMATS = {"pcm": "audio/pcm", "wav": "audio/wav", "flac": "audio/flac"}
STREAMED = ("pcm", "wav")
UNKNOWN_SIZE = 0xFFFFFFFF


def wav_header(sample_rate: int, data_bytes: int = UNKNOWN_SIZE) -> bytes:
    """PCM16 mono WAV header; `data_bytes` UNKNOWN_SIZE for a stream of unknown length."""
    riff = UNKNOWN_SIZE if data_bytes == UNKNOWN_SIZE else 36 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate,
            sample_rate * 2, 2, 16) + b"data" + struct.pack("<I", data_bytes))


def to_pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


class Encoder:
    """Turns one request's chunks into the bytes of its response format."""

    def __init__(self, response_format: str, sample_rate: int):
        import soxr

        if response_format not in FORMATS:
            raise ValueError(f"response_format must be one of {', '.join(FORMATS)}, got {response_format!r}")
        self.format, self.rate = response_format, sample_rate
        self._resampler = (soxr.ResampleStream(SAMPLE_RATE, sample_rate, 1, dtype="float32", quality="HQ")
                           if sample_rate != SAMPLE_RATE else None)
        self._held: list[np.ndarray] = []  # flac only
        self.samples_out = 0

    @property
    def media_type(self) -> str:
        return FORMATS[self.format]

    def header(self) -> bytes:
        return wav_header(self.rate) if self.format == "wav" else b""

    def resample(self, samples: np.ndarray, last: bool) -> np.ndarray:
        samples = np.asarray(samples, dtype=np.float32)
        if self._resampler is not None:
            samples = self._resampler.resample_chunk(samples, last=last)
        self.samples_out += len(samples)
        return samples

    def chunk(self, samples: np.ndarray, last: bool = False) -> bytes:
        """Bytes to send now for these samples (flac: b"" until `finish`)."""
        out = self.resample(samples, last)
        if self.format == "flac":
            self._held.append(out)
            return b""
        return to_pcm16(out)

    def finish(self) -> bytes:
        """The trailing bytes once generation is over (the whole file for flac)."""
        if self.format != "flac":
            return b""
        import soundfile as sf

        buf = io.BytesIO()
        audio = np.concatenate(self._held) if self._held else np.zeros(0, np.float32)
        pcm = np.frombuffer(to_pcm16(audio), dtype="<i2")  # the same samples the pcm format sends
        sf.write(buf, pcm, self.rate, format="FLAC", subtype="PCM_16")
        return buf.getvalue()


def sse_event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def sse_delta(pcm: bytes) -> bytes:
    return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(pcm).decode()})
