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

A client cannot hold a connection open by sending slowly or not at all
(``HttpLimits``): a request head must be complete ``head_timeout_s`` after
the connection opens or the previous response ends (uvicorn by itself waits
forever for a first head, and any byte restarts its keep-alive timer), its
body ``body_timeout_s`` after the head (408, then the connection closes),
and a head may not exceed ``max_head_bytes`` (400).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import h11
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from helios.runtime.engine_api import Engine
from helios.server.app import ServerConfig, create_app
from helios.server.errors import request_timeout

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_GRACE_S = 30.0
DRAIN_MARGIN_S = 5.0
# JSON spells a byte in at most six (\u0000); token-id prompts and chat framing fit in the margin.
JSON_BYTES_PER_TEXT_BYTE = 6
BODY_MARGIN_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """How long and how much the HTTP layer waits for a client (docs/http-api.md, "Limits")."""

    head_timeout_s: float = 10.0  # connection opened (or last response sent) -> request head complete
    body_timeout_s: float = 30.0  # request head complete -> body complete (408)
    keep_alive_s: float = 5.0  # idle keep-alive connection after a response (uvicorn's timeout_keep_alive)
    max_head_bytes: int = 16 * 1024  # request line plus headers (uvicorn's h11_max_incomplete_event_size)

    def __post_init__(self) -> None:
        for name in ("head_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_head_bytes < 1024:
            raise ValueError(f"max_head_bytes must be >= 1024, got {self.max_head_bytes}")


def body_limit(context_length: int, max_token_bytes: int | None) -> int | None:
    """The largest request body that a prompt fitting the context can need (None: no bound is known).

    Such a prompt is fewer than ``context_length`` tokens of at most
    ``max_token_bytes`` bytes of text each, and JSON may spell a byte in six.
    """
    if not max_token_bytes:
        return None
    return context_length * max_token_bytes * JSON_BYTES_PER_TEXT_BYTE + BODY_MARGIN_BYTES


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


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is not complete in time.

    The deadline runs whenever the connection waits for a head: from
    ``connection_made`` and from the end of each response, until h11 has
    parsed a whole head (the peer's state leaves IDLE).
    """

    def __init__(self, *args, head_timeout_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_timeout_s = head_timeout_s
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_deadline is not None and self.conn.their_state is not h11.IDLE:
            self._head_deadline.cancel()
            self._head_deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        self._head_deadline = self.loop.call_later(self._head_timeout_s, self._head_too_late)

    def _head_too_late(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.transport.close()  # nothing was asked yet, so there is no one to answer


class BodyDeadline:
    """ASGI middleware: a request's body must arrive within ``timeout_s`` of its head, else 408 and close.

    It wraps ``receive``: while the body is incomplete, each wait is bounded by
    what is left of the deadline, and running out raises the 408 ``ApiError``
    inside whatever reads the body, which the app renders in its error shape.
    """

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self._app = app
        self._timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        body_done = late = False

        async def bounded_receive() -> Message:
            nonlocal body_done, late
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                late = True
                raise request_timeout(f"The request body did not arrive within {self._timeout_s:g} s of its "
                                      "headers; send the whole body promptly.") from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def closing_send(message: Message) -> None:
            if late and message["type"] == "http.response.start":  # the rest of that body is never read
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self._app(scope, bounded_receive, closing_send)


def uvicorn_server(
    engine: Engine, config: ServerConfig = ServerConfig(), host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
    grace_s: float = DEFAULT_GRACE_S, log_level: str = "info", limits: HttpLimits = HttpLimits(),
    app: ASGIApp | None = None,
) -> DrainingServer:
    """uvicorn with the HTTP limits and drain; ``app`` replaces ``create_app(engine, config)`` (a server
    with extra routes, such as debug-serve's, built on that app)."""
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
    app = BodyDeadline(app if app is not None else create_app(engine, config), limits.body_timeout_s)
    settings = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=grace_s + DRAIN_MARGIN_S,
        http=functools.partial(HeadDeadlineProtocol, head_timeout_s=limits.head_timeout_s),
        timeout_keep_alive=limits.keep_alive_s, h11_max_incomplete_event_size=limits.max_head_bytes)
    return DrainingServer(settings, engine, grace_s)


def serve(engine: Engine, config: ServerConfig = ServerConfig(), host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, grace_s: float = DEFAULT_GRACE_S) -> None:
    """Serve until SIGINT/SIGTERM, then drain (blocking)."""
    uvicorn_server(engine, config, host, port, grace_s).run()
