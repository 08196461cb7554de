"""Helpers shared by the server's test modules: a real uvicorn on 127.0.0.1 in a thread, and checks
of OpenAI-shaped errors and streamed WAV bodies."""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np

KEY = "test-key-123456"


class RunningServer:
    def __init__(self, app, pool, voices_dir):
        import uvicorn

        self.pool, self.voices_dir = pool, voices_dir
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws="auto"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def start_server(target, codec, voices_dir, **overrides):
    from pcgtts.runtime.config import ModelPaths
    from pcgtts.serve.app import create_app
    from pcgtts.serve.config import ServerConfig
    from pcgtts.serve.pool import WorkerPool

    fields = dict(models=ModelPaths(target=str(target), codec=str(codec)), policy="ar", max_length=1024,
                  voices_dir=str(voices_dir), workers=1, queue_size=2, api_key=KEY, max_new_tokens=40)
    fields.update(overrides)
    config = ServerConfig(**fields)
    pool = WorkerPool.from_config(config)
    return RunningServer(create_app(config, pool), pool, voices_dir)


def auth():
    return {"Authorization": f"Bearer {KEY}"}


def assert_openai_error(response, status, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in response.text
    if param is not None:
        assert error["param"] == param
    return error


def read_wav(data: bytes):
    """(rate, int16 samples) of a streamed WAV (data size 0xFFFFFFFF: read to the end)."""
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt "
    import struct

    _, fmt, channels, rate, _, _, bits = struct.unpack("<IHHIIHH", data[16:36])
    assert (fmt, channels, bits) == (1, 1, 16) and data[36:40] == b"data"
    return rate, np.frombuffer(data[44:], dtype="<i2")


def websocket_session(server, messages) -> tuple[list[dict], int]:
    """Send `messages` then end; (the JSON messages received up to done, audio bytes received)."""
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream", additional_headers=auth(),
                 open_timeout=10) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "ready"
        for message in [*messages, {"type": "end"}]:
            ws.send(json.dumps(message))
        received, audio = [], 0
        while True:
            frame = ws.recv(timeout=60)
            if isinstance(frame, bytes):
                audio += len(frame)
                continue
            received.append(json.loads(frame))
            if received[-1]["type"] == "done":
                return received, audio
