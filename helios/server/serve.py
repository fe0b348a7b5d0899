"""Run an engine behind the app under uvicorn: what ``flare run`` and the tests call.

Loopback by default (issue 5: listen on 127.0.0.1 unless told otherwise).

Shutdown (SIGTERM, SIGINT, or ``server.should_exit``) drains in this order:
1. the listener closes and the engine is told ``begin_drain(grace_s)``: it
   refuses new work and gives running requests ``grace_s`` to finish, then
   ends the rest with finish reason ``abort``, which their clients receive;
2. uvicorn waits for open responses, ``DRAIN_MARGIN_S`` longer than the
   grace so those last chunks get out, then cancels what is left (and a
   cancelled response cancels its request);
3. the lifespan calls ``engine.stop()``.

A drained shutdown is a normal end: ``flare run`` returns and the process
exits 0. (uvicorn by itself re-raises the signal it caught once it is done,
so the process would die of SIGTERM; ``DrainingServer`` does not.)
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Iterator

import uvicorn

from helios.engine_api import Engine
from helios.server.app import ServerConfig, create_app

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_GRACE_S = 30.0
DRAIN_MARGIN_S = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn plus one step at the start of shutdown: tell the engine to drain."""

    def __init__(self, config: uvicorn.Config, engine: Engine, grace_s: float) -> None:
        super().__init__(config)
        self._engine = engine
        self._grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._engine.begin_drain(self._grace_s)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Route SIGINT/SIGTERM to a graceful exit, and do not re-raise them afterwards."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be installed from the main thread
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def uvicorn_server(
    engine: Engine, config: ServerConfig = ServerConfig(), host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
    grace_s: float = DEFAULT_GRACE_S, log_level: str = "info",
) -> DrainingServer:
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
    app = create_app(engine, config)
    settings = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=grace_s + DRAIN_MARGIN_S)
    return DrainingServer(settings, engine, grace_s)


def serve(engine: Engine, config: ServerConfig = ServerConfig(), host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, grace_s: float = DEFAULT_GRACE_S) -> None:
    """Serve until SIGINT/SIGTERM, then drain (blocking)."""
    uvicorn_server(engine, config, host, port, grace_s).run()
