"""`WS /v1/audio/speech/stream`: text that arrives piece by piece (e.g. from an LLM) is spoken
sentence by sentence, each as soon as it is complete.

Client -> server (JSON text frames):
    {"type": "config", "voice": "default", "policy": "pcg", "seed": 1, "temperature": 0.8}  (optional, first)
    {"type": "text", "text": "Hello th"}   appended to the buffer; complete sentences are queued
    {"type": "flush"}                      speak what is buffered even without a sentence end
    {"type": "end"}                        flush, finish every queued sentence, then close
Server -> client:
    {"type": "ready", "sample_rate": 24000, "format": "pcm_s16le"}
    {"type": "sentence.start", "index": 0, "text": "..."}
    binary frames: PCM16 little-endian mono at `sample_rate`, as generated
    {"type": "sentence.end", "index": 0, "audio_seconds": ..., "time_to_first_audio_s": ..., "real_time_factor": ...}
    {"type": "error", "error": {OpenAI error fields}}   (a queue-full error closes with 1013, a
                                           sentence the runtime fails on with 1011; a bad message
                                           or config, binary frames included, or a sentence the
                                           model makes no speech for (code empty_synthesis) leaves
                                           the session open)
    {"type": "done"}                       then the server closes (1000)

A sentence is complete at `.`, `!`, `?` (and their CJK forms) followed by whitespace, the same
boundary as runtime/text/split.py; text past the server's input limit with no sentence end is spoken
in pieces within it, split at clauses, then words. Each sentence holds a worker only while it is spoken, so an
idle session waiting for text holds none. A disconnect cancels the sentence being spoken.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re

from starlette.websockets import WebSocket, WebSocketDisconnect

from pcgtts.runtime.synthesizer import EmptySynthesis
from pcgtts.runtime.text.split import split_sentences
from pcgtts.serve.encode import Encoder
from pcgtts.serve.errors import APIError
from pcgtts.serve.service import REQUEST_SETTINGS

log = logging.getLogger(__name__)

SENTENCE_END = re.compile(r"(?<=[.!?。！？])\s+")
_STOP = None


def take_sentences(buffer: str) -> tuple[list[str], str]:
    """(complete sentences, the unfinished rest) of the text received so far."""
    parts = SENTENCE_END.split(buffer)
    return [p.strip() for p in parts[:-1] if p.strip()], parts[-1]


def split_unfinished(buffer: str, limit: int) -> tuple[list[str], str]:
    """(pieces to speak now, the rest to keep) of text longer than `limit` with no sentence end: split
    at clauses, then words (runtime/text/split.py), each piece within `limit`; the last piece, which
    may end in a word still arriving, stays in the buffer."""
    pieces = split_sentences(buffer, limit)
    if len(pieces) > 1 and not buffer[-1:].isspace():
        return pieces[:-1], pieces[-1]
    return pieces, ""


async def run_session(ws: WebSocket, service) -> None:
    try:
        service.check_key(ws.headers.get("authorization") or
                          (f"Bearer {ws.query_params['api_key']}" if "api_key" in ws.query_params else None))
    except APIError as err:
        await ws.accept()
        await ws.send_json({"type": "error", **err.body()})
        await ws.close(code=1008)
        service.metrics.requests.labels("/v1/audio/speech/stream", "401").inc()
        return
    await ws.accept()
    rate = service.config.sample_rate
    await ws.send_json({"type": "ready", "sample_rate": rate, "format": "pcm_s16le"})
    options = {"voice": "default", **dict.fromkeys(REQUEST_SETTINGS)}  # what a config message may set
    sentences: asyncio.Queue = asyncio.Queue()
    speaker = asyncio.create_task(_speak_all(ws, service, sentences, options))
    buffer, status = "", "1000"
    limit = service.config.max_input_chars
    try:
        while True:
            receive = asyncio.create_task(_receive_text(ws))
            done, _ = await asyncio.wait({receive, speaker}, return_when=asyncio.FIRST_COMPLETED)
            if speaker in done:  # it stopped on an error it already reported
                receive.cancel()
                status = "error"
                if not speaker.cancelled() and speaker.exception() is not None:
                    log.error("websocket speaker stopped: %s", speaker.exception())
                break
            text = receive.result()
            if text is None:
                await _error(ws, APIError(400, "messages are JSON text frames; binary frames are not accepted", "type",
                                          "invalid_value"))
                continue
            try:
                message = json.loads(text)
                kind = message.get("type") if isinstance(message, dict) else None
            except ValueError:  # not JSON, or a number past Python's parse limit
                kind = None
            if kind == "config":
                unknown = set(message) - set(options) - {"type"}
                if unknown:
                    await _error(ws, APIError(400, f"unknown config fields: {', '.join(sorted(unknown))}", None,
                                              "invalid_value"))
                    continue
                try:  # validated now (voice exists, policy known), not at the first sentence
                    service.make_job("Check.", **{k: message.get(k, options[k]) for k in options})
                except APIError as err:
                    await _error(ws, err)
                    continue
                options.update({k: message[k] for k in options if k in message})
            elif kind == "text":
                if not isinstance(message.get("text"), str):
                    await _error(ws, APIError(400, "a text message needs a string field text", "text",
                                              "invalid_value"))
                    continue
                if len(message["text"]) > limit:
                    await _error(ws, APIError(400, f"a text message may hold at most {limit} characters", "text",
                                              "string_above_max_length"))
                    continue
                buffer += message["text"]
                complete, buffer = take_sentences(buffer)
                if len(buffer) > limit:  # no sentence end in sight: speak it in pieces within the limit
                    try:
                        pieces, buffer = split_unfinished(buffer, limit)
                    except ValueError as err:  # nothing pronounceable in it
                        await _error(ws, APIError(400, f"text: {err}", "text", "invalid_value"))
                        pieces, buffer = [], ""
                    complete += pieces
                for sentence in complete:
                    sentences.put_nowait(sentence)
            elif kind in ("flush", "end"):
                if buffer.strip():
                    sentences.put_nowait(buffer.strip())
                buffer = ""
                if kind == "end":
                    sentences.put_nowait(_STOP)
                    await speaker
                    await ws.send_json({"type": "done"})
                    await ws.close(code=1000)
                    break
            else:
                await _error(ws, APIError(400, "each message is JSON with type config, text, flush or end", "type",
                                          "invalid_value"))
    except WebSocketDisconnect:
        status = "disconnect"
    except Exception:
        status = "error"
        log.exception("websocket session failed")
    finally:
        if not speaker.done():
            speaker.cancel()  # cancels the sentence being spoken: its worker is freed
            try:
                await speaker
            except BaseException:
                pass
        service.metrics.requests.labels("/v1/audio/speech/stream", status).inc()


async def _receive_text(ws: WebSocket) -> str | None:
    """The next text frame (None for a binary frame); WebSocketDisconnect once the client has left."""
    message = await ws.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000), message.get("reason"))
    return message.get("text")


async def _error(ws: WebSocket, err: APIError) -> None:
    await ws.send_json({"type": "error", **err.body()})


async def _speak_all(ws: WebSocket, service, sentences: asyncio.Queue, options: dict) -> None:
    """Speak queued sentences in order until the stop marker; errors are sent, then end the task."""
    index = 0
    while (text := await sentences.get()) is not _STOP:
        try:
            job = service.make_job(text, **options)
        except APIError as err:  # e.g. a piece with nothing pronounceable: report, go on
            await _error(ws, err)
            continue
        try:
            chunks = await service.begin(job)
        except APIError as err:
            await _error(ws, err)
            if err.status in (429, 503):
                await ws.close(code=1013)  # try again later
                return
            continue
        encoder = Encoder("pcm", service.config.sample_rate)
        await ws.send_json({"type": "sentence.start", "index": index, "text": job.text})
        try:
            async for chunk in chunks:
                await ws.send_bytes(encoder.chunk(chunk.samples, chunk.is_last))
        except WebSocketDisconnect:
            raise
        except EmptySynthesis as err:  # nothing was sent for it: say so, and go on with the next sentence
            log.warning("a websocket sentence produced no audio: %s", err)
            await _error(ws, APIError(422, f"sentence {index}: no speech: {err}", "text", "empty_synthesis"))
            index += 1
            continue
        except Exception:  # the runtime failed: say so and close (1011), rather than a silent close
            log.exception("a websocket sentence failed while it was spoken")
            await _error(ws, APIError(500, f"speech synthesis failed in sentence {index} (details are in the server "
                                      "log); the session is closed", None, "internal_error"))
            await ws.close(code=1011)
            return
        stats = job.stats
        await ws.send_json({"type": "sentence.end", "index": index, "audio_seconds": encoder.samples_out / encoder.rate,
                            "time_to_first_audio_s": job.time_to_first_audio,
                            "real_time_factor": stats.real_time_factor if stats else None,
                            "timed_out": job.timed_out})
        index += 1
