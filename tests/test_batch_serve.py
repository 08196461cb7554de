"""`pcgtts serve --max-batch N`: one model copy per worker serves N streams together; admission by
free slots and a bounded queue, 429 beyond; /metrics shows batch occupancy and per-stream lag.
A real uvicorn on 127.0.0.1 and httpx clients (tiny random-weight models)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from serve_helpers import assert_openai_error, start_server  # noqa: E402

LONG = "A long utterance that would go on for quite a while. " * 3


@pytest.fixture(scope="module")
def server(tiny_lm_factory, demo_codec_dir, tmp_path_factory):
    running = start_server(tiny_lm_factory(), demo_codec_dir, tmp_path_factory.mktemp("voices"), max_batch=3,
                           queue_size=1, api_key=None, max_new_tokens=300)
    yield running
    running.stop()


def speech(server, text, seed, fmt="pcm", **extra):
    return httpx.post(f"{server.url}/v1/audio/speech", timeout=60,
                      json={"input": text, "response_format": fmt, "seed": seed, **extra})


def alone_then_together(server, asks: list[tuple[str, dict]]) -> tuple[list[bytes], list[bytes]]:
    """Each (text, settings) of `asks` (seed = its index) asked alone, one after another, then all at once
    from threads: (alone, together) response bodies."""
    alone = [speech(server, text, seed=i, **extra).content for i, (text, extra) in enumerate(asks)]
    together = [None] * len(asks)

    def ask(i):
        together[i] = speech(server, asks[i][0], seed=i, **asks[i][1]).content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return alone, together


def same_pcm(got: list[bytes], alone: list[bytes]) -> bool:
    """16-bit PCM bodies of equal lengths, equal up to float rounding (3 LSB, about 1e-4): the batch's
    codec windows are decoded together (runtime/audio/codec_batch.py)."""
    pcm = [[np.frombuffer(body, np.int16).astype(np.int32) for body in bodies] for bodies in (got, alone)]
    return all(alone) and all(len(a) == len(b) and np.abs(a - b).max() <= 3 for a, b in zip(*pcm))


def test_one_worker_serves_three_streams_together_as_each_alone(server):
    texts = ["Hello there, a first request.", "A second one, somewhat longer.", "Third."]
    alone, got = alone_then_together(server, [(text, {"temperature": 0.0}) for text in texts])
    assert same_pcm(got, alone)
    assert len(server.pool.synthesizers) == 1 and server.pool.seats == 3
    health = httpx.get(f"{server.url}/health").json()
    assert (health["workers"], health["streams"], health["busy"]) == (1, 3, 0)
    assert max(server.pool.synthesizers[0].batch.occupancy) > 1  # they shared steps
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "pcgtts_stream_slots 3.0" in metrics
    assert "pcgtts_batch_occupancy" in metrics and "pcgtts_stream_lag_max_seconds" in metrics
    lags = [line for line in metrics.splitlines() if line.startswith("pcgtts_stream_lag_seconds_count")]
    assert float(lags[0].split()[-1]) >= 6
    codec = [line for line in metrics.splitlines() if line.startswith("pcgtts_codec_seconds_total")]
    assert float(codec[0].split()[-1]) > 0  # batched windows' shares are counted too


def test_free_slots_then_the_queue_then_429_and_a_disconnect_frees_its_slot(server):
    url = f"{server.url}/v1/audio/speech"
    pool, batch = server.pool, server.pool.synthesizers[0].batch
    body = {"input": LONG, "response_format": "pcm", "seed": 1}
    with httpx.Client(timeout=60) as one, httpx.Client(timeout=60) as two, httpx.Client(timeout=60) as three:
        streams = [client.stream("POST", url, json=body) for client in (one, two, three)]
        responses = [s.__enter__() for s in streams]
        pieces = [r.iter_raw() for r in responses]
        for r, p in zip(responses, pieces):
            assert r.status_code == 200
            next(p)  # audio is flowing from all three slots
        assert pool.busy == 3 and batch.seated == 3
        waiting = threading.Thread(target=lambda: speech(server, "Queued.", seed=2), daemon=True)
        waiting.start()  # the queue's one place
        deadline = time.monotonic() + 10
        while pool.waiting < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        started = time.monotonic()
        refused = speech(server, "Refused.", seed=3)
        assert time.monotonic() - started < 5  # at once, not after a stream ends
        assert_openai_error(refused, 429)
        assert int(refused.headers["Retry-After"]) >= 1
        streams[0].__exit__(None, None, None)  # this client leaves mid-stream: its slot serves the queued one
        waiting.join(60)
        assert not waiting.is_alive()
        for s in streams[1:]:
            s.__exit__(None, None, None)
    deadline = time.monotonic() + 15
    while pool.busy or batch.seated:
        assert time.monotonic() < deadline, "the slots were not freed after the clients left"
        time.sleep(0.02)
    assert 'pcgtts_cancelled_streams_total{reason="client"}' in httpx.get(f"{server.url}/metrics").text


def test_a_batching_server_refuses_what_its_batch_does_not_run(server):
    error = assert_openai_error(speech(server, "Hello.", seed=0, policy="sd"), 400, "policy")  # no draft here
    assert "policy 'sd' needs the draft LM" in error["message"]


def test_speculative_requests_batch_with_a_draft(tiny_models, tiny_groups_file, tmp_path):
    """A server with a draft batches its policies: requests at pcg, sd and ar at once each get what they
    get alone (greedy: an adaptive draft length may plan plain decoding once the batch fills)."""
    from pcgtts.runtime.config import ModelPaths

    models = ModelPaths(target=str(tiny_models["target"]), draft=str(tiny_models["draft"]),
                        codec=str(tiny_models["codec"]), groups=str(tiny_groups_file))
    running = start_server(None, None, tmp_path, models=models, max_batch=3, api_key=None, policy="pcg",
                           max_new_tokens=60)
    try:
        asks = [("A first request.", {"temperature": 0.0}), ("A second one.", {"policy": "sd", "temperature": 0.0}),
                ("Third.", {"policy": "ar", "temperature": 0.0})]
        alone, got = alone_then_together(running, asks)
        assert same_pcm(got, alone)
        assert max(running.pool.synthesizers[0].batch.recent_passes()) > 1
        occupancy = [line for line in httpx.get(f"{running.url}/metrics").text.splitlines()
                     if line.startswith("pcgtts_batch_occupancy ")]
        assert 0 < float(occupancy[0].split()[-1]) <= 1
    finally:
        running.stop()


def test_the_flag_reaches_the_workers_and_checks_the_policy(tmp_path):
    from test_serve_cli import parse

    from pcgtts.cli import serve as cli
    from pcgtts.runtime.config import DecodeConfig

    (tmp_path / "target").mkdir()
    config = cli.config_from_args(parse("--target", str(tmp_path / "target"), "--max-batch", "4"))
    assert config.max_batch == 4 and config.policy == DecodeConfig().policy and config.streams == 4
    settings = config.runtime_settings()  # the policy and draft length chosen, not forced plain
    assert (settings["max_batch"], settings["policy"], settings.get("adaptive_draft")) == (4, DecodeConfig().policy, None)
    for policy in ("pcg", "eagle-pcg", "mtp-sd"):  # every policy batches, at its adaptive draft length too
        config = cli.config_from_args(parse("--target", str(tmp_path / "target"), "--max-batch", "4", "--policy", policy))
        assert config.runtime_settings()["policy"] == policy
    with pytest.raises(ValueError, match="torch backend"):
        cli.config_from_args(parse("--target", str(tmp_path / "target"), "--max-batch", "2",
                                   "--backend", "onnxruntime"))


@pytest.mark.slow
def test_one_of_eight_clients_leaving_mid_stream_leaves_the_other_seven_undisturbed(tiny_lm_factory, demo_codec_dir,
                                                                                     tmp_path):
    """Eight seeded requests at once on one worker; one client drops its connection after its first
    piece: the seven others get the audio each gets alone, and every slot is free afterwards."""
    running = start_server(tiny_lm_factory(), demo_codec_dir, tmp_path, max_batch=8, queue_size=0, api_key=None,
                           max_new_tokens=120)
    try:
        texts = [f"Request number {i}, a sentence of its own." for i in range(8)]
        alone = [speech(running, text, seed=i, temperature=0.8).content for i, text in enumerate(texts)]
        together: list = [None] * 8
        leaver = 3
        left = threading.Event()

        def ask(i):
            body = {"input": texts[i], "response_format": "pcm", "seed": i, "temperature": 0.8}
            with httpx.Client(timeout=60) as client, client.stream("POST", f"{running.url}/v1/audio/speech",
                                                                  json=body) as response:
                assert response.status_code == 200
                pieces = response.iter_raw()
                if i == leaver:
                    next(pieces)  # audio is flowing: this client goes away mid-stream
                    left.set()
                    return
                together[i] = b"".join(pieces)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert left.is_set()
        kept = [i for i in range(8) if i != leaver]
        assert same_pcm([together[i] for i in kept], [alone[i] for i in kept])
        batch = running.pool.synthesizers[0].batch
        assert max(batch.occupancy) >= 7  # they decoded together
        deadline = time.monotonic() + 15
        while running.pool.busy or batch.seated:
            assert time.monotonic() < deadline, "the leaving client's slot was not freed"
            time.sleep(0.02)
        assert 'pcgtts_cancelled_streams_total{reason="client"}' in httpx.get(f"{running.url}/metrics").text
    finally:
        running.stop()
