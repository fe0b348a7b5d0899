"""The ASGI app: OpenAI-compatible routes over an ``Engine`` (``create_app``).

Per generation request: read the body within the size bound, validate it
(``protocol``), submit to the engine, then either stream SSE events
(``streaming``) or collect the text while watching for a disconnect
(``generation``). Every refusal is an ``ApiError`` rendered in OpenAI's error
shape. An exception while decoding, validating or preparing a body is the
body's fault: a 400. Any other unexpected failure is a 500 in the same shape,
logged with its traceback and counted in ``flare_requests_total`` (outcome
``error``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from helios.engine_api import Engine, EngineUnavailable, GenerationFailed, RequestRejected
from helios.server.auth import BearerAuth
from helios.server.errors import ApiError, bad_request, cut, generation_failed, internal, model_not_found, too_large, unavailable
from helios.server.generation import ClientGone, Generation, collect_text
from helios.server.metrics import DeliveryClock, ServerMetrics
from helios.server.protocol import (
    ChatBody,
    CompletionBody,
    ModelLimits,
    PreparedRequest,
    parse_body,
    prepare_chat,
    prepare_completion,
)
from helios.server.responses import ChatShape, CompletionShape, ResponseHeader, ResponseShape
from helios.server.streaming import EventStreamResponse, stream_events

log = logging.getLogger(__name__)

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
# Bodies up to this size are tokenized on the event loop: microseconds of work, where a
# worker-thread hop costs milliseconds of GIL hand-over on a busy host.
INLINE_PREPARE_BYTES = 16 * 1024
CLIENT_CLOSED = 499  # nginx's status for "client closed request": nobody reads it, logs do


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """HTTP-side settings; the command line builds one (``--api-key`` / ``FLARE_API_KEY``)."""

    api_key: str | None = None  # None: no authentication
    max_body_bytes: int = 4 * 1024 * 1024  # larger bodies get 413

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """What differs between the two generation routes."""

    label: str  # metric label
    id_prefix: str
    body_type: type
    prepare: Callable[..., PreparedRequest]
    shape: ResponseShape


COMPLETIONS = Endpoint("completions", "cmpl", CompletionBody, prepare_completion, CompletionShape())
CHAT = Endpoint("chat", "chatcmpl", ChatBody, prepare_chat, ChatShape())


def create_app(engine: Engine, config: ServerConfig = ServerConfig()) -> FastAPI:
    """An app serving ``engine``; the engine is started and stopped with the app's lifespan."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    # No generated OpenAPI pages: bodies are validated by hand to give OpenAI's 400s, not FastAPI's 422s.
    app = FastAPI(title="Flare", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    routes = _Routes(engine, config, ServerMetrics(engine.stats), int(time.time()))
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", routes.model, methods=["GET"])
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"])
    _install_error_handlers(app)
    if config.api_key is not None:
        app.add_middleware(BearerAuth, api_key=config.api_key)
    return app


class _Routes:
    def __init__(self, engine: Engine, config: ServerConfig, metrics: ServerMetrics, started: int) -> None:
        self.engine = engine
        self.config = config
        self.server_metrics = metrics
        self.started = started

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, COMPLETIONS)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, CHAT)

    async def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, model_id: str) -> JSONResponse:
        if model_id != self.engine.model_name:
            raise model_not_found(model_id, self.engine.model_name)
        return JSONResponse(self._model_card())

    async def health(self) -> JSONResponse:
        if not self.engine.stats().accepting:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self) -> Response:
        return Response(self.server_metrics.exposition(), media_type=PROMETHEUS_TEXT)

    def _model_card(self) -> dict:
        return {
            "id": self.engine.model_name,
            "object": "model",
            "created": self.started,
            "owned_by": "flare",
            "max_model_len": self.engine.context_length,
        }

    async def _generate(self, request: Request, endpoint: Endpoint) -> Response:
        clock = DeliveryClock(self.server_metrics)
        try:
            generation, prepared = await self._admit(request, endpoint, clock)
        except ApiError as error:
            self.server_metrics.finished(endpoint.label, _refusal_outcome(error.status))
            raise
        except Exception as exc:
            self.server_metrics.finished(endpoint.label, "error")
            return _server_fault(exc)
        header = ResponseHeader(prepared.generation.request_id, int(time.time()), self.engine.model_name)
        if prepared.stream:
            return EventStreamResponse(stream_events(generation, endpoint.shape, header, prepared.include_usage), generation.abandon)
        try:
            return await self._respond_whole(request, generation, endpoint.shape, header)
        except ApiError:
            raise
        except Exception as exc:  # the generation counted it as an error when its relay ended
            return _server_fault(exc)

    async def _admit(self, request: Request, endpoint: Endpoint, clock: DeliveryClock) -> tuple[Generation, PreparedRequest]:
        raw = await _read_body(request, self.config.max_body_bytes)
        body = parse_body(raw, endpoint.body_type)
        limits = ModelLimits(self.engine.model_name, self.engine.context_length, self.engine.tokenizer)
        request_id = f"{endpoint.id_prefix}-{uuid.uuid4().hex}"
        if len(raw) <= INLINE_PREPARE_BYTES:
            prepared = _prepare(endpoint, body, limits, request_id)
        else:  # tokenizing a long prompt takes milliseconds: keep it off the event loop
            prepared = await asyncio.to_thread(_prepare, endpoint, body, limits, request_id)
        generation = Generation(self.engine, prepared.generation, self.server_metrics, endpoint.label, clock)
        try:
            generation.submit()
        except RequestRejected as exc:
            raise bad_request(str(exc), exc.param, "rejected_by_engine") from None
        except EngineUnavailable as exc:
            raise unavailable(f"The server is not accepting requests: {exc}", exc.retry_after_s) from None
        return generation, prepared

    async def _respond_whole(self, request: Request, generation: Generation, shape: ResponseShape, header: ResponseHeader) -> Response:
        try:
            text = await collect_text(generation, request.receive)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        except GenerationFailed as exc:
            raise generation_failed(exc) from None
        assert generation.finish_reason is not None, "collect_text returns only finished generations"
        return JSONResponse(shape.full(header, text, generation.finish_reason.value, generation.usage))


