"""``ignition debug-serve --direct``: load, build the direct engine, warm up, serve (docs/debug-serve.md).

The app is ``helios.server.create_app``'s (the same endpoints, validation and
errors as ``flare run``) plus one route of this server only: ``GET
/debug/state``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from helios.catalog.load import load
from helios.direct.engine import DirectEngine
from helios.direct.scheduler import LoggedDecision
from helios.runtime.engine import EngineConfig
from helios.launch import bind_listener
from helios.server.app import ServerConfig, create_app
from helios.server.serve import DEFAULT_GRACE_S, DrainingServer, HttpLimits, body_limit, uvicorn_server

log = logging.getLogger("ignition.debug_serve")


@dataclass(frozen=True, slots=True)
class DebugServeOptions:
    """The command's flags, validated at construction."""

    catalog: Path
    host: str = "127.0.0.1"
    port: int = 8000
    verbose: bool = False
    threads: int | None = None
    trust_catalog: bool = False  # load programs uninspected (docs/catalog-format.md, "Trust")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")


def build_app(engine: DirectEngine, config: ServerConfig = ServerConfig()) -> FastAPI:
    app = create_app(engine, config)

    async def debug_state() -> JSONResponse:
        return JSONResponse(engine.debug_state())

    app.add_api_route("/debug/state", debug_state, methods=["GET"])
    return app


def prepare(options: DebugServeOptions) -> tuple[socket.socket, DirectEngine]:
    """Bind the port first (a busy one is one line, before the warm-up), then build the engine."""
    listener = bind_listener(options.host, options.port)
    return listener, prepare_engine(options)


def prepare_engine(options: DebugServeOptions) -> DirectEngine:
    """Load the catalog (a bad one raises ``ValueError``/``OSError``: one line, exit 2), build, warm up."""
    began = time.monotonic()
    catalog = load(options.catalog, trust=options.trust_catalog)
    catalog.check_programs()  # refuse programs that could run code before any is loaded
    log.info("loaded catalog %s (%d programs) in %.1f s", options.catalog, len(catalog.descriptors),
             time.monotonic() - began)
    config = EngineConfig(threads=options.threads or os.cpu_count() or 1,
                          device=str(catalog.manifest.device["kind"]))
    engine = DirectEngine(catalog, config, on_decision=_log_decision if options.verbose else None)
    began = time.monotonic()
    engine.warm_up()
    log.info("warmed up %d programs in %.1f s", len(engine.scheduler.graphs), time.monotonic() - began)
    return engine


def _log_decision(decision: LoggedDecision) -> None:
    log.info("decision %s", decision.line())


def run(options: DebugServeOptions, engine: DirectEngine, listener: socket.socket) -> None:
    """Serve ``engine`` (from :func:`prepare_engine`) on ``listener`` (bound before the warm-up) until
    SIGINT/SIGTERM, then drain like ``flare run``, under the same HTTP limits (head and body deadlines,
    the body cap a prompt fitting the context can need)."""
    server = debug_server(options, engine)
    log.info("direct scheduler ready on http://%s:%d (model %s); GET /debug/state", options.host,
             listener.getsockname()[1], engine.model_name)
    try:
        server.run(sockets=[listener])
    finally:
        listener.close()


def debug_server(options: DebugServeOptions, engine: DirectEngine, limits: HttpLimits = HttpLimits(),
                 grace_s: float = DEFAULT_GRACE_S) -> DrainingServer:
    max_body = body_limit(engine.context_length, engine.tokenizer.max_token_bytes) or ServerConfig().max_body_bytes
    config = ServerConfig(max_body_bytes=max_body)
    return uvicorn_server(engine, config, options.host, options.port, grace_s, log_level="warning",
                          limits=limits, app=build_app(engine, config))
