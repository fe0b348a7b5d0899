"""Server-sent events for ``stream: true``: one ``data:`` event per chunk, then ``data: [DONE]``.

Plain ``text/event-stream`` framing over Starlette's ``StreamingResponse``:
the protocol is three lines of code, and Starlette already cancels the body
iterator when the client disconnects, which is what cancels the request
(``Generation.deltas``).

Usage rides only on a final chunk with empty ``choices``, and only when the
client asked with ``stream_options.include_usage``; every earlier chunk then
carries ``"usage": null``, as OpenAI's do.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse

from helios.engine_api import GenerationFailed
from helios.server.errors import internal
from helios.server.generation import Generation
from helios.server.responses import ResponseHeader, ResponseShape

DONE = b"data: [DONE]\n\n"


def event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    # no-cache and no proxy buffering: every event should reach the client when it is written.
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def stream_events(generation: Generation, shape: ResponseShape, header: ResponseHeader, include_usage: bool) -> AsyncIterator[bytes]:
    """The whole event stream of one request; an engine failure becomes an error event."""

    def framed(body: dict) -> bytes:
        return event(body | {"usage": None} if include_usage else body)

    first = shape.first_chunk(header)
    if first is not None:
        yield framed(first)
    try:
        async for delta in generation.deltas():
            reason = delta.finish_reason.value if delta.finish_reason else None
            if delta.text or reason:
                yield framed(shape.chunk(header, delta.text, reason))
    except GenerationFailed as exc:
        yield event(internal(f"Generation failed: {exc}").body())
    else:
        if include_usage:
            yield event(shape.usage_chunk(header, generation.usage))
    yield DONE
