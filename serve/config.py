"""`ServerConfig`: every setting of the speech server, frozen and validated before a model loads.

Model fields mirror `pcgtts speak`'s flags (None = not given: the runtime's default, and the
built-in voice when no target is given). Server limits are enforced by app.py and pool.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from pcgtts.runtime.audio.io import MAX_SECONDS
from pcgtts.runtime.config import MAX_BATCH, ModelPaths
from pcgtts.runtime.decode.policy import policy as policy_spec

DEFAULT_VOICES_DIR = Path.home() / ".cache" / "pcgtts" / "voices"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback by default: exposing the server is an explicit choice
    port: int = 8000
    workers: int = 1  # Synthesizers loaded (model copies)
    # streams each worker decodes together over its one model copy (every policy, at a fixed or an
    # adaptive draft length; torch backend: `runtime/decode/batch.py`); 1: one stream per worker at a time
    max_batch: int = 1
    queue_size: int = 8  # requests that may wait for a worker; beyond that -> 429 + Retry-After
    request_timeout_s: float = 300.0  # a request (queue wait + synthesis) is cut after this long
    max_input_chars: int = 4096  # OpenAI's own limit for /v1/audio/speech
    max_upload_bytes: int = 10 * 1024 * 1024  # voice uploads (whole multipart body)
    max_upload_seconds: float = MAX_SECONDS  # reference recordings longer than this are refused
    api_key: str | None = None  # when set, every /v1 route needs `Authorization: Bearer <key>`
    voices_dir: str = str(DEFAULT_VOICES_DIR)  # uploaded voices (.voice files); share it between replicas
    sample_rate: int = 24000  # output rate; 24 kHz is what OpenAI's pcm format means (the model makes 16 kHz)
    models: ModelPaths = ModelPaths()
    compute_device: str | None = None  # cpu | cuda | cuda:N (None: the runtime's default, cpu)
    backend: str | None = None
    dtype: str | None = None
    quantize: str | None = None  # int8: the LM's linear layers (torch backend, CPU)
    compile: bool | None = None  # the LM's steps through torch.compile (torch backend, CPU)
    threads: int | None = None  # CPU threads per stage
    policy: str | None = None
    max_new_tokens: int | None = None  # speech tokens per sentence at most
    max_length: int | None = None  # KV-cache slots per sequence
    config_file: str | None = None  # runtime TOML settings (flags/fields above override it)

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        if not (0 <= self.port <= 65535):
            raise ValueError(f"port must lie in [0, 65535], got {self.port}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.queue_size < 0:
            raise ValueError(f"queue_size must be >= 0, got {self.queue_size}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.max_input_chars < 1:
            raise ValueError(f"max_input_chars must be >= 1, got {self.max_input_chars}")
        if self.max_upload_bytes < 1024:
            raise ValueError(f"max_upload_bytes must be >= 1024, got {self.max_upload_bytes}")
        if not (0 < self.max_upload_seconds <= MAX_SECONDS):
            raise ValueError(f"max_upload_seconds must lie in (0, {MAX_SECONDS:g}], got {self.max_upload_seconds}")
        if self.api_key is not None and len(self.api_key) < 8:
            raise ValueError("api_key must have at least 8 characters")
        if not (8000 <= self.sample_rate <= 48000):
            raise ValueError(f"sample_rate must lie in [8000, 48000], got {self.sample_rate}")
        if self.policy is not None:
            policy_spec(self.policy)  # an unknown name: a one-line error
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) \
                or not 1 <= self.max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch must be an integer in [1, {MAX_BATCH}], got {self.max_batch!r}")

    @property
    def max_speech_body_bytes(self) -> int:
        """A speech request's JSON body at most: `max_input_chars` characters at 12 bytes each (one
        outside the Basic Multilingual Plane written as two \\u escapes) and 64 KiB for the rest."""
        return 12 * self.max_input_chars + 64 * 1024

    @property
    def streams(self) -> int:
        """Streams this replica serves at once: `max_batch` on each worker."""
        return self.workers * self.max_batch

    def runtime_settings(self) -> dict:
        """Keyword settings for `Synthesizer.from_pretrained` (None = not given: the runtime's default,
        or the built-in voice's, batching or not)."""
        return {**dataclasses.asdict(self.models), "compute_device": self.compute_device, "backend": self.backend,
                "dtype": self.dtype, "quantize": self.quantize, "compile": self.compile, "threads": self.threads,
                "policy": self.policy, "max_new_tokens": self.max_new_tokens, "max_length": self.max_length,
                "max_batch": self.max_batch}
