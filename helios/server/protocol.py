"""OpenAI request bodies: parse, validate, and turn into a ``GenerationRequest``.

Two steps. ``parse_body`` checks shapes and types (strict: "0.5" is not a
number, 1 is not a bool) and ignores fields it does not know, as
OpenAI-compatible servers do. ``prepare_completion`` / ``prepare_chat`` check
what needs the engine: the model name, the tokenized prompt against the
context length, and the defaults that depend on them.

Choices made where OpenAI leaves room (docs/http-api.md lists them):
``top_k`` absent, null or -1 means no cut (-1 is vLLM's spelling), 0 and
values below -1 are refused, values above the vocabulary are clamped to it;
``seed`` is any 64-bit integer, signed or unsigned, and reaches the engine as
the int64 with the same 64 bits (the program input is int64; the sampler
reads the bits); ``max_tokens`` defaults to 16 for completions
(OpenAI's default) and to the rest of the context for chat, and
``max_completion_tokens`` wins over it on both endpoints. ``n`` choices per
prompt (at most ``MAX_N``) and lists of prompts become one
``GenerationRequest`` per choice, in OpenAI's order (prompt-major), each with
its own seed (``choice_seed``). ``logprobs`` (completions: 0..20 alternatives;
chat: ``logprobs: true`` with ``top_logprobs`` 0..20), the penalties,
``logit_bias`` (at most 300 token ids of the vocabulary, values in [-100,
100]), ``min_p``, ``min_tokens`` (not with stop strings, which vLLM would not
check before it), ``ignore_eos``, ``stop_token_ids`` and
``include_stop_str_in_output`` are honoured, and so are completions' ``echo`` (the prompt's text, and
with ``logprobs`` its scores, lead the answer; ``max_tokens`` may then be 0) and vLLM's
``prompt_logprobs`` (both scored by the scored-prefill programs, spec C1); fields that would change the
output in ways the engine cannot honour (suffix, tools, and
the OpenAI and vLLM fields in ``UNHONOURED`` unless they carry the value that
asks for nothing) are refused rather than silently ignored.

Nothing a client sends may make the server fail: every exception while
decoding or validating a body is a 400 (JSON nested beyond what the parser
recurses through, text with a lone UTF-16 surrogate, which no tokenizer can
encode, included).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from helios.runtime.engine_api import (
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    ChatTemplateError,
    EngineTokenizer,
    GenerationRequest,
    SamplingParams,
    fewest_tokens,
)
from helios.server.errors import ApiError, bad_request, cut, model_not_found

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 4  # OpenAI's limit
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SEED_RANGE = (-(2**63), 2**64 - 1)  # int64 or uint64; see _int64_seed
MAX_ENDPOINTS = 8  # message boundaries reported per chat request (the latest ones)
MAX_N = 16  # choices per prompt
MAX_CHOICES = 256  # prompts x n per request: each choice is an engine request (--max-waiting's default)
GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (choice_seed)


def _unicode_text(value: str) -> str:
    """``value`` if it is Unicode text; JSON's ``\\ud800`` escapes can give lone surrogates, which are not."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains a lone UTF-16 surrogate (U+{ord(value[exc.start]):04X} at character {exc.start}), "
                         "which is not a character; escape characters beyond U+FFFF as a surrogate pair") from None
    return value


Text = Annotated[str, AfterValidator(_unicode_text)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # only false: refused otherwise (UNHONOURED_STREAM_OPTIONS)


class _GenerationBody(_Body):
    """Fields both endpoints share."""

    model: Text
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    n: int | None = Field(None, ge=1, le=MAX_N)
    max_completion_tokens: int | None = None  # wins over max_tokens when both are given
    stop: Any = ()  # normalised to a tuple of strings by _stop
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool | None = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM's: scored prefill (spec C1)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
        for key, bias in value.items():
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"keys are token ids written as decimal strings, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases lie in [-100, 100], got {bias} for token {key}")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> tuple[str, ...]:
        stops = [value] if isinstance(value, str) else value  # one string is one stop string
        if stops is None:
            return ()
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("must be a string or a list of strings")
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, each non-empty")
        return tuple(_unicode_text(s) for s in stops)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value != -1 and value < 1:
            raise ValueError("must be -1 or null (no top-k cut) or an integer >= 1")
        return None if value == -1 else value


