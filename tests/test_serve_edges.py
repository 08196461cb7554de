"""The speech server's edges: voices made on a server whose codec is an ONNX export (as the default
server's is), every numeric request field refused out of range before any response byte, and
runtime failures answered with an error (a status before any audio, a cut transfer or an error
message after it), never 200 headers and a silently broken body.

The voice test drives a real `pcgtts serve` process on 127.0.0.1; the failure tests a real uvicorn
in this process (their fault is injected into the worker's stream)."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from serve_helpers import assert_openai_error, auth, read_wav, start_server, websocket_session  # noqa: E402

from pcgtts.runtime.config import MAX_SEED, MAX_TEMPERATURE  # noqa: E402

REF_TEXT = "A reference recording."


@pytest.fixture(scope="module")
def full_vocab_target(tmp_path_factory):
    """A tiny LM with all 65,536 speech tokens, so voices the codec encodes fit it (seconds to make)."""
    from pcgtts.tools.demo import DemoLMConfig, build_demo_tokenizer, write_demo_lm

    config = DemoLMConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    return write_demo_lm(tmp_path_factory.mktemp("full_vocab") / "target", config, tokenizer=build_demo_tokenizer())


@pytest.fixture(scope="module")
def exported_codec(demo_codec_dir, tmp_path_factory):
    """The tiny codec's decoder exported for onnxruntime (`pcgtts export codec`), as the built-in
    voice's is on a CPU; its metadata names the checkpoint it came from."""
    from pcgtts.export.codec_graph import export_codec

    out = tmp_path_factory.mktemp("codec_onnx") / "codec"
    export_codec(demo_codec_dir, out)
    return out


