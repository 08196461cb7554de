"""`create_app(config, pool)`: the ASGI app (FastAPI) of `pcgtts serve`.

    POST   /v1/audio/speech          OpenAI's body; audio streamed as generated (pcm/wav) or SSE
    GET    /v1/audio/voices          built-in + stored voices
    POST   /v1/audio/voices          multipart: audio file + transcript + name -> a stored voice
    DELETE /v1/audio/voices/{name}
    WS     /v1/audio/speech/stream   incremental text in, PCM + per-sentence markers out (websocket.py)
    GET    /health, GET /metrics     liveness and load; Prometheus text

`/v1` routes need `Authorization: Bearer <key>` when `ServerConfig.api_key` is set; /health and
/metrics stay open for probes and scrapers. Every error is OpenAI error JSON (errors.py).
A speech body past `ServerConfig.max_speech_body_bytes` is a 413 before it is read (voice uploads:
past `max_upload_bytes`). `speed` other than 1.0 is refused with a 400: resampling would shift the pitch, and no
pitch-preserving time stretch is in the dependency set.

A speech request's settings are built and checked (the runtime's ranges) before a worker is
taken, and its headers wait for the first audio chunk: a request the server cannot serve gets an
error status, never 200 (text the model makes no speech for, ending at once, is a 422 with code
`empty_synthesis`). A failure after audio has gone out cuts the transfer (pcm / wav: the client
sees an incomplete body) or ends the SSE stream with an error event. Uploaded voices are
encoded by the workers' reference encoder, the one `pcgtts speak --ref-audio` uses (for an
exported codec decoder: the checkpoint it was exported from).
"""

from __future__ import annotations

import logging
from typing import Literal

from fastapi import Depends, FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

import pcgtts
from pcgtts.runtime.synthesizer import EmptySynthesis
from pcgtts.serve.config import ServerConfig
from pcgtts.serve.encode import FORMATS, Encoder, sse_delta, sse_event
from pcgtts.serve.errors import APIError, install_handlers
from pcgtts.serve.pool import WorkerPool
from pcgtts.serve.service import Service
from pcgtts.serve.voices import CannotEncode, UploadError, VoiceExists, check_name, spooled_to_file

log = logging.getLogger(__name__)

ROUTES = ("/v1/audio/speech", "/v1/audio/voices", "/health", "/metrics")


class SpeechBody(BaseModel):
    """OpenAI's `/v1/audio/speech` body plus pcgtts's extras (policy, seed, temperature). Types are
    strict (`"seed": "5"` or `true` is refused, not read as 5 or 1); the extras' ranges are the
    runtime's, checked by `Service.request_config` before any work starts."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str = "pcgtts"  # any name is accepted: the server serves the models it loaded
    input: str
    voice: str = "default"
    response_format: str = "wav"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None
    policy: str | None = None
    seed: int | None = None
    temperature: float | None = None


async def first_chunk_ready(chunks):
    """`chunks` once its first chunk is ready, so that a stream that fails before any audio is
    answered with an error status (500, logged once here) instead of 200 headers and a broken body."""
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        first = None
    except EmptySynthesis as err:
        log.warning("a speech request produced no audio: %s", err)
        raise APIError(422, f"no speech: {err}", "input", "empty_synthesis") from None
    except Exception:
        log.exception("a speech stream failed before its first chunk")
        raise APIError(500, "speech synthesis failed (details are in the server log)", None, "internal_error",
                       type="server_error") from None

    async def replay():
        try:
            if first is not None:
                yield first
                async for chunk in chunks:
                    yield chunk
        finally:
            await chunks.aclose()  # a client that left stops the generation now

    return replay()


class CutStream(Exception):
    """Raised by an audio body to end its transfer incomplete (after logging why): the client sees a
    broken body, never a short one that looks complete."""


class CuttableStreamingResponse(StreamingResponse):
    """A StreamingResponse whose body may end with `CutStream`: no final body message is sent, so the
    server closes the connection mid-body, without the exception and its traceback reaching the log."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        except CutStream:
            pass


