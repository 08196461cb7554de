"""Scale-out: the same app as Ray Serve replicas (Ray does routing, replicas and autoscaling).

    pip install "ray[serve]"
    python -m pcgtts.cli.serve --min-replicas 1 --max-replicas 4 --workers 1 --voices-dir /shared/voices \
        [every `pcgtts serve` flag: --target ... --compute-device cuda ...]

Each replica is one `create_app(config, WorkerPool.from_config(config))`: it loads its own
Synthesizers (one GPU per replica when --compute-device is cuda), keeps its own bounded queue
(429 + Retry-After when full) and its own Prometheus metrics (scrape each replica, or read Ray's
own serve metrics for the cluster view). Voices are shared through `--voices-dir`: point every
replica at one shared directory (NFS or a mounted bucket); voice files are written atomically and
read per request, so a voice uploaded through one replica is usable on all. WebSocket routes go
through Ray's proxy too (Ray Serve supports WebSockets on ASGI ingress deployments).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def build(config, min_replicas: int = 1, max_replicas: int = 2, name: str = "pcgtts"):
    """A Ray Serve application of the speech server (bind it, then `serve.run` it)."""
    from ray import serve

    if not (1 <= min_replicas <= max_replicas):
        raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {min_replicas}, {max_replicas}")
    gpus = 1 if (config.compute_device or "cpu").startswith("cuda") else 0

    @serve.ingress()
    class SpeechReplica:
        def __init__(self, server_config):
            from pcgtts.serve.pool import WorkerPool

            self.config = server_config
            self.pool = WorkerPool.from_config(server_config)

        def __serve_build_asgi_app__(self):
            from pcgtts.serve.app import create_app

            return create_app(self.config, self.pool)

    deployment = serve.deployment(
        SpeechReplica, name=name, ray_actor_options={"num_gpus": gpus, "num_cpus": 1},
        max_ongoing_requests=config.workers + config.queue_size + 1,  # our own queue answers 429 beyond
        autoscaling_config={"min_replicas": min_replicas, "max_replicas": max_replicas,
                            "target_ongoing_requests": config.workers})
    return deployment.bind(config)