@pytest.fixture(scope="module")
def reference_wav(tmp_path_factory):
    import soundfile as sf

    t = np.arange(16000 * 2) / 16000
    path = tmp_path_factory.mktemp("ref") / "anna.wav"
    sf.write(path, 0.3 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t)), 16000)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cli_server(full_vocab_target, exported_codec, tmp_path_factory):
    """`pcgtts serve` as a process: the LM on torch, the codec an ONNX export (decoder only)."""
    voices = tmp_path_factory.mktemp("voices")
    port = free_port()
    log_path = tmp_path_factory.mktemp("log") / "serve.log"
    cli = [sys.executable, "-c", "import sys; from pcgtts.cli import main; sys.exit(main())"]
    args = ["serve", "--port", str(port), "--target", str(full_vocab_target), "--codec", str(exported_codec),
            "--policy", "ar", "--max-tokens", "40", "--max-length", "1024", "--threads", "1",
            "--voices-dir", str(voices)]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(cli + args, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, f"pcgtts serve exited: {log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"pcgtts serve did not start: {log_path.read_text()[-3000:]}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url, voices, log_path
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@pytest.mark.slow  # an end-to-end run in subprocesses: the slow step of CI
def test_voices_are_made_on_a_server_whose_codec_is_an_onnx_export(cli_server, reference_wav, demo_codec_dir):
    """README's voice upload on a server like the default one (exported codec decoder): encoded by
    the checkpoint the export came from, as `pcgtts speak --ref-audio` does; listed, spoken with,
    deleted."""
    from pcgtts.runtime.audio.codec import Codec
    from pcgtts.runtime.audio.voice import Voice

    url, voices_dir, _ = cli_server
    upload = httpx.post(f"{url}/v1/audio/voices", data={"name": "anna", "text": REF_TEXT},
                        files={"audio": ("anna.wav", reference_wav.read_bytes(), "audio/wav")}, timeout=120)
    assert upload.status_code == 201, upload.text
    assert upload.json()["name"] == "anna" and upload.json()["tokens"] >= 90  # 2 s at 50 tokens/s
    speak_codes = Voice.from_audio(reference_wav, REF_TEXT, Codec.from_pretrained(demo_codec_dir, decode_only=False)).codes
    assert np.array_equal(Voice.load(voices_dir / "anna.voice").codes, speak_codes)

    listed = {v["name"]: v for v in httpx.get(f"{url}/v1/audio/voices").json()["voices"]}
    assert listed["anna"]["text"] == REF_TEXT and not listed["anna"]["builtin"]

    speech = httpx.post(f"{url}/v1/audio/speech", timeout=120,
                        json={"input": "Spoken in the new voice.", "voice": "anna", "seed": 1})
    assert speech.status_code == 200, speech.text
    rate, samples = read_wav(speech.content)
    assert rate == 24000 and len(samples) > 0.3 * 24000 and np.abs(samples).max() > 0

    assert httpx.delete(f"{url}/v1/audio/voices/anna").json() == {"name": "anna", "deleted": True}
    assert "anna" not in {v["name"] for v in httpx.get(f"{url}/v1/audio/voices").json()["voices"]}
    gone = httpx.post(f"{url}/v1/audio/speech", json={"input": "Hi.", "voice": "anna"}, timeout=60)
    assert assert_openai_error(gone, 400, "voice")["code"] == "voice_not_found"


def test_a_server_that_cannot_encode_says_so_with_a_501(tiny_lm_factory, exported_codec, reference_wav, tmp_path):
    """An exported codec whose checkpoint is gone cannot encode: the upload is answered 501 naming
    why, not a 400 blaming the client's transcript."""
    orphan = tmp_path / "codec"
    shutil.copytree(exported_codec, orphan)
    meta_path = orphan / "pcgtts-codec.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "source": str(tmp_path / "deleted-checkpoint")}))
    running = start_server(tiny_lm_factory(), orphan, tmp_path / "voices")
    try:
        upload = httpx.post(f"{running.url}/v1/audio/voices", headers=auth(), data={"name": "anna", "text": REF_TEXT},
                            files={"audio": ("anna.wav", reference_wav.read_bytes(), "audio/wav")}, timeout=60)
        error = assert_openai_error(upload, 501, "audio")
        assert error["code"] == "voices_unavailable" and "cannot" in error["message"]
        assert "\n" not in error["message"] and not list((tmp_path / "voices").iterdir())
    finally:
        running.stop()


def test_two_uploads_of_one_name_keep_the_first(demo_codec_dir, reference_wav, tmp_path):
    """The store checks the name under its encode lock, so a second upload racing past the route's
    check is refused rather than silently replacing the first voice."""
    from pcgtts.runtime.audio.codec import Codec
    from pcgtts.serve.voices import VoiceExists, VoiceStore

    store = VoiceStore(tmp_path, lambda: Codec.from_pretrained(demo_codec_dir, decode_only=False))
    first = store.add("anna", reference_wav, REF_TEXT, 30)
    with pytest.raises(VoiceExists, match="already exists"):
        store.add("anna", reference_wav, "Another transcript.", 30)
    assert store.get("anna").text == first.text == REF_TEXT


# -- numeric fields ------------------------------------------------------------------------------

OUT_OF_RANGE = [
    ("seed", 2**80), ("seed", MAX_SEED + 1), ("seed", -1), ("seed", 10**4000), ("seed", "5"), ("seed", 1.5),
    ("seed", True),
    ("temperature", MAX_TEMPERATURE + 0.5), ("temperature", 1e6), ("temperature", -0.5), ("temperature", "hot"),
    ("temperature", True), ("temperature", [1]),
    ("speed", 5.0), ("speed", -1), ("speed", 0), ("speed", "fast"), ("speed", True),
    ("policy", "fast"), ("policy", 5),
]


def assert_refused_before_any_byte(url, body, param):
    """A 400 with a one-line OpenAI error naming `param`, and no audio: checked on the raw stream, so
    a 200 sent before the settings were checked cannot pass."""
    with httpx.stream("POST", f"{url}/v1/audio/speech", content=body, timeout=60,
                      headers={"Content-Type": "application/json", **auth()}) as response:
        assert response.status_code == 400, response.status_code
        assert response.headers["content-type"] == "application/json"
        response.read()
    error = assert_openai_error(response, 400)
    assert error["param"] == param, error
    assert "\n" not in error["message"] and len(error["message"]) <= 200, error["message"]
    return error


@pytest.fixture(scope="module")
def server(tiny_lm_factory, demo_codec_dir, tmp_path_factory):
    running = start_server(tiny_lm_factory(), demo_codec_dir, tmp_path_factory.mktemp("voices"))
    yield running
    running.stop()


@pytest.mark.parametrize("field, value", OUT_OF_RANGE, ids=[f"{f}={str(v)[:12]}" for f, v in OUT_OF_RANGE])
def test_each_numeric_field_out_of_range_is_a_400_before_any_byte(server, field, value):
    body = json.dumps({"input": "Hi there.", "response_format": "pcm", field: value})
    error = assert_refused_before_any_byte(server.url, body, field)
    assert field in error["message"]


def test_numbers_json_cannot_hold_in_a_float_or_an_int_are_refused(server):
    """1e400 parses as infinity; an integer of 5,000 digits is past Python's parse limit."""
    assert_refused_before_any_byte(server.url, '{"input": "Hi.", "temperature": 1e400}', "temperature")
    assert_refused_before_any_byte(server.url, '{"input": "Hi.", "temperature": NaN}', "temperature")
    response = httpx.post(f"{server.url}/v1/audio/speech", headers={"Content-Type": "application/json", **auth()},
                          content='{"input": "Hi.", "seed": ' + "9" * 5000 + "}", timeout=30)
    assert_openai_error(response, 400)


@pytest.mark.parametrize("field", ["top_p", "draft_length", "max_tokens", "max_new_tokens"])
def test_settings_the_server_does_not_take_per_request_are_refused_not_ignored(server, field):
    assert_refused_before_any_byte(server.url, json.dumps({"input": "Hi.", field: 0.5}), field)


def test_the_ranges_edges_are_served(server):
    for extra in ({"seed": 0}, {"seed": MAX_SEED}, {"temperature": 0}, {"temperature": MAX_TEMPERATURE}):
        response = httpx.post(f"{server.url}/v1/audio/speech", headers=auth(), timeout=60,
                              json={"input": "Hi there.", "response_format": "pcm", **extra})
        assert response.status_code == 200 and len(response.content) > 0, (extra, response.text)


def test_websocket_config_out_of_range_is_an_error_message_and_the_session_goes_on(server):
    pytest.importorskip("websockets")
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream", additional_headers=auth(),
                 open_timeout=10) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "ready"
        bad = [("seed", 2**80), ("seed", -1), ("seed", "5"), ("seed", True), ("temperature", MAX_TEMPERATURE + 1),
               ("temperature", "hot"), ("policy", "fast")]
        for field, value in bad:
            ws.send(json.dumps({"type": "config", field: value}))
            error = json.loads(ws.recv(timeout=10))
            assert error["type"] == "error" and error["error"]["param"] == field, (field, value, error)
            assert "\n" not in error["error"]["message"] and len(error["error"]["message"]) <= 200
        ws.send(json.dumps({"type": "config", "top_p": 0.5}))
        assert "top_p" in json.loads(ws.recv(timeout=10))["error"]["message"]
        ws.send(json.dumps({"type": "config", "seed": MAX_SEED, "temperature": MAX_TEMPERATURE}))
        ws.send(json.dumps({"type": "text", "text": "Still here."}))
        ws.send(json.dumps({"type": "end"}))
        kinds = []
        while (m := ws.recv(timeout=60)) and (isinstance(m, bytes) or json.loads(m)["type"] != "done"):
            kinds.append("audio" if isinstance(m, bytes) else json.loads(m)["type"])
    assert kinds[0] == "sentence.start" and "audio" in kinds and kinds[-1] == "sentence.end"