class CompletionBody(_GenerationBody):
    prompt: Any = Field(...)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> tuple[str | tuple[int, ...], ...]:
        """The prompts: one string or one list of token ids, or a list of those (a batch, answered in order)."""
        if isinstance(value, str) or _is_token_ids(value):
            return (_one_prompt(value, None),)
        if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
            if len(value) > MAX_CHOICES:
                raise ValueError(f"at most {MAX_CHOICES} prompts per request, got {len(value)}")
            return tuple(_one_prompt(p, i) for i, p in enumerate(value))
        raise ValueError("must be a non-empty string, a non-empty list of token ids, or a non-empty list of those")


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _one_prompt(value: Any, index: int | None) -> str | tuple[int, ...]:
    where = "" if index is None else f"prompt {index} "
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{where}must not be empty")
        return _unicode_text(value)
    if _is_token_ids(value):
        return tuple(value)
    raise ValueError(f"{where}must be a non-empty string or a non-empty list of token ids")


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: Text | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> str:
        if value is None or isinstance(value, str):
            return _unicode_text(value or "")
        if isinstance(value, list):
            return _unicode_text("".join(_text_part(part) for part in value))
        raise ValueError("must be a string or a list of text parts")


def _text_part(part: Any) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise ValueError(f"only text content parts are supported, got {kind!r}")


class ChatBody(_GenerationBody):
    messages: list[ChatMessage]
    echo: bool | None = False  # vLLM's: the final message's content starts each choice's answer (see _echoed)
    add_generation_prompt: bool | None = None  # default true, false with continue_final_message
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # further template variables, e.g. enable_thinking
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, value: Any) -> Any:
        if not isinstance(value, list) or not value:
            raise ValueError("must be a non-empty list of {role, content} messages")
        return value


BodyT = TypeVar("BodyT", bound=_Body)


def parse_body(raw: bytes, model: type[BodyT]) -> BodyT:
    """JSON bytes -> a validated body, or a 400 naming the first thing wrong (never any other exception)."""
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise bad_request("The request body is not valid JSON: it nests arrays or objects too deeply.",
                          code="invalid_json") from None
    except Exception as exc:  # ValueError, UnicodeDecodeError, and whatever else the parser may raise
        raise bad_request(f"The request body is not valid JSON: {cut(str(exc), 200)}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"The request body must be a JSON object, got {type(data).__name__}.", code="invalid_json")
    _refuse_unhonoured(data, model)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    except Exception as exc:  # a validator that raised something other than ValueError: still the body's fault
        log.warning("validating a request body raised %s; answering 400", type(exc).__name__, exc_info=True)
        raise bad_request(f"The request body could not be validated ({type(exc).__name__}).", code="invalid_value") from None


# Fields of the OpenAI API and of vLLM's extensions that would change what is generated or returned,
# which this engine does not do yet, with the values that ask for nothing (sent by clients that fill
# in defaults). Any other value is refused with 400 unsupported_parameter rather than ignored.
UNHONOURED: dict[str, tuple[Any, ...]] = {
    "response_format": (None, {"type": "text"}),
    "tool_choice": (None, "none", "auto"),
    "length_penalty": (None, 1, 1.0),
    "use_beam_search": (None, False),
    "truncate_prompt_tokens": (None,),
    "add_generation_prompt": (None, True),  # honoured by chat and /tokenize, which define it
    "continue_final_message": (None, False),  # honoured by chat
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),  # honoured by chat, which defines it
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,),
    # OpenAI fields with no meaning for a text-only model without tools, and vLLM's scheduling/id controls
    "audio": (None,), "modalities": (None, ["text"]), "functions": (None, []), "function_call": (None, "none"),
    "web_search_options": (None,), "prediction": (None,), "reasoning_effort": (None,), "verbosity": (None,),
    "priority": (None, 0), "request_id": (None,),
}
UNHONOURED_STREAM_OPTIONS: dict[str, tuple[Any, ...]] = {"continuous_usage_stats": (None, False)}


