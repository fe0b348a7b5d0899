"""``POST /tokenize`` and ``POST /detokenize``: vLLM's token utility routes.

Bodies follow vLLM's (``TokenizeCompletionRequest``, ``TokenizeChatRequest``,
``DetokenizeRequest``): ``model`` may be omitted, and when given must be the
served one. ``/tokenize`` takes either ``prompt`` (``add_special_tokens``
defaults to true, as for ``/v1/completions``) or ``messages`` rendered with
the checkpoint's chat template (``add_special_tokens`` defaults to false, as
for ``/v1/chat/completions``), so the ids it answers are the ids a generation
request with the same body would submit. vLLM fields this server cannot
honour (``return_token_strs``, ``tools``, and those in
``protocol.UNHONOURED``) are refused with 400, never ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import field_validator

from helios.runtime.engine_api import ChatTemplateError
from helios.server.errors import bad_request, model_not_found
from helios.server.protocol import ChatMessage, ModelLimits, Text, _Body


class TokenizeBody(_Body):
    """vLLM's two tokenize bodies in one: ``prompt`` for text, ``messages`` for chat (exactly one)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: the default of the matching generation route
    add_generation_prompt: bool = True  # chat only
    return_token_strs: bool | None = False
    tools: list[Any] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, value: Any) -> Any:
        if value is not None and (not isinstance(value, list) or not value):
            raise ValueError("must be a non-empty list of {role, content} messages")
        return value


class DetokenizeBody(_Body):
    model: Text | None = None
    tokens: list[int]


def tokenize(body: TokenizeBody, limits: ModelLimits) -> dict:
    """``{"tokens", "count", "max_model_len"}`` for a validated body."""
    _check_model(body.model, limits)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("Send exactly one of 'prompt' (text) or 'messages' (chat) to /tokenize.", "prompt",
                          "missing_field" if body.prompt is None else "invalid_value")
    if body.return_token_strs:
        raise bad_request("Unsupported 'return_token_strs': this server does not return token strings; omit it "
                          "or send false.", "return_token_strs", "unsupported_parameter")
    if body.messages is not None:
        ids = _chat_ids(body, body.messages, limits)
    else:
        assert body.prompt is not None
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = limits.tokenizer.encode(body.prompt, add_special_tokens=special)
    return {"tokens": list(ids), "count": len(ids), "max_model_len": limits.context_length}


def detokenize(body: DetokenizeBody, limits: ModelLimits) -> dict:
    """``{"prompt": text}``; an id outside the vocabulary is a 400 naming it."""
    _check_model(body.model, limits)
    _check_ids(body.tokens, limits.tokenizer.vocab_size)
    return {"prompt": limits.tokenizer.decode(body.tokens)}


def _chat_ids(body: TokenizeBody, chat: list[ChatMessage], limits: ModelLimits) -> list[int]:
    if body.tools:
        raise bad_request("Unsupported 'tools': tool calling is not supported by this server.", "tools",
                          "unsupported_parameter")
    messages = [{"role": m.role, "content": m.content} for m in chat]
    try:
        text = limits.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
    except ChatTemplateError as exc:
        raise bad_request(f"Invalid 'messages': {exc}", "messages", "invalid_value") from None
    special = bool(body.add_special_tokens)  # the rendered template already holds BOS and the like
    return limits.tokenizer.encode(text, add_special_tokens=special)


def _check_model(model: str | None, limits: ModelLimits) -> None:
    if model is not None and model != limits.model_name:
        raise model_not_found(model, limits.model_name)


def _check_ids(ids: Sequence[int], vocab_size: int) -> None:
    bad = next(((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"Invalid 'tokens': token id {bad[1]} (at index {bad[0]}) is outside the vocabulary "
                          f"[0, {vocab_size}).", "tokens", "invalid_value")