def too_large(limit: int, what: str, param: str | None) -> APIError:
    return APIError(413, f"the {what} is larger than this server's limit of {limit} bytes", param,
                    "upload_too_large" if param == "audio" else "request_too_large")


class _LimitSpeechBodies:
    """ASGI middleware: a speech request's body past `limit` bytes is answered 413 before it is read
    (by its Content-Length), or, sent in chunks without one, as soon as it passes the limit; at most
    `limit` bytes of it are ever held."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != "/v1/audio/speech":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) <= self.limit:
                return await self.app(scope, receive, send)
            return await self._refuse(scope, receive, send)
        parts, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.limit:
                return await self._refuse(scope, receive, send)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(parts), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send):
        err = too_large(self.limit, "request body", None)
        await JSONResponse(err.body(), status_code=413, headers={"Connection": "close"})(scope, receive, send)


def _route_label(path: str) -> str:
    if path in ROUTES:
        return path
    return "/v1/audio/voices/{name}" if path.startswith("/v1/audio/voices/") else "other"


class _CountRequests:
    """ASGI middleware: requests by route and final status (streams count when they end)."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def record(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            self.metrics.requests.labels(_route_label(scope["path"]), str(status[0])).inc()


def create_app(config: ServerConfig, pool: WorkerPool) -> FastAPI:
    service = Service(config, pool)
    app = FastAPI(title="pcgtts", version=pcgtts.__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    install_handlers(app)
    app.add_middleware(_LimitSpeechBodies, limit=config.max_speech_body_bytes)
    app.add_middleware(_CountRequests, metrics=service.metrics)  # outermost: it counts the 413s too

    def auth(request: Request) -> None:
        service.check_key(request.headers.get("authorization"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "version": pcgtts.__version__, "workers": pool.size, "streams": pool.seats,
                "busy": pool.busy, "queued": pool.waiting}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(service.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/audio/speech", dependencies=[Depends(auth)])
    async def speech(body: SpeechBody):
        if body.speed != 1.0:
            raise APIError(400, "speed must be 1.0: pcgtts does not change the speaking rate (resampling "
                           "would shift the pitch)", "speed", "unsupported_value")
        if body.response_format not in FORMATS:
            raise APIError(400, f"response_format {body.response_format!r} is not supported; use one of "
                           f"{', '.join(FORMATS)}", "response_format", "unsupported_value")
        if body.stream_format == "sse" and body.response_format == "flac":
            raise APIError(400, "stream_format 'sse' sends base64 PCM deltas; use response_format pcm or wav",
                           "response_format", "unsupported_value")
        if body.instructions:
            raise APIError(400, "instructions are not supported by this model", "instructions",
                           "unsupported_value")
        job = service.make_job(body.input, body.voice, body.policy, body.seed, body.temperature)
        encoder = Encoder("pcm" if body.stream_format == "sse" else body.response_format, config.sample_rate)
        chunks = await first_chunk_ready(await service.begin(job))
        headers = {"Cache-Control": "no-store", "X-Sample-Rate": str(config.sample_rate)}

        if body.stream_format == "sse":
            async def events():
                try:
                    async for chunk in chunks:
                        yield sse_delta(encoder.chunk(chunk.samples, chunk.is_last))
                except Exception:
                    log.exception("a speech stream failed after its first chunk; its SSE stream ends with an error")
                    yield sse_event({"type": "error", "error": APIError(
                        500, "speech synthesis failed (details are in the server log); the audio is cut", None,
                        "internal_error").body()["error"]})
                    return
                if job.timed_out:
                    yield sse_event({"type": "error", "error": APIError(
                        504, "the request passed the server's time limit; the audio is cut", None,
                        "timeout").body()["error"]})
                    return
                yield sse_event({"type": "speech.audio.done", "usage": service.usage(job)})

            return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

        async def audio():
            header = encoder.header()
            if header:
                yield header
            try:
                async for chunk in chunks:
                    data = encoder.chunk(chunk.samples, chunk.is_last)
                    if data:
                        yield data
            except Exception:
                log.exception("a speech stream failed after its first chunk; its transfer is cut")
                raise CutStream from None
            if job.timed_out:  # logged by the service; the client sees an incomplete body, not a short one
                raise CutStream
            tail = encoder.finish()
            if tail:
                yield tail

        return CuttableStreamingResponse(audio(), media_type=encoder.media_type, headers=headers)

    @app.get("/v1/audio/voices", dependencies=[Depends(auth)])
    async def list_voices():
        return {"voices": await run_in_threadpool(service.voices.list)}

    @app.post("/v1/audio/voices", dependencies=[Depends(auth)], status_code=201)
    async def add_voice(request: Request):
        length = request.headers.get("content-length")
        if length is None:
            raise APIError(411, "voice uploads need a Content-Length header", None, "length_required")
        if not length.isdigit() or int(length) > config.max_upload_bytes:
            raise too_large(config.max_upload_bytes, "upload", "audio")
        try:
            form = await request.form(max_files=1, max_fields=4)
        except Exception as err:  # malformed multipart bodies
            raise APIError(400, f"expected a multipart form with fields audio, text and name ({err})", None,
                           "invalid_form") from None
        name, text, upload = form.get("name"), form.get("text"), form.get("audio")
        for field, value, kind in (("name", name, str), ("text", text, str), ("audio", upload, None)):
            if value is None or (kind is str and not isinstance(value, str)) or (kind is None and isinstance(value, str)):
                raise APIError(400, f"missing form field {field!r} ({'a file' if kind is None else 'text'})", field,
                               "missing_field")
        try:
            check_name(name)
        except ValueError as err:
            raise APIError(400, str(err), "name", "invalid_value") from None
        if service.voices.is_builtin(name):
            raise APIError(400, f"{name!r} is a built-in voice name; choose another", "name", "invalid_value")
        if service.voices.path(name).exists():
            raise APIError(409, f"voice {name!r} already exists; DELETE it first", "name", "voice_exists")
        suffix = "." + upload.filename.rsplit(".", 1)[-1][:8] if upload.filename and "." in upload.filename else ""
        try:
            with spooled_to_file(upload.file, suffix) as tmp:
                try:
                    voice = await run_in_threadpool(service.voices.add, name, tmp.name, text,
                                                    config.max_upload_seconds)
                except UploadError as err:
                    status, code = (409, "voice_exists") if isinstance(err, VoiceExists) else (400, "invalid_value")
                    raise APIError(status, str(err).replace(tmp.name, "the uploaded audio"), err.param,
                                   code) from None
        except CannotEncode as err:
            log.warning("a voice upload was refused: the server cannot encode reference recordings: %s", err)
            raise APIError(501, "this server cannot encode reference recordings (its codec has no encoder; the "
                           "server log says why): make the voice with `pcgtts voice add` and copy the .voice file "
                           "into the server's voices folder", "audio", "voices_unavailable") from None
        finally:
            await upload.close()
        return JSONResponse({"name": name, "tokens": int(len(voice.codes)), "seconds": round(len(voice.codes) / 50, 2),
                             "text": voice.text}, status_code=201)

    @app.delete("/v1/audio/voices/{name}", dependencies=[Depends(auth)])
    async def delete_voice(name: str):
        try:
            service.voices.delete(name)
        except KeyError:
            raise APIError(404, f"voice {name!r} not found", "name", "voice_not_found") from None
        except ValueError as err:
            raise APIError(400, str(err), "name", "invalid_value") from None
        return {"name": name, "deleted": True}

    @app.websocket("/v1/audio/speech/stream")
    async def speech_stream(websocket: WebSocket):
        from pcgtts.serve.websocket import run_session

        await run_session(websocket, service)

    return app
