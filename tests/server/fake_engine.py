"""A deterministic stand-in for the runtime engine, implementing ``helios.runtime.engine_api.Engine``.

Tokens are bytes (ids 0..255) plus EOS (256). The fake "generates" by echoing
the prompt's bytes once, one token per delta, then EOS; ``max_tokens`` cuts it
short with ``length``; stop strings end it with ``stop`` and are not
delivered. So a test knows the exact output of any request from its prompt.

Hooks for failure paths: a prompt starting with ``!reject`` is refused at
submit, one starting with ``!fail`` fails after its first token; setting
``accepting = False`` makes submit raise ``EngineUnavailable``;
``begin_drain`` refuses new work and aborts what still runs after the grace. Every
submitted request and every cancellation is recorded.
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from helios.runtime.engine_api import (
    EngineStats,
    EngineUnavailable,
    FinishReason,
    GenerationFailed,
    GenerationRequest,
    RequestRejected,
    TextDelta,
)
from helios.text.chat_template import ChatTemplate

EOS = 256
FAKE_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


class ByteTokenizer:
    """UTF-8 bytes as token ids; the chat template is a Jinja string."""

    def __init__(self, template: str = FAKE_TEMPLATE) -> None:
        self.template = ChatTemplate(template)

    @property
    def vocab_size(self) -> int:
        return EOS + 1

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode(errors="replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True,
                            template_kwargs: Mapping[str, Any] | None = None) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt,
                                    template_kwargs=template_kwargs)


class FakeEngine:
    def __init__(self, context_length: int = 128, token_delay_s: float = 0.0) -> None:
        self.model_name = "fake-model"
        self.context_length = context_length
        self.tokenizer = ByteTokenizer()
        self.token_delay_s = token_delay_s
        self.first_token_delay_s = 0.0  # a queued request or a long prefill: silence before any output
        self.accepting = True
        self.base_stats = EngineStats()
        self.submitted: list[GenerationRequest] = []
        self.cancelled: list[str] = []
        self.finished: list[str] = []  # ids whose final delta was handed out
        self.started = self.stopped = False
        self.aborting = False  # set when a drain's grace period ends
        self._active: set[str] = set()

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    def begin_drain(self, grace_s: float) -> None:
        self.accepting = False
        asyncio.get_running_loop().call_later(grace_s, setattr, self, "aborting", True)

    def stats(self) -> EngineStats:
        return dataclasses.replace(self.base_stats, requests_running=len(self._active), accepting=self.accepting)

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        self._active.discard(request_id)

    def submit(self, request: GenerationRequest) -> AsyncIterator[TextDelta]:
        if not self.accepting:
            raise EngineUnavailable("draining")
        prompt = bytes(t for t in request.prompt_token_ids if t < 256)
        if prompt.startswith(b"!reject"):
            raise RequestRejected("the fake engine refuses prompts that start with !reject", "prompt")
        self.submitted.append(request)
        self._active.add(request.request_id)
        return self._generate(request, prompt)

    async def _generate(self, request: GenerationRequest, prompt: bytes) -> AsyncIterator[TextDelta]:
        try:
            async for delta in self._deltas(request, prompt):
                yield delta
        finally:
            self._active.discard(request.request_id)

    async def _deltas(self, request: GenerationRequest, prompt: bytes) -> AsyncIterator[TextDelta]:
        output, reason = planned_output(prompt, request.max_tokens, request.stop)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        await asyncio.sleep(self.first_token_delay_s)
        for i, byte in enumerate(output):
            await asyncio.sleep(self.token_delay_s)
            if request.request_id not in self._active:
                return  # cancelled: end without a finish reason
            if self.aborting:
                yield TextDelta("", (), FinishReason.ABORT)
                return
            if i == 1 and prompt.startswith(b"!fail"):
                raise GenerationFailed("the fake engine fails prompts that start with !fail")
            last = i == len(output) - 1 and reason is FinishReason.LENGTH
            if last:
                self.finished.append(request.request_id)
            yield TextDelta(decoder.decode(bytes([byte])), (byte,), reason if last else None)
        if reason is FinishReason.STOP:
            self.finished.append(request.request_id)
            yield TextDelta(decoder.decode(b"", final=True), (EOS,), FinishReason.STOP)


def planned_output(prompt: bytes, max_tokens: int, stop: Sequence[str]) -> tuple[bytes, FinishReason]:
    """What the fake will emit for a prompt: the echo, cut by a stop string or max_tokens."""
    cuts = [i for i in (prompt.find(s.encode()) for s in stop) if i >= 0]
    echo = prompt[: min(cuts)] if cuts else prompt
    if len(echo) + (0 if cuts else 1) > max_tokens:  # the EOS token counts against max_tokens
        return prompt[:max_tokens], FinishReason.LENGTH
    return echo, FinishReason.STOP
