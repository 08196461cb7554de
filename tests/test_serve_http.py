"""The speech server against a real uvicorn on 127.0.0.1 (tiny random-weight models: audio is
checked for format, validity and timing, not content), driven by httpx, the official openai
client and a websockets client."""

from __future__ import annotations

import io
import json
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from serve_helpers import KEY, assert_openai_error, auth, read_wav, start_server  # noqa: E402


@pytest.fixture(scope="module")
def tiny_target(tiny_lm_factory):
    return tiny_lm_factory()


@pytest.fixture(scope="module")
def server(tiny_target, demo_codec_dir, tmp_path_factory):
    running = start_server(tiny_target, demo_codec_dir, tmp_path_factory.mktemp("voices"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def long_server(tiny_target, demo_codec_dir, tmp_path_factory):
    """One worker, one queue slot, long utterances: for disconnect and queue-full checks."""
    running = start_server(tiny_target, demo_codec_dir, tmp_path_factory.mktemp("voices"), queue_size=1,
                           max_new_tokens=1500, api_key=None)
    yield running
    running.stop()


def test_wav_streams_before_the_utterance_is_done(server):
    arrivals, body = [], b""
    started = time.perf_counter()
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", headers=auth(), timeout=60,
                      json={"model": "pcgtts", "input": "Hello there, streaming world.", "voice": "default",
                            "response_format": "wav", "seed": 3}) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
        for piece in r.iter_raw():
            arrivals.append(time.perf_counter() - started)
            body += piece
    rate, samples = read_wav(body)
    assert rate == 24000 and len(samples) > 0.5 * 24000  # 40 tokens = 0.8 s
    assert np.abs(samples).max() > 0
    # audio arrived in several pieces, not as one block at the end (no timing margin asserted: on a
    # loaded 2-core machine the pieces may bunch; their order in time is what streaming guarantees)
    assert len(arrivals) >= 3 and arrivals[1] < arrivals[-1]
    # soundfile reads the streamed header
    import soundfile as sf

    audio, sr = sf.read(io.BytesIO(body), dtype="int16")
    assert sr == 24000 and abs(len(audio) - len(samples)) <= 1


def test_pcm_and_flac_and_same_seed_same_audio(server):
    import soundfile as sf

    body = {"input": "Same seed twice.", "voice": "alloy", "seed": 7, "temperature": 0.7}
    pcm1 = httpx.post(f"{server.url}/v1/audio/speech", headers=auth(), json={**body, "response_format": "pcm"}, timeout=60)
    pcm2 = httpx.post(f"{server.url}/v1/audio/speech", headers=auth(), json={**body, "response_format": "pcm"}, timeout=60)
    flac = httpx.post(f"{server.url}/v1/audio/speech", headers=auth(), json={**body, "response_format": "flac"}, timeout=60)
    assert pcm1.status_code == pcm2.status_code == flac.status_code == 200
    assert len(pcm1.content) % 2 == 0 and len(pcm1.content) > 1000 and pcm1.content == pcm2.content
    audio, rate = sf.read(io.BytesIO(flac.content), dtype="int16")
    assert rate == 24000 and np.array_equal(audio, np.frombuffer(pcm1.content, "<i2"))


def test_openai_client_streams(server, tmp_path):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    out = tmp_path / "speech.wav"
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input="Hi from the client.",
                                                            response_format="wav") as response:
        pieces = list(response.iter_bytes())
    data = b"".join(pieces)
    out.write_bytes(data)
    rate, samples = read_wav(data)
    assert rate == 24000 and len(samples) > 0
    with pytest.raises(openai.BadRequestError) as err:  # OpenAI error JSON parsed by the client
        client.audio.speech.create(model="tts-1", voice="nobody", input="Hi.")
    assert err.value.body["code"] == "voice_not_found"
    bad_key = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong-key-000", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.audio.speech.create(model="tts-1", voice="alloy", input="Hi.")