def _refuse_unhonoured(data: dict, model: type[BaseModel]) -> None:
    """400 ``unsupported_parameter`` for a known field the engine would not honour (``UNHONOURED``);
    a field the body model defines is honoured by that endpoint and validated there instead."""
    for name, harmless in UNHONOURED.items():
        if name in data and name not in model.model_fields and not _is_one_of(data[name], harmless):
            raise bad_request(f"Unsupported '{name}': this server does not implement it yet; omit it or send "
                              f"{_harmless(harmless)} (got {_shown(data[name])}).", name, "unsupported_parameter")
    options = data.get("stream_options")
    for name, harmless in UNHONOURED_STREAM_OPTIONS.items():
        if isinstance(options, dict) and name in options and not _is_one_of(options[name], harmless):
            raise bad_request(f"Unsupported 'stream_options.{name}': this server does not implement it yet "
                              f"(got {_shown(options[name])}).", f"stream_options.{name}", "unsupported_parameter")


def _is_one_of(value: Any, harmless: tuple[Any, ...]) -> bool:
    # type-exact: true is not 1, and 1 is not true
    return any(type(value) is type(h) and value == h for h in harmless)


def _harmless(values: tuple[Any, ...]) -> str:
    return " or ".join(json.dumps(v) for v in values)


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _validation_error(exc: ValidationError) -> ApiError:
    first = exc.errors(include_url=False)[0]
    param = ".".join(str(part) for part in first["loc"])
    if first["type"] == "missing":
        return bad_request(f"Missing required field '{param}'.", param, "missing_field")
    message = first["msg"].removeprefix("Value error, ")
    return bad_request(f"Invalid '{param}': {message} (got {_shown(first.get('input'))}).", param, "invalid_value")


def _shown(value: Any) -> str:
    """A client's value, quoted in an error message: JSON, ASCII-only (lone surrogates escaped), cut short."""
    try:
        text = json.dumps(value) if not isinstance(value, BaseModel) else repr(value)
    except (RecursionError, TypeError, ValueError):
        text = f"a {type(value).__name__} nested too deeply to show"
    return cut(text)


@dataclass(frozen=True, slots=True)
class Choice:
    """One choice of a response and the engine request that produces it."""

    index: int  # its place in ``choices``: prompt-major, then choice (OpenAI's order)
    generation: GenerationRequest
    prefix: str = ""  # text the answer shows before the generated text (chat's echo, completions' echoed prompt)
    echo: bool = False  # completions' echo: the prompt's text, and its logprobs when asked, lead the first delta


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A validated request: what to ask the engine, and how to answer the client."""

    response_id: str
    choices: tuple[Choice, ...]
    prompt_tokens: int  # usage's prompt_tokens: each prompt once, however many choices it has
    stream: bool
    include_usage: bool
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: alternatives per prompt token in the answer


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What validation needs from the engine."""

    model_name: str
    context_length: int
    tokenizer: EngineTokenizer


@dataclass(frozen=True, slots=True)
class PromptPlan:
    """One prompt, ready to submit n times."""

    ids: tuple[int, ...]
    max_tokens: int
    endpoints: tuple[int, ...] = ()
    prefix: str = ""


@dataclass(frozen=True, slots=True)
class Scoring:
    """What a request asks of the prompt: output logprobs, prompt scores (spec C1), and the echo."""

    logprobs: int | None = None  # alternatives per output token (None: no logprobs)
    prompt: int | None = None  # alternatives per prompt token the engine reports (None: the prompt is not scored)
    echo: bool = False  # completions: the prompt leads each answer