def test_websocket_frames_it_cannot_read_are_answered_and_the_session_goes_on(server):
    """A binary frame, a text that is not a string or a number past Python's parse limit once ended
    the session without a word (a traceback in the log)."""
    pytest.importorskip("websockets")
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream", additional_headers=auth(),
                 open_timeout=10) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "ready"
        for frame, param in ((b"\x00\x01 binary", "type"), (json.dumps({"type": "text", "text": 5}), "text"),
                             ('{"type": "config", "seed": ' + "9" * 5000 + "}", "type")):
            ws.send(frame)
            error = json.loads(ws.recv(timeout=10))
            assert error["type"] == "error" and error["error"]["param"] == param, (frame[:20], error)
        ws.send(json.dumps({"type": "end"}))
        assert json.loads(ws.recv(timeout=10)) == {"type": "done"}


# -- runtime failures -----------------------------------------------------------------------------

class FailingStream:
    """A real runtime stream that raises after `after` chunks (a fault in the decode or codec)."""

    def __init__(self, stream, after: int):
        self.stream, self.after, self.stats = stream, after, stream.stats

    def __iter__(self):
        for index, chunk in enumerate(self.stream):
            if index == self.after:
                raise RuntimeError("the codec window failed")
            yield chunk

    def close(self):
        self.stream.close()


def fail_after(monkeypatch, pool, after):
    real_open = pool.open
    monkeypatch.setattr(pool, "open", lambda synth, job: FailingStream(real_open(synth, job), after))


def wait_idle(pool, seconds=15):
    deadline = time.monotonic() + seconds
    while pool.busy:
        assert time.monotonic() < deadline, "the worker was not freed"
        time.sleep(0.02)


def serve_errors(caplog):
    return [r for r in caplog.records if r.name.startswith("pcgtts.serve") and r.levelno >= logging.ERROR]


def test_a_stream_that_fails_before_any_audio_is_a_500_not_200(server, monkeypatch, caplog):
    fail_after(monkeypatch, server.pool, 0)
    with caplog.at_level(logging.ERROR):
        response = httpx.post(f"{server.url}/v1/audio/speech", headers=auth(), timeout=60,
                              json={"input": "Hi there.", "response_format": "wav"})
    error = assert_openai_error(response, 500)
    assert error["code"] == "internal_error" and "server log" in error["message"]
    wait_idle(server.pool)
    logged = serve_errors(caplog)
    assert len(logged) == 1 and logged[0].exc_info and "first chunk" in logged[0].getMessage()