def test_sse_deltas_and_usage(server):
    events = []
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", headers=auth(), timeout=60,
                      json={"input": "Events please.", "stream_format": "sse", "response_format": "pcm"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    import base64

    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2 and events[-1]["type"] == "speech.audio.done"
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    usage = events[-1]["usage"]
    assert usage["output_tokens"] > 0 and usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    # 320 samples per token at 16 kHz -> 480 at 24 kHz, 2 bytes each
    assert abs(len(pcm) // 2 - usage["output_tokens"] * 480) <= 480


def test_errors_are_openai_json(server):
    url = f"{server.url}/v1/audio/speech"
    assert_openai_error(httpx.post(url, headers=auth(), json={"input": "Hi.", "voice": "../etc/passwd"}), 400, "voice")
    assert_openai_error(httpx.post(url, headers=auth(), json={"input": "   ", "voice": "default"}), 400, "input")
    assert_openai_error(httpx.post(url, headers=auth(), json={"input": "x" * 5000}), 400, "input")
    assert_openai_error(httpx.post(url, headers=auth(), json={"input": "Hi.", "response_format": "mp3"}), 400,
                        "response_format")
    assert_openai_error(httpx.post(url, headers=auth(), json={"input": "Hi.", "speed": 1.5}), 400, "speed")
    assert_openai_error(httpx.post(url, headers=auth(), json={"input": "Hi.", "speed": 9}), 400, "speed")
    assert_openai_error(httpx.post(url, headers=auth(), json={"input": "Hi.", "policy": "pcg"}), 400)  # no draft loaded
    assert_openai_error(httpx.post(url, headers=auth(), json={"input": "Hi.", "temperature": -1}), 400, "temperature")
    assert_openai_error(httpx.post(url, headers=auth(), json={"input": "Hi.", "bogus": 1}), 400, "bogus")
    assert_openai_error(httpx.post(url, headers=auth(), content=b"{not json"), 400)
    assert assert_openai_error(httpx.post(url, json={"input": "Hi."}), 401)["code"] == "invalid_api_key"
    assert_openai_error(httpx.post(url, headers={"Authorization": "Bearer nope-nope-nope"}, json={"input": "Hi."}), 401)
    assert_openai_error(httpx.get(f"{server.url}/v1/nothing", headers=auth()), 404)
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"  # open without a key


def test_voices_add_list_use_delete(server, tmp_path):
    import soundfile as sf

    t = np.arange(16000 * 2) / 16000
    wav = tmp_path / "ref.wav"
    sf.write(wav, 0.3 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t)), 16000)
    url = f"{server.url}/v1/audio/voices"
    form = {"name": "tester_1", "text": "A reference recording."}
    r = httpx.post(url, headers=auth(), data=form, files={"audio": ("ref.wav", wav.read_bytes(), "audio/wav")}, timeout=120)
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "tester_1" and r.json()["tokens"] >= 90  # 2 s at 50 tokens/s
    names = [v["name"] for v in httpx.get(url, headers=auth()).json()["voices"]]
    assert "default" in names and "alloy" in names and "tester_1" in names
    from pcgtts.runtime.audio.voice import Voice

    stored = Voice.load(server.voices_dir / "tester_1.voice")
    assert stored.text == "A reference recording." and len(stored.codes) == r.json()["tokens"]
    # the tiny test model knows 512 speech tokens; the codec's tokens of this voice lie beyond them
    speech = httpx.post(f"{server.url}/v1/audio/speech", headers=auth(), timeout=60,
                        json={"input": "In the new voice.", "voice": "tester_1", "response_format": "pcm"})
    assert assert_openai_error(speech, 400, "voice")["code"] == "voice_incompatible"
    # a second upload under the same name, bad names, non-audio, oversize
    assert_openai_error(httpx.post(url, headers=auth(), data=form, files={"audio": ("r.wav", wav.read_bytes())}), 409, "name")
    for bad in ("../x", "a/b", "", "default", ".hidden"):
        assert_openai_error(httpx.post(url, headers=auth(), data={**form, "name": bad},
                                       files={"audio": ("r.wav", wav.read_bytes())}), 400, "name")
    assert_openai_error(httpx.post(url, headers=auth(), data={**form, "name": "noise"},
                                   files={"audio": ("r.wav", b"not audio at all" * 10)}), 400, "audio")
    assert_openai_error(httpx.post(url, headers=auth(), data={**form, "name": "huge"},
                                   files={"audio": ("r.wav", b"\0" * (11 * 1024 * 1024))}), 413, "audio")
    assert not list((tmp_path).glob("*.partial*"))
    assert httpx.delete(f"{url}/tester_1", headers=auth()).json() == {"name": "tester_1", "deleted": True}
    assert_openai_error(httpx.delete(f"{url}/tester_1", headers=auth()), 404, "name")
    assert_openai_error(httpx.delete(f"{url}/default", headers=auth()), 400, "name")


