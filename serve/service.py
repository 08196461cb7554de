"""What the HTTP and WebSocket routes share: request validation into a `SpeechJob`, leasing a
worker and opening its stream (errors as `APIError`), auth, and the metrics bookkeeping."""

from __future__ import annotations

import hmac
import logging
import textwrap
import time

from starlette.concurrency import run_in_threadpool

from pcgtts.runtime.audio.presets import PresetVoice
from pcgtts.runtime.config import Settings, SynthesisConfig, resolve_settings
from pcgtts.runtime.decode.batch import BatchFull, check_batchable
from pcgtts.runtime.text.prompt import check_text, tokenize_plain
from pcgtts.serve.config import ServerConfig
from pcgtts.serve.errors import APIError
from pcgtts.serve.metrics import Metrics
from pcgtts.serve.pool import QueueFull, SpeechJob, WorkerPool
from pcgtts.serve.voices import VoiceStore

log = logging.getLogger(__name__)

# The request fields that set runtime settings (field -> its name in runtime/config.py). Their types
# and ranges are the runtime dataclasses' own, checked when a request's settings are built.
REQUEST_SETTINGS = {"policy": "policy", "seed": "seed", "temperature": "temperature"}
MESSAGE_CHARS = 200  # an error message echoing a huge value is cut to this length


class Service:
    def __init__(self, config: ServerConfig, pool: WorkerPool):
        self.config, self.pool = config, pool
        self.voices = VoiceStore(config.voices_dir, pool.synthesizers[0].reference_encoder,
                                 pool.synthesizers[0].presets)
        self.metrics = Metrics(pool)

    def check_key(self, authorization: str | None) -> None:
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "Incorrect API key provided: send `Authorization: Bearer <key>`",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def make_job(self, text: str, voice: str, policy: str | None = None, seed: int | None = None,
                 temperature: float | None = None) -> SpeechJob:
        """A validated job (every error a 400 naming its field), before any worker is taken."""
        if not isinstance(text, str) or len(text) > self.config.max_input_chars:
            raise APIError(400, f"input has {len(text)} characters; this server accepts at most "
                           f"{self.config.max_input_chars}", "input", "string_above_max_length")
        try:
            text = check_text(text)
        except ValueError as err:
            raise APIError(400, f"input: {err}", "input", "invalid_value") from None
        try:
            voice_obj = self.voices.get(voice)
        except KeyError:
            names = ", ".join(("default",) + self.voices.presets.names)
            raise APIError(400, f"voice {voice!r} not found; built-in voices: {names} (GET /v1/audio/voices lists "
                           "them with their aliases and the stored ones)", "voice", "voice_not_found") from None
        except ValueError as err:
            raise APIError(400, f"voice: {err}", "voice", "invalid_value") from None
        num_speech = self.pool.synthesizers[0].target.vocab.num_speech
        prompt = voice_obj.prompt if isinstance(voice_obj, PresetVoice) else voice_obj
        if prompt is not None and int(prompt.codes.max()) >= num_speech:
            raise APIError(400, f"voice {voice!r} holds codec tokens beyond the loaded model's {num_speech} speech "
                           "tokens (it was encoded for another model)", "voice", "voice_incompatible")
        config = self.request_config(policy=policy, seed=seed, temperature=temperature)
        batch = self.pool.synthesizers[0].batch
        if batch is not None:  # every request decodes in a worker's batch
            try:
                check_batchable(config.decode, draft=batch.draft is not None)
            except ValueError as err:
                raise APIError(400, f"policy: {err} (this server decodes up to {self.pool.max_batch} streams "
                               "together per worker)", "policy", "invalid_value") from None
        return SpeechJob(text, voice_obj, config, time.monotonic() + self.config.request_timeout_s)

    def request_config(self, **fields) -> SynthesisConfig:
        """The workers' settings with a request's own (`REQUEST_SETTINGS`; None: not given), built
        through the runtime's config dataclasses, so a value out of their range or of the wrong type
        is an APIError (400, naming its field) before any work starts."""
        base = Settings(synthesis=self.pool.synthesizers[0].config)
        given = {name: value for name, value in fields.items() if value is not None}
        for name, value in given.items():  # one at a time, so the error names its field
            self._resolve({REQUEST_SETTINGS[name]: value}, base, name)
        return self._resolve({REQUEST_SETTINGS[name]: value for name, value in given.items()}, base, None).synthesis

    @staticmethod
    def _resolve(settings: dict, base: Settings, param: str | None) -> Settings:
        try:
            return resolve_settings(settings, base=base)
        except ValueError as err:
            message = textwrap.shorten(str(err), MESSAGE_CHARS, placeholder=" ...")
            raise APIError(400, message, param, "invalid_value") from None

    async def begin(self, job: SpeechJob):
        """Take a worker and open the job's stream: (an async iterator of chunks). Raises APIError:
        429 + Retry-After when the queue is full, 503 when no worker frees up in time, 400 when the
        runtime refuses the request (e.g. a policy the loaded models cannot run)."""
        try:
            synth = await self.pool.acquire(job.deadline)
        except QueueFull as err:
            raise APIError(429, f"the server is busy ({self.pool.seats} streams streaming, {self.pool.queue_size} "
                           f"requests queued); retry after {err.retry_after} s", None, "queue_full",
                           {"Retry-After": str(err.retry_after)}) from None
        except TimeoutError:
            raise APIError(503, f"no worker became free within the request time limit "
                           f"({self.config.request_timeout_s:g} s)", None, "timeout",
                           {"Retry-After": str(self.pool.retry_after())}) from None
        try:
            stream = await run_in_threadpool(self.pool.open, synth, job)
        except ValueError as err:
            self.pool.release(synth)
            raise APIError(400, str(err), None, "invalid_value") from None
        except BatchFull:  # a safeguard (a worker has as many seats as slots): refused, never waited for
            self.pool.release(synth)
            retry = self.pool.retry_after()
            raise APIError(429, f"the server is busy (every batch slot is streaming); retry after {retry} s", None,
                           "queue_full", {"Retry-After": str(retry)}) from None
        except BaseException:
            self.pool.release(synth)
            raise
        return self.pool.start(synth, job, stream, on_done=self._done)

    def _done(self, job: SpeechJob) -> None:
        if job.timed_out:
            self.metrics.cancelled.labels("time_limit").inc()
            log.warning("a request passed the time limit of %g s and was cut", self.config.request_timeout_s)
        elif job.stats is not None and job.stats.cancelled:
            self.metrics.cancelled.labels("client").inc()
        self.metrics.job_done(job)

    def usage(self, job: SpeechJob) -> dict:
        """OpenAI's usage object: text tokens in, speech tokens out."""
        text_tokens = len(tokenize_plain(self.pool.synthesizers[0].tokenizer, job.text))
        speech_tokens = job.stats.totals().emitted if job.stats is not None else 0
        return {"input_tokens": text_tokens, "output_tokens": speech_tokens,
                "total_tokens": text_tokens + speech_tokens}