def prepare_completion(body: CompletionBody, limits: ModelLimits, request_id: str) -> PreparedRequest:
    _check_common(body, limits)
    n = body.n or 1
    _refuse_if(body.prompt_logprobs is not None and bool(body.stream), "prompt_logprobs",
               "is not available with stream: true (as in vLLM); echo with logprobs streams the prompt's scores")
    _refuse_if(body.suffix is not None, "suffix", "suffixes (insertion) are not supported by this server")
    if body.best_of is not None and body.best_of < n:
        raise bad_request(f"Invalid 'best_of': must be at least n ({n}), got {body.best_of}.", "best_of", "invalid_value")
    _refuse_if(body.best_of not in (None, n), "best_of", f"must equal n ({n}): this server returns every choice it "
               f"generates and does not rank them (got {body.best_of})")
    if len(body.prompt) * n > MAX_CHOICES:
        raise bad_request(f"Invalid 'n': {len(body.prompt)} prompts x n={n} is {len(body.prompt) * n} choices, more "
                          f"than the {MAX_CHOICES} a request may ask for.", "n", "invalid_value")
    param = "prompt" if len(body.prompt) == 1 else "prompt.{}"
    plans = [_completion_plan(prompt, param.format(i), body, limits) for i, prompt in enumerate(body.prompt)]
    echo = bool(body.echo)
    # echo with logprobs scores the prompt with that many alternatives (vLLM), prompt_logprobs with its own
    asked = [k for k in (body.prompt_logprobs, body.logprobs if echo else None) if k is not None]
    return _prepared(body, limits, request_id, plans, Scoring(body.logprobs, max(asked, default=None), echo))


def _completion_plan(prompt: str | tuple[int, ...], param: str, body: CompletionBody, limits: ModelLimits) -> PromptPlan:
    if isinstance(prompt, str):
        _check_text_fits(prompt, param, limits)
        ids = tuple(limits.tokenizer.encode(prompt, add_special_tokens=True))
    else:
        ids = _checked_token_ids(prompt, param, limits.tokenizer.vocab_size)
    _check_prompt_fits(len(ids), param, limits)
    asked, which = _asked_max_tokens(body)
    max_tokens = _max_tokens(asked, which, COMPLETION_DEFAULT_MAX_TOKENS, len(ids), limits.context_length,
                             least=0 if body.echo else 1)
    echoed = "" if not body.echo else prompt if isinstance(prompt, str) else limits.tokenizer.decode(ids)
    return PromptPlan(ids, max_tokens, prefix=echoed)


def prepare_chat(body: ChatBody, limits: ModelLimits, request_id: str) -> PreparedRequest:
    _check_common(body, limits)
    _refuse_if(body.prompt_logprobs is not None and bool(body.stream), "prompt_logprobs",
               "is not available with stream: true (as in vLLM)")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("Invalid 'top_logprobs': it needs 'logprobs' set to true.", "top_logprobs", "invalid_value")
    _refuse_if(bool(body.tools), "tools", "tool calling is not supported by this server")
    messages = [{"role": m.role, "content": m.content} for m in body.messages]
    _refuse_if(body.continue_final_message and body.add_generation_prompt is True, "continue_final_message",
               "cannot continue the final message and also open a new one: leave add_generation_prompt out or false")
    kwargs = body.chat_template_kwargs or None
    opens_turn = body.add_generation_prompt is not False and not body.continue_final_message
    ids = _render_chat(messages, limits, add_generation_prompt=opens_turn, continue_final=body.continue_final_message,
                       template_kwargs=kwargs)
    _check_prompt_fits(len(ids), "messages", limits)
    asked, which = _asked_max_tokens(body)
    max_tokens = _max_tokens(asked, which, limits.context_length - len(ids), len(ids), limits.context_length)
    prefix = _echoed(messages, opens_turn) if body.echo else ""
    plan = PromptPlan(ids, max_tokens, _message_endpoints(messages, ids, limits.tokenizer, kwargs), prefix)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _prepared(body, limits, request_id, [plan], Scoring(logprobs, body.prompt_logprobs))


def _echoed(messages: list[dict[str, str]], opens_turn: bool) -> str:
    """What ``echo`` puts before a chat answer, as vLLM does: the final message's content when the answer
    continues that message's role (a new assistant turn continues only an assistant message)."""
    final = messages[-1]
    return final["content"] if not opens_turn or final["role"] == "assistant" else ""


def _asked_max_tokens(body: _GenerationBody) -> tuple[int | None, str]:
    """The output bound the client asked for and the field it came from: ``max_completion_tokens`` wins."""
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def _check_common(body: _GenerationBody, limits: ModelLimits) -> None:
    if body.model != limits.model_name:
        raise model_not_found(body.model, limits.model_name)
    _refuse_if(body.stream_options is not None and not body.stream, "stream_options", "only allowed when stream is true")
    vocab = limits.tokenizer.vocab_size
    for name, ids in (("logit_bias", [int(k) for k in body.logit_bias or {}]), ("stop_token_ids", body.stop_token_ids or [])):
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"Invalid '{name}': token id {bad} is outside the vocabulary [0, {vocab}).", name,
                              "invalid_value")
    _refuse_if(bool(body.min_tokens) and bool(body.stop), "min_tokens",
               "with stop strings is not supported: stop strings would not wait for min_tokens, as they do in vLLM")