def test_a_stream_that_fails_after_audio_cuts_the_transfer_and_logs_once(server, monkeypatch, caplog):
    fail_after(monkeypatch, server.pool, 1)
    with caplog.at_level(logging.ERROR):
        with pytest.raises(httpx.RemoteProtocolError):  # an incomplete body, not a short one that looks whole
            with httpx.stream("POST", f"{server.url}/v1/audio/speech", headers=auth(), timeout=60,
                              json={"input": "Hi there, a longer sentence to speak.", "response_format": "pcm"}) as r:
                assert r.status_code == 200
                for _ in r.iter_raw():
                    pass
        wait_idle(server.pool)
    logged = serve_errors(caplog)
    assert len(logged) == 1 and "transfer is cut" in logged[0].getMessage()


def test_an_sse_stream_that_fails_after_audio_ends_with_an_error_event(server, monkeypatch):
    fail_after(monkeypatch, server.pool, 1)
    events = []
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", headers=auth(), timeout=60,
                      json={"input": "Hi there, a longer sentence to speak.", "stream_format": "sse",
                            "response_format": "pcm"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "internal_error"
    wait_idle(server.pool)


def test_a_websocket_sentence_that_fails_is_reported_and_closes_1011(server, monkeypatch):
    pytest.importorskip("websockets")
    from websockets.exceptions import ConnectionClosedError
    from websockets.sync.client import connect

    fail_after(monkeypatch, server.pool, 0)
    with connect(f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream", additional_headers=auth(),
                 open_timeout=10) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "ready"
        ws.send(json.dumps({"type": "text", "text": "This sentence fails. "}))
        assert json.loads(ws.recv(timeout=30))["type"] == "sentence.start"
        error = json.loads(ws.recv(timeout=30))
        assert error["type"] == "error" and error["error"]["code"] == "internal_error"
        with pytest.raises(ConnectionClosedError):
            ws.recv(timeout=10)
        assert ws.close_code == 1011
    wait_idle(server.pool)


# -- input past the server's limits ---------------------------------------------------------------

SMALL_LIMIT = 100  # max_input_chars of `small_server`


@pytest.fixture(scope="module")
def small_server(tiny_lm_factory, demo_codec_dir, tmp_path_factory):
    running = start_server(tiny_lm_factory(), demo_codec_dir, tmp_path_factory.mktemp("voices"),
                           max_input_chars=SMALL_LIMIT, max_new_tokens=4)
    yield running
    running.stop()


def test_websocket_text_past_the_limit_without_a_sentence_end_is_spoken_in_pieces(small_server):
    pytest.importorskip("websockets")
    words = [f"word{i}" for i in range(40)]  # ~270 characters, no sentence end
    text = " ".join(words)
    parts = [text[i:i + 90] for i in range(0, len(text), 90)]  # each message within the limit, cut mid-word
    received, audio = websocket_session(small_server, [{"type": "text", "text": p} for p in parts])
    assert [m for m in received if m["type"] == "error"] == []
    spoken = [m["text"] for m in received if m["type"] == "sentence.start"]
    assert len(spoken) >= 3 and all(len(s) <= SMALL_LIMIT for s in spoken), spoken
    assert " ".join(spoken).split() == words  # every word once, in order, none cut in two
    assert audio > 0


def test_a_speech_body_past_the_limit_is_a_413_from_its_content_length_before_it_is_read(small_server):
    """The header promises 200 MB and the body never comes: the answer must not wait for it."""
    limit = 12 * SMALL_LIMIT + 64 * 1024
    with socket.create_connection(("127.0.0.1", small_server.port), timeout=10) as sock:
        sock.sendall((f"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      f"Authorization: {auth()['Authorization']}\r\nContent-Length: {200 * 1024 * 1024}\r\n\r\n"
                      '{"input": "').encode())
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:200]
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large" and str(limit) in error["message"]


def chunked(data: bytes, size: int = 8192):
    for i in range(0, len(data), size):
        yield data[i:i + size]


def test_a_chunked_speech_body_is_cut_off_at_the_limit(small_server):
    body = json.dumps({"input": "a " * 200_000}).encode()  # 400 kB, sent without a Content-Length
    response = httpx.post(f"{small_server.url}/v1/audio/speech", content=chunked(body), timeout=30,
                          headers={"Content-Type": "application/json", **auth()})
    assert "content-length" not in response.request.headers
    assert_openai_error(response, 413)
    small = json.dumps({"input": "Hi there.", "response_format": "pcm"}).encode()
    response = httpx.post(f"{small_server.url}/v1/audio/speech", content=chunked(small, 5), timeout=60,
                          headers={"Content-Type": "application/json", **auth()})
    assert response.status_code == 200 and len(response.content) > 0, response.text