def _prepare(endpoint: Endpoint, body, limits: ModelLimits, request_id: str) -> PreparedRequest:
    """``endpoint.prepare``, where anything but a refusal (a tokenizer or template that chokes on the
    input) is still a 400 about the body, logged with its traceback in case it is a bug of ours."""
    try:
        return endpoint.prepare(body, limits, request_id)
    except ApiError:
        raise
    except Exception as exc:
        log.warning("request %s: preparing the body raised; answering 400", request_id, exc_info=True)
        raise bad_request(f"The request could not be prepared: the prompt or messages made the tokenizer or chat "
                          f"template fail ({type(exc).__name__}: {cut(str(exc))}).", code="invalid_value") from None


def _server_fault(exc: Exception) -> Response:
    """A 500 answered here rather than by the catch-all handler, which would also close the connection."""
    log.error("unhandled error while serving a request", exc_info=exc)
    return internal(f"Internal server error: {type(exc).__name__}").response()


def _refusal_outcome(status: int) -> str:
    return "rejected" if status < 500 else "unavailable" if status == 503 else "error"


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` (declared or streamed)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: ApiError) -> Response:
        return exc.response()

    async def http_error(request: Request, exc: HTTPException) -> Response:
        # Unknown paths and wrong methods answer in the same error shape as everything else.
        return ApiError(exc.status_code, f"{exc.detail}: {request.method} {cut(request.url.path)}").response()

    async def unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error while serving a request")
        return internal(f"Internal server error: {type(exc).__name__}").response()

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
