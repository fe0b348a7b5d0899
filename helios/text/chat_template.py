"""A checkpoint's chat template (``tokenizer_config.json: chat_template``) rendered with Jinja.

Hugging Face chat templates are Jinja programs over ``messages`` and
``add_generation_prompt``, with the tokenizer's special tokens in scope and a
``raise_exception`` helper for templates that police message order. They are
data from a checkpoint, so they run in Jinja's immutable sandbox.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from helios.runtime.engine_api import ChatTemplateError


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    # trim_blocks/lstrip_blocks: the whitespace rules the templates are written for.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """One compiled template plus the special tokens it may refer to."""

    source: str
    bos_token: str = ""
    eos_token: str = ""

    @classmethod
    def from_tokenizer_config(cls, path: Path) -> ChatTemplate:
        """Read ``chat_template`` and the BOS/EOS spellings from a tokenizer_config.json."""
        config = json.loads(Path(path).read_text())
        source = config.get("chat_template")
        if not isinstance(source, str) or not source:
            raise ChatTemplateError(f"{path}: no chat_template string (this checkpoint cannot serve chat)")
        return cls(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True,
               template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The template over ``messages``; ``template_kwargs`` are further variables the template may read
        (the request's ``chat_template_kwargs``, such as ``enable_thinking``), never the ones set here."""
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"}
        clash = sorted(reserved & set(template_kwargs or {}))
        if clash:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(clash)} (the server sets them)")
        try:
            return _compile(self.source).render(
                **dict(template_kwargs or {}),
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from exc


def _token_text(token: object) -> str:
    """Special tokens appear either as plain strings or as AddedToken dicts with a ``content``."""
    if isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return token["content"]
    return ""
