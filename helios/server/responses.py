"""OpenAI response and stream-chunk bodies for the two generation endpoints.

One ``ResponseShape`` per endpoint knows its ``object`` names and where the
text goes (``text`` for completions, ``message`` / ``delta`` for chat); the
rest (ids, ``created``, ``model``, ``usage``) is common. A choice's
``logprobs`` is null unless the request asked (``helios.server.logprobs``
builds the object).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Usage:
    """A response's token counts; ``cached_tokens`` (prompt tokens served from a reused prefix) is 0
    until the engine reuses prefixes, and is reported so clients that read it find it."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def body(self) -> dict:
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass(frozen=True, slots=True)
class ResponseHeader:
    """What every body and chunk of one response repeats."""

    id: str
    created: int  # unix seconds
    model: str


@dataclass(frozen=True, slots=True)
class CompletionShape:
    """``/v1/completions``: ``text_completion`` objects, text in ``choices[0].text``."""

    def full(self, header: ResponseHeader, text: str, finish_reason: str, usage: Usage,
             logprobs: dict | None = None) -> dict:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return _envelope(header, "text_completion", [choice]) | {"usage": usage.body()}

    def first_chunk(self, header: ResponseHeader) -> dict | None:
        return None  # completions streams have no role preamble

    def chunk(self, header: ResponseHeader, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return _envelope(header, "text_completion", [choice])

    def usage_chunk(self, header: ResponseHeader, usage: Usage) -> dict:
        return _envelope(header, "text_completion", []) | {"usage": usage.body()}


@dataclass(frozen=True, slots=True)
class ChatShape:
    """``/v1/chat/completions``: ``chat.completion`` bodies and ``chat.completion.chunk`` deltas."""

    def full(self, header: ResponseHeader, text: str, finish_reason: str, usage: Usage,
             logprobs: dict | None = None) -> dict:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        return _envelope(header, "chat.completion", [choice]) | {"usage": usage.body()}

    def first_chunk(self, header: ResponseHeader) -> dict | None:
        # OpenAI opens a chat stream with the role and empty content.
        return self._chunk(header, {"role": "assistant", "content": ""}, None)

    def chunk(self, header: ResponseHeader, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        return self._chunk(header, {"content": text} if text else {}, finish_reason, logprobs)

    def usage_chunk(self, header: ResponseHeader, usage: Usage) -> dict:
        return _envelope(header, "chat.completion.chunk", []) | {"usage": usage.body()}

    def _chunk(self, header: ResponseHeader, delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return _envelope(header, "chat.completion.chunk", [choice])


ResponseShape = CompletionShape | ChatShape


def _envelope(header: ResponseHeader, obj: str, choices: list[dict]) -> dict:
    return {"id": header.id, "object": obj, "created": header.created, "model": header.model, "choices": choices}