def _refuse_if(condition: bool, param: str, message: str) -> None:
    if condition:
        raise bad_request(f"Unsupported '{param}': {message}.", param, "unsupported_parameter")


def _checked_token_ids(ids: tuple[int, ...], param: str, vocab_size: int) -> tuple[int, ...]:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"Invalid '{param}': token id {bad} is outside the vocabulary [0, {vocab_size}).", param, "invalid_value")
    return ids


def _render_chat(messages: list[dict[str, str]], limits: ModelLimits, *, add_generation_prompt: bool = True,
                 continue_final: bool = False, template_kwargs: dict[str, Any] | None = None) -> tuple[int, ...]:
    """The chat prompt's token ids: the template over ``messages``, with the generation prompt or not.

    ``continue_final`` (vLLM's ``continue_final_message``): the prompt ends right after the final
    message's content, so the model continues that message instead of starting a new one; the
    template's closing text for it (an end-of-turn token) is cut off.
    """
    try:
        text = limits.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                    template_kwargs=template_kwargs)
    except ChatTemplateError as exc:
        param = "chat_template_kwargs" if "chat_template_kwargs" in str(exc) else "messages"
        raise bad_request(f"Invalid '{param}': {exc}", param, "invalid_value") from None
    if continue_final:
        final = messages[-1]["content"]
        end = text.rfind(final) if final else -1
        if end < 0:
            raise bad_request("Invalid 'continue_final_message': the final message has no content, or the chat "
                              "template does not render it verbatim, so there is nothing to continue.",
                              "continue_final_message", "invalid_value")
        text = text[:end + len(final)]
    _check_text_fits(text, "messages", limits)
    return tuple(limits.tokenizer.encode(text, add_special_tokens=False))


def _message_endpoints(messages: list[dict[str, str]], ids: tuple[int, ...], tokenizer: EngineTokenizer,
                       template_kwargs: dict[str, Any] | None = None) -> tuple[int, ...]:
    """Prompt offsets where each message ends (spec K1 anchors), where the template makes them exact.

    A message's end is exact when the template rendered over the messages up
    to it tokenizes to a prefix of the full prompt; templates that rewrite
    earlier text when later messages arrive give fewer endpoints, never wrong ones.
    Only the last ``MAX_ENDPOINTS`` messages are tried: each try renders and
    tokenizes a prefix, and the scheduler weighs the latest anchors first.
    """
    endpoints: list[int] = []
    for count in range(max(1, len(messages) - MAX_ENDPOINTS), len(messages)):
        try:
            text = tokenizer.apply_chat_template(messages[:count], add_generation_prompt=False,
                                                 template_kwargs=template_kwargs)
            head = tokenizer.encode(text, add_special_tokens=False)
        except ChatTemplateError:
            continue  # e.g. a template that refuses a conversation ending on a system message
        if 0 < len(head) < len(ids) and tuple(head) == ids[: len(head)] and (not endpoints or len(head) > endpoints[-1]):
            endpoints.append(len(head))
    return tuple(endpoints)


def _check_text_fits(text: str, param: str, limits: ModelLimits) -> None:
    """Refuse text whose length alone proves it over the context, before tokenizing it (megabytes take seconds)."""
    fewest = fewest_tokens(limits.tokenizer, text)
    if fewest >= limits.context_length:
        raise bad_request(
            f"The prompt is {len(text)} characters, so at least {fewest} tokens, but this model's context length is "
            f"{limits.context_length} tokens, and prompt plus at least one output token must fit.", param, "context_length_exceeded")


def _check_prompt_fits(prompt_tokens: int, param: str, limits: ModelLimits) -> None:
    if prompt_tokens >= limits.context_length:
        raise bad_request(
            f"The prompt is {prompt_tokens} tokens, but this model's context length is {limits.context_length} "
            f"tokens, and prompt plus at least one output token must fit.", param, "context_length_exceeded")