def test_websocket_speaks_sentences_as_they_complete(server):
    pytest.importorskip("websockets")
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream",
                 additional_headers=auth(), open_timeout=10) as ws:
        assert json.loads(ws.recv(timeout=10)) == {"type": "ready", "sample_rate": 24000, "format": "pcm_s16le"}
        ws.send(json.dumps({"type": "config", "voice": "default", "seed": 1}))
        for piece in ("The first sen", "tence is here. The sec"):
            ws.send(json.dumps({"type": "text", "text": piece}))
        # the first sentence is spoken before the rest of the text has even been sent
        start = json.loads(ws.recv(timeout=30))
        assert start == {"type": "sentence.start", "index": 0, "text": "The first sentence is here."}
        first_audio = ws.recv(timeout=30)
        assert isinstance(first_audio, bytes) and len(first_audio) > 0
        ws.send(json.dumps({"type": "text", "text": "ond one has no end"}))
        ws.send(json.dumps({"type": "end"}))
        messages, audio = [], {0: len(first_audio)}
        current = 0
        while True:
            m = ws.recv(timeout=60)
            if isinstance(m, bytes):
                audio[current] = audio.get(current, 0) + len(m)
                continue
            m = json.loads(m)
            messages.append(m)
            if m["type"] == "sentence.start":
                current = m["index"]
            if m["type"] == "done":
                break
    kinds = [(m["type"], m.get("index")) for m in messages]
    assert kinds == [("sentence.end", 0), ("sentence.start", 1), ("sentence.end", 1), ("done", None)]
    assert messages[1]["text"] == "The second one has no end"
    for index, end in ((0, messages[0]), (1, messages[2])):
        assert audio[index] % 2 == 0 and abs(audio[index] / 2 / 24000 - end["audio_seconds"]) < 1e-3
        assert end["audio_seconds"] > 0.3


