"""The ASGI app: OpenAI-compatible routes over an ``Engine`` (``create_app``).

Per generation request: read the body within the size bound, validate it
(``protocol``), submit to the engine, then either stream SSE events
(``streaming``) or collect the text while watching for a disconnect
(``generation``). Every refusal is an ``ApiError`` rendered in OpenAI's error
shape. An exception while decoding, validating or preparing a body is the
body's fault: a 400. Any other unexpected failure is a 500 in the same shape,
logged with its traceback and counted in ``flare_requests_total`` (outcome
``error``).

Besides generation: ``/tokenize`` and ``/detokenize`` (``tokenization``),
``/version``, ``/v1/models``, ``/health`` and ``/metrics``. With
``ServerConfig.log_requests`` every generation request ends with an
access-log line (``request_log``); with ``log_stats_interval_s`` the lifespan
runs the periodic stats line (``stats_log``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from importlib import metadata
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from helios.runtime.engine_api import Engine, EngineUnavailable, GenerationFailed, RequestRejected
from helios.server.auth import BearerAuth
from helios.server.errors import ApiError, bad_request, cut, generation_failed, internal, model_not_found, too_large, unavailable
from helios.server.choices import ChoiceSet, ClientGone, collect
from helios.server.generation import CLIENT_CLOSED, Generation
from helios.server.logprobs import ChatLogprobs, CompletionLogprobs, LogprobsFormat
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
from helios.server.request_log import FinishedRequest, log_request
from helios.server.responses import ChatShape, CompletionShape, ResponseHeader, ResponseShape
from helios.server.stats_log import log_stats_every, sampler
from helios.server.streaming import EventStreamResponse, stream_events
from helios.server.tokenization import DetokenizeBody, TokenizeBody, detokenize, tokenize

log = logging.getLogger(__name__)

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
# Bodies up to this size are tokenized on the event loop: microseconds of work, where a
# worker-thread hop costs milliseconds of GIL hand-over on a busy host.
INLINE_PREPARE_BYTES = 16 * 1024


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """HTTP-side settings; the command line builds one (``--api-key`` / ``FLARE_API_KEY``)."""

    api_key: str | None = None  # None: no authentication
    max_body_bytes: int = 4 * 1024 * 1024  # larger bodies get 413
    log_requests: bool = False  # an access-log line per finished generation request (flare run: on)
    log_stats_interval_s: float = 0.0  # a stats line this often; 0: none (flare run: 10)

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if not (math.isfinite(self.log_stats_interval_s) and self.log_stats_interval_s >= 0):
            raise ValueError(f"log_stats_interval_s must be a finite number >= 0 (0: off), got {self.log_stats_interval_s}")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """What differs between the two generation routes."""

    label: str  # metric label
    id_prefix: str
    body_type: type
    prepare: Callable[..., PreparedRequest]
    shape: ResponseShape
    logprobs: Callable[..., LogprobsFormat]  # (tokenizer, alternatives) -> the endpoint's logprobs objects


COMPLETIONS = Endpoint("completions", "cmpl", CompletionBody, prepare_completion, CompletionShape(), CompletionLogprobs)
CHAT = Endpoint("chat", "chatcmpl", ChatBody, prepare_chat, ChatShape(), ChatLogprobs)


def create_app(engine: Engine, config: ServerConfig = ServerConfig()) -> FastAPI:
    """An app serving ``engine``; the engine is started and stopped with the app's lifespan."""

    metrics = ServerMetrics(engine.stats, engine.model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        stats_task = None
        if config.log_stats_interval_s > 0:
            sample = sampler(engine.stats, metrics.totals)
            stats_task = asyncio.create_task(log_stats_every(config.log_stats_interval_s, sample))
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
                await asyncio.gather(stats_task, return_exceptions=True)
            await engine.stop()

    # No generated OpenAPI pages: bodies are validated by hand to give OpenAI's 400s, not FastAPI's 422s.
    app = FastAPI(title="Flare", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    routes = _Routes(engine, config, metrics, int(time.time()))
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", routes.model, methods=["GET"])
    app.add_api_route("/tokenize", routes.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", routes.detokenize, methods=["POST"])
    app.add_api_route("/version", routes.version, methods=["GET"])
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

    async def tokenize(self, request: Request) -> JSONResponse:
        return JSONResponse(await self._token_utility(request, TokenizeBody, tokenize))

    async def detokenize(self, request: Request) -> JSONResponse:
        return JSONResponse(await self._token_utility(request, DetokenizeBody, detokenize))

    async def version(self) -> JSONResponse:
        return JSONResponse({"version": flare_version()})

    async def _token_utility(self, request: Request, body_type: type, answer: Callable[..., dict]) -> dict:
        raw = await _read_body(request, self.config.max_body_bytes)
        body = parse_body(raw, body_type)
        limits = self._limits()
        if len(raw) <= INLINE_PREPARE_BYTES:
            return _tokenizer_call(answer, body, limits)
        return await asyncio.to_thread(_tokenizer_call, answer, body, limits)

    def _limits(self) -> ModelLimits:
        return ModelLimits(self.engine.model_name, self.engine.context_length, self.engine.tokenizer)

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
        request_id = f"{endpoint.id_prefix}-{uuid.uuid4().hex}"
        try:
            choices, prepared = await self._admit(request, endpoint, clock, request_id)
        except ApiError as error:
            self._refused(request_id, endpoint, error.status, _refusal_outcome(error.status), clock)
            raise
        except Exception as exc:
            self._refused(request_id, endpoint, 500, "error", clock)
            return _server_fault(exc)
        header = ResponseHeader(prepared.response_id, int(time.time()), self.engine.model_name)
        if prepared.stream:
            return EventStreamResponse(stream_events(choices, endpoint.shape, header, prepared.include_usage), choices.abandon)
        try:
            return await self._respond_whole(request, choices, endpoint.shape, header)
        except ApiError:
            raise
        except Exception as exc:  # the generations counted it as an error when their relays ended
            return _server_fault(exc)

    def _refused(self, request_id: str, endpoint: Endpoint, status: int, outcome: str, clock: DeliveryClock) -> None:
        """A request that never reached the engine: counted, and logged with the status it got."""
        self.server_metrics.finished(endpoint.label, outcome)
        if self.config.log_requests:
            log_request(FinishedRequest(request_id, endpoint.label, status, outcome, 0, 0, None,
                                        time.perf_counter() - clock.arrived))

    async def _admit(self, request: Request, endpoint: Endpoint, clock: DeliveryClock,
                     request_id: str) -> tuple[ChoiceSet, PreparedRequest]:
        raw = await _read_body(request, self.config.max_body_bytes)
        body = parse_body(raw, endpoint.body_type)
        limits = self._limits()
        if len(raw) <= INLINE_PREPARE_BYTES:
            prepared = _prepare(endpoint, body, limits, request_id)
        else:  # tokenizing a long prompt takes milliseconds: keep it off the event loop
            prepared = await asyncio.to_thread(_prepare, endpoint, body, limits, request_id)
        choices = self._choices(prepared, endpoint, clock)
        try:
            choices.submit()
        except RequestRejected as exc:
            raise bad_request(str(exc), exc.param, "rejected_by_engine") from None
        except EngineUnavailable as exc:
            raise unavailable(f"The server is not accepting requests: {exc}", exc.retry_after_s) from None
        return choices, prepared

    def _choices(self, prepared: PreparedRequest, endpoint: Endpoint, clock: DeliveryClock) -> ChoiceSet:
        """One generation per choice, each with its own clock from the request's arrival."""
        generations = tuple(
            Generation(self.engine, choice.generation, self.server_metrics, endpoint.label,
                       clock if i == 0 else DeliveryClock(self.server_metrics, clock.arrived),
                       stream=prepared.stream, log_requests=self.config.log_requests)
            for i, choice in enumerate(prepared.choices))
        formats = tuple(None if c.generation.logprobs is None else endpoint.logprobs(self.engine.tokenizer, c.generation.logprobs)
                        for c in prepared.choices)  # one each: a completion's text offsets run on per choice
        return ChoiceSet(generations, tuple(c.prefix for c in prepared.choices), prepared.prompt_tokens, formats,
                         echoes=tuple(c.echo for c in prepared.choices), prompt_top=prepared.prompt_logprobs)

    async def _respond_whole(self, request: Request, choices: ChoiceSet, shape: ResponseShape, header: ResponseHeader) -> Response:
        try:
            results = await collect(choices, request.receive)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        except GenerationFailed as exc:
            raise generation_failed(exc) from None
        return JSONResponse(shape.full(header, results, choices.usage))


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


def _tokenizer_call(answer: Callable[..., dict], body, limits: ModelLimits) -> dict:
    """``answer(body, limits)``, where a tokenizer or template that chokes on the input is a 400, as in ``_prepare``."""
    try:
        return answer(body, limits)
    except ApiError:
        raise
    except Exception as exc:
        log.warning("tokenize/detokenize raised; answering 400", exc_info=True)
        raise bad_request(f"The tokenizer or chat template failed on this input ({type(exc).__name__}: "
                          f"{cut(str(exc))}).", code="invalid_value") from None


def flare_version() -> str:
    """The installed ``flare`` distribution's version (pyproject.toml)."""
    try:
        return metadata.version("flare")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


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
