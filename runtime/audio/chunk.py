"""`AudioChunk`: one piece of streamed audio, the unit everything downstream of the codec passes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 16000  # X-codec2 works at 16 kHz only
SAMPLES_PER_TOKEN = 320  # one speech token is 20 ms of audio


@dataclass(frozen=True)
class AudioChunk:
    samples: np.ndarray
    """Mono float32 samples in [-1, 1]."""
    sample_rate: int
    """Rate of `samples` in Hertz."""
    token_start: int
    """Index (within the utterance's generated speech tokens) of the first token this chunk covers."""
    token_end: int
    """One past the last token covered: the chunk holds (token_end - token_start) * 320 samples (a preset
    heard through a transform: about that many times its tempo ratio, `runtime/audio/transform.py`)."""
    ready_time: float
    """`time.perf_counter()` when the chunk was ready for playback."""
    is_last: bool = False
    """True for the final chunk of a stream."""
    truncated_sentences: int = 0
    """Sentences of this stream cut so far (budget or KV cache reached before the stop token)."""

    @property
    def duration(self) -> float:
        """Length of the chunk in seconds."""
        return len(self.samples) / self.sample_rate