def _max_tokens(asked: int | None, param: str, default: int, prompt_tokens: int, context: int, least: int = 1) -> int:
    """The output bound; ``least`` 0 (completions with echo) lets the answer be the scored prompt alone."""
    if asked is None:
        return min(default, context - prompt_tokens)
    if asked < least:
        needs = " (0 only with echo)" if least else ""
        raise bad_request(f"Invalid '{param}': must be at least {least}{needs}, got {asked}.", param, "invalid_value")
    if prompt_tokens + asked > context:
        raise bad_request(
            f"This model's context length is {context} tokens; the request has {prompt_tokens} prompt tokens "
            f"and asks for {param}={asked} ({prompt_tokens + asked} in total). Lower {param} to at most "
            f"{context - prompt_tokens} or shorten the prompt.", param, "context_length_exceeded")
    return asked


def _prepared(body: _GenerationBody, limits: ModelLimits, request_id: str, plans: list[PromptPlan],
              scoring: Scoring) -> PreparedRequest:
    """``n`` engine requests per prompt, prompt-major; one choice keeps the response's id as its request id."""
    n = body.n or 1
    single = len(plans) * n == 1
    min_tokens = body.min_tokens or 0
    choices = []
    for p, plan in enumerate(plans):
        if min_tokens > plan.max_tokens:
            raise bad_request(f"Invalid 'min_tokens': {min_tokens} is more than the {plan.max_tokens} tokens the "
                              "request may generate (max_tokens).", "min_tokens", "invalid_value")
        for j in range(n):
            index = p * n + j
            rid = request_id if single else f"{request_id}-{index}"
            generation = GenerationRequest(rid, plan.ids, plan.max_tokens, _sampling(body, limits, j), body.stop,
                                           plan.endpoints, logprobs=scoring.logprobs, min_tokens=min_tokens,
                                           ignore_eos=bool(body.ignore_eos),
                                           stop_token_ids=tuple(body.stop_token_ids or ()),
                                           include_stop_str_in_output=bool(body.include_stop_str_in_output),
                                           prompt_logprobs=_prompt_scores(scoring, plan))
            choices.append(Choice(index, generation, plan.prefix, scoring.echo))
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    return PreparedRequest(request_id, tuple(choices), sum(len(plan.ids) for plan in plans), bool(body.stream),
                           include_usage, body.prompt_logprobs)


def _prompt_scores(scoring: Scoring, plan: PromptPlan) -> int | None:
    """Alternatives per prompt token the engine reports; an answer of the prompt alone (max_tokens 0)
    is the scored prompt ending, so it is scored even when nobody reads the scores."""
    if scoring.prompt is None and plan.max_tokens == 0:
        return 0
    return scoring.prompt


def _sampling(body: _GenerationBody, limits: ModelLimits, choice: int) -> SamplingParams:
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=None if body.top_k is None else min(body.top_k, limits.tokenizer.vocab_size),  # a wider cut cuts nothing
        seed=None if body.seed is None else choice_seed(_int64_seed(body.seed), choice),
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=tuple(sorted((int(k), v) for k, v in (body.logit_bias or {}).items())),
    )


def choice_seed(seed: int, choice: int) -> int:
    """The seed of a prompt's choice number ``choice`` when the request's (int64) seed is ``seed``.

    Choice 0 keeps the seed itself, so it is the answer the same request with
    ``n: 1`` gets; choice j > 0 gets SplitMix64's output for ``seed + j x
    0x9E3779B97F4A7C15`` (mod 2**64), as the int64 with the same bits. The
    choice number counts within one prompt, so a prompt answers the same in a
    batch as alone.
    """
    if choice == 0:
        return seed
    z = (seed + choice * GOLDEN_GAMMA) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return _int64_seed(z ^ (z >> 31))


def _int64_seed(seed: int) -> int:
    """A seed in ``SEED_RANGE`` as the int64 with the same 64 bits: 2**64 - 1 and -1 are one seed.

    The engine's ``seed`` input is int64 and its sampler reads the seed's bits
    (helios.runtime.executor.int64_seed does the same for the engine's other callers).
    """
    return (seed + 2**63) % 2**64 - 2**63
