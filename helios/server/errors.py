"""OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status.

Every refusal the server makes is an ``ApiError``; the app turns it into this
JSON. Bad input is always a 4xx whose message names the field, what was given
and what would be accepted. A 503 that a later retry may get past (the
waiting line was full, or the request waited too long for a slot) carries
``Retry-After``.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.responses import JSONResponse

from helios.runtime.engine_api import GenerationFailed, QueueTimeout

INVALID_REQUEST = "invalid_request_error"
SHOWN_CHARS = 80  # the most of a client's value an error message quotes


@dataclass(eq=False)  # not frozen: the interpreter sets __traceback__ and friends on raise
class ApiError(Exception):
    """A refusal with the status and OpenAI error fields it should be reported with."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = INVALID_REQUEST
    retry_after_s: int | None = None  # the Retry-After header, when a retry later may succeed

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, None, "invalid_api_key")


def cut(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` cut to ``limit`` characters for an error message: a client's value may be megabytes long."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def model_not_found(model: str, served: str) -> ApiError:
    # OpenAI answers an unknown model with 404 model_not_found; clients map that to NotFoundError.
    return ApiError(404, f"The model '{cut(model)}' does not exist; this server serves '{served}'.", "model", "model_not_found")


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"Request body exceeds the limit of {limit} bytes.", None, "request_too_large")


def request_timeout(message: str) -> ApiError:
    return ApiError(408, message, None, "request_timeout")


def unavailable(message: str, retry_after_s: int | None = None, code: str = "unavailable") -> ApiError:
    return ApiError(503, message, None, code, "service_unavailable", retry_after_s)


def generation_failed(exc: GenerationFailed) -> ApiError:
    """The error for a request the engine ended with a failure; one that never got a slot may be retried."""
    if isinstance(exc, QueueTimeout):
        return unavailable(f"The server is overloaded: {exc}", exc.retry_after_s, "queue_timeout")
    return internal(f"Generation failed: {exc}")


def internal(message: str) -> ApiError:
    return ApiError(500, message, None, "internal_error", "server_error")
