"""`pcgtts serve`: flags mirror `ServerConfig`; models resolve like `pcgtts speak` (the built-in
voice when no --target is given), validated before any model loads. `python -m pcgtts.cli.serve`
runs the same server as Ray Serve replicas (`serve/ray_app.py`)."""

from __future__ import annotations

import argparse
import logging
import os

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    from pcgtts.cli.commands import add_model_args
    from pcgtts.cli.flags import positive
    from pcgtts.serve.config import ServerConfig

    d = ServerConfig()
    serve = sub.add_parser("serve", help="OpenAI-compatible streaming speech server (HTTP + WebSocket)")
    serve.add_argument("--host", default=d.host, help=f"address to bind (default {d.host}: this machine only)")
    serve.add_argument("--port", type=int, default=d.port)
    serve.add_argument("--workers", type=positive(int), default=d.workers, help="Synthesizers loaded (model copies)")
    serve.add_argument("--max-batch", type=positive(int), default=d.max_batch,
                       help="streams each worker decodes together over its one model copy (torch backend; every "
                            "policy, at the voice's or the given draft length; default 1: one stream per worker at a "
                            "time)")
    serve.add_argument("--queue-size", type=int, default=d.queue_size, help="requests that may wait; more get 429")
    serve.add_argument("--request-timeout", type=positive(float), default=d.request_timeout_s, help="seconds per request")
    serve.add_argument("--max-input-chars", type=positive(int), default=d.max_input_chars)
    serve.add_argument("--max-upload-bytes", type=positive(int), default=d.max_upload_bytes)
    serve.add_argument("--max-upload-seconds", type=positive(float), default=d.max_upload_seconds)
    serve.add_argument("--api-key", help="require `Authorization: Bearer <key>` (default: $PCGTTS_API_KEY, or none)")
    serve.add_argument("--voices-dir", default=d.voices_dir, help="where uploaded voices are stored (share it between replicas)")
    serve.add_argument("--sample-rate", type=int, default=d.sample_rate, help="output rate (24000 = OpenAI's pcm)")
    add_model_args(serve)
    serve.add_argument("--max-tokens", type=positive(int), help="speech tokens per sentence at most")
    serve.add_argument("--max-length", type=positive(int), help="KV-cache slots per sequence")
    serve.set_defaults(func=_serve)


def config_from_args(args: argparse.Namespace):
    """The ServerConfig of the flags: runtime settings resolved (flags > --config > defaults; the
    built-in voice without --target) by the same function `speak` uses."""
    from pcgtts.cli.commands import resolve_cli_settings
    from pcgtts.runtime.config import check_compute_device
    from pcgtts.serve.config import ServerConfig

    server = dict(host=args.host, port=args.port, workers=args.workers, max_batch=args.max_batch,
                  queue_size=args.queue_size,
                  request_timeout_s=args.request_timeout, max_input_chars=args.max_input_chars,
                  max_upload_bytes=args.max_upload_bytes, max_upload_seconds=args.max_upload_seconds,
                  api_key=args.api_key or os.environ.get("PCGTTS_API_KEY") or None, voices_dir=args.voices_dir,
                  sample_rate=args.sample_rate)
    ServerConfig(**server)  # server flags are checked before any model is resolved or made
    settings = resolve_cli_settings(args, max_length=args.max_length, max_batch=args.max_batch)
    check_compute_device(settings.device.compute_device)
    device = settings.device
    return ServerConfig(**server, models=settings.models, compute_device=device.compute_device,
                        backend=device.backend, dtype=device.dtype, quantize=device.quantize, compile=device.compile,
                        threads=device.threads,
                        policy=settings.synthesis.decode.policy, max_new_tokens=settings.synthesis.decode.max_new_tokens,
                        max_length=settings.device.max_length, config_file=args.config)


def _serve(args) -> int:
    import uvicorn

    from pcgtts.serve.app import create_app
    from pcgtts.serve.pool import WorkerPool

    config = config_from_args(args)
    if config.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        log.warning("serving on %s without an API key: anyone who can reach it can use it", config.host)
    pool = WorkerPool.from_config(config)
    app = create_app(config, pool)
    log.info("pcgtts serve: http://%s:%d/v1 (%d workers, %d streams each)", config.host, config.port, config.workers,
             config.max_batch)
    uvicorn.run(app, host=config.host, port=config.port, log_level="info", ws="auto")
    return 0


def ray_main(argv: list[str] | None = None) -> int:
    """`python -m pcgtts.cli.serve`: the server as Ray Serve replicas (`serve/ray_app.py`), with every
    `pcgtts serve` flag and --min-replicas / --max-replicas."""
    import sys

    from pcgtts.serve.ray_app import build

    parser = argparse.ArgumentParser(prog="python -m pcgtts.cli.serve",
                                     description="the speech server as Ray Serve replicas (scale-out)")
    sub = parser.add_subparsers(dest="command")
    register(sub)
    serve_parser = sub.choices["serve"]
    serve_parser.add_argument("--min-replicas", type=int, default=1)
    serve_parser.add_argument("--max-replicas", type=int, default=2)
    args = parser.parse_args(["serve", *(argv if argv is not None else sys.argv[1:])])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    import ray
    from ray import serve

    ray.init(ignore_reinit_error=True)
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(build(config, args.min_replicas, args.max_replicas), name="pcgtts", route_prefix="/", blocking=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(ray_main())
