"""One streamed request against an OpenAI-compatible server, timed chunk by chunk.

A *content chunk* is an SSE event whose ``choices`` is non-empty and whose
first choice carries text (``text`` for completions, ``delta.content`` for
chat) or a finish reason. Chat's opening role-only chunk is not one: servers
may send it before generating anything (Flare does), and counting it would
make TTFT measure the connection, not the model. The usage-only chunk that
``stream_options.include_usage`` adds gives the token counts. Every failure
(HTTP status, a mid-stream error event, a dropped connection, no content) is
recorded on the result, never raised.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from helios.bench.datasets import BenchRequest

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(slots=True)
class RequestResult:
    """What one request saw, on the ``time.perf_counter`` clock (seconds)."""

    request: BenchRequest
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_chars: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None  # from the server's usage, when it sends one
    completion_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def output_tokens(self) -> int:
        """The server's count; without usage, one token per content chunk."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times)


@dataclass(frozen=True, slots=True)
class Target:
    """Where and how to send: base URL, endpoint kind, model name, optional bearer key."""

    url: str
    endpoint: str  # "completions" or "chat"
    model: str
    api_key: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, request: BenchRequest) -> dict:
        common = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                  "max_tokens": request.output_len, "temperature": 0.0}
        if self.endpoint == "chat":
            return common | {"messages": request.chat_messages()}
        return common | {"prompt": request.prompt}


async def send(client: httpx.AsyncClient, target: Target, request: BenchRequest) -> RequestResult:
    result = RequestResult(request)
    result.sent = time.perf_counter()
    try:
        async with client.stream("POST", target.url.rstrip("/") + ENDPOINTS[target.endpoint],
                                 json=target.body(request), headers=target.headers()) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {_error_message(body)}"
                return result
            async for line in response.aiter_lines():
                _take_line(result, line, time.perf_counter())
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if result.error is None and not result.chunk_times:
        result.error = "the stream ended without output"
    return result


def _take_line(result: RequestResult, line: str, now: float) -> None:
    if not line.startswith("data:"):
        return
    data = line.removeprefix("data:").strip()
    if data == "[DONE]" or result.error is not None:
        return
    try:
        event = json.loads(data)
    except json.JSONDecodeError:
        result.error = f"malformed event: {data[:80]!r}"
        return
    if "error" in event:
        result.error = f"stream error: {_error_message(data)}"
    elif (text := _content_text(event)) is not None:
        result.chunk_times.append(now)
        result.chunk_chars.append(len(text))
    if usage := event.get("usage"):
        result.prompt_tokens = usage.get("prompt_tokens")
        result.completion_tokens = usage.get("completion_tokens")


def _content_text(event: dict) -> str | None:
    """The text of a content chunk ("" for a bare finishing chunk); None for any other event."""
    choices = event.get("choices")
    if not choices:
        return None
    choice = choices[0]
    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
    return text or "" if text or choice.get("finish_reason") else None


def _error_message(body: str) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.strip()[:200] or "no body"
