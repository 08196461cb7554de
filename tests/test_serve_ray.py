"""Scale-out: the server as two Ray Serve replicas on this machine (slow: starts a local Ray)."""

from __future__ import annotations

import socket

import pytest

pytestmark = pytest.mark.slow


def test_two_ray_replicas_serve_speech(tiny_lm_factory, demo_codec_dir, tmp_path):
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    import httpx

    from pcgtts.runtime.config import ModelPaths
    from pcgtts.serve.config import ServerConfig
    from pcgtts.serve.ray_app import build

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = ServerConfig(port=port, models=ModelPaths(target=str(tiny_lm_factory()), codec=str(demo_codec_dir)),
                          policy="ar", max_length=1024, max_new_tokens=30, voices_dir=str(tmp_path / "voices"))
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(config, min_replicas=2, max_replicas=2), name="pcgtts", route_prefix="/")
        for _ in range(6):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/audio/speech", json={"input": "Hello replicas."},
                           timeout=120)
            assert r.status_code == 200 and r.content[:4] == b"RIFF" and len(r.content) > 44 + 1000
        assert "pcgtts_workers 1.0" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text  # per replica
        status = serve.status().applications["pcgtts"]
        assert status.status == "RUNNING"
        assert sum(d.replica_states.get("RUNNING", 0) for d in status.deployments.values()) == 2
    finally:
        serve.shutdown()
        ray.shutdown()
