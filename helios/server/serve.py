"""Run an app under uvicorn: what ``flare run`` and the tests call.

Loopback by default (issue 5: listen on 127.0.0.1 unless told otherwise).
SIGTERM/SIGINT make uvicorn stop accepting connections and wait up to
``graceful_s`` for open ones; streams still open after that are cancelled,
which cancels their requests in the engine. Then the lifespan stops the engine.
"""

from __future__ import annotations

import uvicorn
from fastapi import FastAPI

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def uvicorn_server(app: FastAPI, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, graceful_s: float = 30.0, log_level: str = "info") -> uvicorn.Server:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_s, lifespan="on")
    return uvicorn.Server(config)


def serve(app: FastAPI, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, graceful_s: float = 30.0) -> None:
    """Serve until SIGINT/SIGTERM (blocking)."""
    uvicorn_server(app, host, port, graceful_s).run()