def test_websocket_rejects_wrong_key_and_bad_messages(server):
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream", open_timeout=10) as ws:
        m = json.loads(ws.recv(timeout=10))
        assert m["type"] == "error" and m["error"]["code"] == "invalid_api_key"
    with connect(f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream?api_key={KEY}", open_timeout=10) as ws:
        json.loads(ws.recv(timeout=10))
        ws.send("not json")
        assert json.loads(ws.recv(timeout=10))["error"]["param"] == "type"
        ws.send(json.dumps({"type": "config", "voice": "missing"}))
        assert json.loads(ws.recv(timeout=10))["error"]["code"] == "voice_not_found"
        ws.send(json.dumps({"type": "end"}))
        assert json.loads(ws.recv(timeout=10)) == {"type": "done"}


def test_metrics_after_traffic(server):
    text = httpx.get(f"{server.url}/metrics").text
    assert 'pcgtts_requests_total{route="/v1/audio/speech",status="200"}' in text
    assert 'pcgtts_requests_total{route="/v1/audio/speech",status="400"}' in text
    for name in ("pcgtts_time_to_first_audio_seconds_bucket", "pcgtts_real_time_factor_count", "pcgtts_queue_depth",
                 "pcgtts_late_chunks_total", "pcgtts_acceptance_rate", "pcgtts_workers_busy"):
        assert name in text
    count = [line for line in text.splitlines() if line.startswith("pcgtts_time_to_first_audio_seconds_count")]
    assert float(count[0].split()[-1]) >= 3
    codec = [line for line in text.splitlines() if line.startswith("pcgtts_codec_seconds_total")]
    assert float(codec[0].split()[-1]) > 0  # the codec's time is counted


def test_disconnect_frees_the_worker_and_queue_full_is_429(long_server):
    url = f"{long_server.url}/v1/audio/speech"
    body = {"input": "A long utterance that would go on for quite a while. " * 3, "response_format": "pcm"}
    pool = long_server.pool
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200
        pieces = r.iter_raw()  # kept: dropping the iterator would close the connection
        next(pieces)  # audio is flowing: the worker is busy
        assert pool.busy == 1
        # one request may wait (queue_size=1); the next is refused at once with Retry-After
        waiting = threading.Thread(target=lambda: httpx.post(url, json={"input": "Queued.", "response_format": "pcm"},
                                                             timeout=60), daemon=True)
        waiting.start()
        deadline = time.monotonic() + 10
        while pool.waiting < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        refused = httpx.post(url, json={"input": "Refused.", "response_format": "pcm"}, timeout=10)
        assert_openai_error(refused, 429)
        assert int(refused.headers["Retry-After"]) >= 1 and refused.json()["error"]["code"] == "queue_full"
    # the client left mid-stream: the worker serves the queued request, then is idle again
    disconnected = time.monotonic()
    waiting.join(60)
    deadline = disconnected + 15
    while pool.busy:
        assert time.monotonic() < deadline, "the worker was not freed after the client disconnected"
        time.sleep(0.02)
    metrics = httpx.get(f"{long_server.url}/metrics").text
    assert 'pcgtts_cancelled_streams_total{reason="client"} 1.0' in metrics


def test_time_limit_cuts_the_stream_and_frees_the_worker(tiny_target, demo_codec_dir, tmp_path):
    running = start_server(tiny_target, demo_codec_dir, tmp_path, api_key=None, max_new_tokens=1500,
                           request_timeout_s=1.5)
    try:
        started = time.monotonic()
        with pytest.raises(httpx.RemoteProtocolError):  # an incomplete transfer, not a short "complete" one
            with httpx.stream("POST", f"{running.url}/v1/audio/speech", timeout=60,
                              json={"input": "A long utterance that would go on for quite a while. " * 3,
                                    "response_format": "pcm"}) as r:
                assert r.status_code == 200
                for _ in r.iter_raw():
                    pass
        assert time.monotonic() - started < 10
        deadline = time.monotonic() + 10
        while running.pool.busy:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert 'pcgtts_cancelled_streams_total{reason="time_limit"} 1.0' in httpx.get(f"{running.url}/metrics").text
    finally:
        running.stop()


def test_a_pools_workers_plan_with_one_set_of_step_costs(tiny_models, tiny_groups_file, tmp_path):
    """Each worker's load measures step costs, which differ by timing noise; the pool has every
    worker adopt the first one's, so a seeded request gives the same audio whichever worker takes it
    (`DraftLengthPlanner.adopt`, tested in test_synthesizer.py)."""
    from pcgtts.runtime.config import ModelPaths
    from pcgtts.serve.config import ServerConfig
    from pcgtts.serve.pool import WorkerPool

    models = ModelPaths(target=str(tiny_models["target"]), draft=str(tiny_models["draft"]),
                        codec=str(tiny_models["codec"]), groups=str(tiny_groups_file))
    config = ServerConfig(models=models, policy="sd", max_length=512, voices_dir=str(tmp_path), workers=2,
                          queue_size=1, api_key=None, max_new_tokens=20)
    first, second = WorkerPool.from_config(config).synthesizers
    assert first.target is not second.target
    assert second.planner.plan(second.config.decode) is not None and second.planner.plan(second.config.decode) == first.planner.plan(first.config.decode)
