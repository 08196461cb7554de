"""`pcgtts serve`: an OpenAI-compatible streaming speech server over the runtime.

    request -> app.py (routes, validation, auth, OpenAI error shape)
            -> pool.py (bounded admission, one Synthesizer per worker, a SpeechJob per request)
            -> runtime `Synthesizer.stream` -> encode.py (pcm / wav / flac / SSE bytes) -> client

Modules: config.py (ServerConfig), errors.py (OpenAI error JSON), pool.py (WorkerPool, SpeechJob),
voices.py (the voice store), encode.py (audio formats), metrics.py (Prometheus), websocket.py
(incremental text), app.py (`create_app`), ray_app.py (Ray Serve replicas); the command is
cli/serve.py. FastAPI and uvicorn are imported only by app.py, so `import pcgtts.serve.config` is light.
"""
