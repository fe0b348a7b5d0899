"""OpenAI response and stream-chunk bodies for the two generation endpoints.

One ``ResponseShape`` per endpoint knows its ``object`` names and where the
text goes (``text`` for completions, ``message`` / ``delta`` for chat); the
rest (ids, ``created``, ``model``, ``usage``) is common. Every choice and
chunk carries its choice's ``index``; a choice the engine failed while others
of its response did not has ``finish_reason: "error"`` and an ``error``
object in OpenAI's error shape.
A choice's ``logprobs`` is null unless the request asked (``helios.server.logprobs``
builds the object).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    """One choice of a whole (non-streamed) response."""

    index: int
    text: str
    finish_reason: str
    error: dict | None = None  # {"message", "type", "param", "code"} of a choice that failed alone
    logprobs: dict | None = None  # the endpoint's logprobs object, when the request asked
    prompt_logprobs: list | None = None  # vLLM's prompt_logprobs, when the request asked

    def body(self, content: dict) -> dict:
        """The choice with ``content`` (its ``text``, or its ``message``)."""
        return ({"index": self.index, **content, "logprobs": self.logprobs, "finish_reason": self.finish_reason}
                | _error(self.error))


@dataclass(frozen=True, slots=True)
class Usage:
    """A response's token counts; ``cached_tokens``: prompt tokens restored from a checkpoint instead of
    prefilled (prefix reuse, docs/checkpoints.md), 0 when none was."""

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
    """``/v1/completions``: ``text_completion`` objects, text in ``choices[i].text``."""

    def full(self, header: ResponseHeader, results: list[ChoiceResult], usage: Usage) -> dict:
        choices = [r.body({"text": r.text}) | _prompt_logprobs(r.prompt_logprobs) for r in results]
        return _envelope(header, "text_completion", choices) | {"usage": usage.body()}

    def first_chunk(self, header: ResponseHeader, index: int) -> dict | None:
        return None  # completions streams have no role preamble

    def chunk(self, header: ResponseHeader, index: int, text: str, finish_reason: str | None,
              error: dict | None = None, logprobs: dict | None = None) -> dict:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return _envelope(header, "text_completion", [choice | _error(error)])

    def usage_chunk(self, header: ResponseHeader, usage: Usage) -> dict:
        return _envelope(header, "text_completion", []) | {"usage": usage.body()}


@dataclass(frozen=True, slots=True)
class ChatShape:
    """``/v1/chat/completions``: ``chat.completion`` bodies and ``chat.completion.chunk`` deltas."""

    def full(self, header: ResponseHeader, results: list[ChoiceResult], usage: Usage) -> dict:
        choices = [r.body({"message": {"role": "assistant", "content": r.text}}) for r in results]
        # vLLM reports a chat request's prompt_logprobs once, beside its choices (they share the prompt)
        scored = next((r.prompt_logprobs for r in results if r.prompt_logprobs is not None), None)
        return _envelope(header, "chat.completion", choices) | {"usage": usage.body()} | _prompt_logprobs(scored)

    def first_chunk(self, header: ResponseHeader, index: int) -> dict | None:
        # OpenAI opens each choice of a chat stream with the role and empty content.
        return self._chunk(header, index, {"role": "assistant", "content": ""}, None)

    def chunk(self, header: ResponseHeader, index: int, text: str, finish_reason: str | None,
              error: dict | None = None, logprobs: dict | None = None) -> dict:
        return self._chunk(header, index, {"content": text} if text else {}, finish_reason, error, logprobs)

    def usage_chunk(self, header: ResponseHeader, usage: Usage) -> dict:
        return _envelope(header, "chat.completion.chunk", []) | {"usage": usage.body()}

    def _chunk(self, header: ResponseHeader, index: int, delta: dict, finish_reason: str | None,
               error: dict | None = None, logprobs: dict | None = None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return _envelope(header, "chat.completion.chunk", [choice | _error(error)])


ResponseShape = CompletionShape | ChatShape


def _envelope(header: ResponseHeader, obj: str, choices: list[dict]) -> dict:
    return {"id": header.id, "object": obj, "created": header.created, "model": header.model, "choices": choices}


def _prompt_logprobs(scores: list | None) -> dict:
    return {} if scores is None else {"prompt_logprobs": scores}


def _error(error: dict | None) -> dict:
    return {} if error is None else {"error": error}
