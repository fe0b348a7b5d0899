"""Server-sent events for ``stream: true``: one ``data:`` event per chunk, then ``data: [DONE]``.

Plain ``text/event-stream`` framing over Starlette's ``StreamingResponse``
(the protocol is three lines of code). ``EventStreamResponse`` always watches
the connection while it streams, whatever ASGI spec version the server
speaks, so a client that leaves while the engine is still silent (queued,
in a long prefill) is noticed at once; and whatever ends the response, its
``on_close`` runs, which cancels an unfinished request.

Usage rides only on a final chunk with empty ``choices``, and only when the
client asked with ``stream_options.include_usage``; every earlier chunk then
carries ``"usage": null``, as OpenAI's do. With several choices (``n``, a
list of prompts) their chunks interleave as they are produced, each naming its
choice's ``index``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from helios.server.choices import ERROR_FINISH, ChoiceSet
from helios.server.errors import generation_failed
from helios.server.responses import ResponseHeader, ResponseShape

DONE = b"data: [DONE]\n\n"


def event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


class EventStreamResponse(StreamingResponse):
    """An SSE response that stops on disconnect and always runs ``on_close`` at the end."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        # no-cache and no proxy buffering: every event should reach the client when it is written.
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._stream_then_stop, send, group.cancel_scope)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        except OSError:
            pass  # the client went away mid-write: same as a disconnect
        finally:
            with anyio.CancelScope(shield=True):  # cleanup must finish even if the task is being cancelled
                await self.body_iterator.aclose()
                await self._on_close()

    async def _stream_then_stop(self, send: Send, scope: anyio.CancelScope) -> None:
        await self.stream_response(send)
        scope.cancel()


async def stream_events(choices: ChoiceSet, shape: ResponseShape, header: ResponseHeader, include_usage: bool) -> AsyncIterator[bytes]:
    """The whole event stream of one response: every choice's chunks as they come, tagged with its index,
    then the usage (summed over the choices) and ``[DONE]`` once. A choice the engine fails ends with a
    ``finish_reason: "error"`` chunk while others run on; when every choice failed, an error event
    (what a single request's failure gives) replaces the usage chunk."""

    def framed(body: dict) -> bytes:
        return event(body | {"usage": None} if include_usage else body)

    for index, prefix in enumerate(choices.prefixes):
        first = shape.first_chunk(header, index)
        if first is not None:
            yield framed(first)
        if prefix and not choices.echoes_at_first_delta(index):  # chat's echo, as vLLM sends it: one chunk after the role
            yield framed(shape.chunk(header, index, prefix, None))
    async for item in choices.events():
        if item.failure is not None:
            if not choices.all_failed:
                error = generation_failed(item.failure).body()["error"]
                yield framed(shape.chunk(header, item.index, "", ERROR_FINISH, error))
            continue
        delta = item.delta
        reason = delta.finish_reason.value if delta.finish_reason else None
        text, logprobs = choices.streamed(item.index, delta)  # completions' echo leads the first delta
        if text or reason:
            yield framed(shape.chunk(header, item.index, text, reason, logprobs=logprobs))
    if choices.all_failed:
        yield event(generation_failed(choices.first_failure()).body())
    elif include_usage:
        yield event(shape.usage_chunk(header, choices.usage))
    yield DONE
