"""The choices of one response (``n``, a list of prompts), each its own engine request, answered together.

Every choice is submitted through ``Engine.submit`` like any request, so the
scheduler sees it (fairness, pricing, ``--max-waiting``: an ``n: 16`` request
takes 16 places in the waiting line). Submission is all or nothing: when the
engine refuses one choice, those already submitted are withdrawn (cancelled,
and neither counted nor logged) and the response is that refusal.

Deltas of all choices are merged in the order they arrive, each tagged with
its choice's index. A choice that fails ends alone: the others run on, and the
response reports the failure on that choice (``finish_reason: "error"`` and an
``error`` object); only when every choice failed is the response an error as a
single request's would be. A client that leaves cancels every unfinished choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from helios.runtime.engine_api import GenerationFailed, TextDelta
from helios.server.errors import generation_failed
from helios.server.generation import Generation
from helios.server.logprobs import CompletionLogprobs, LogprobsFormat, prompt_logprobs_body
from helios.server.responses import ChoiceResult, Usage

ERROR_FINISH = "error"  # finish_reason of a choice the engine failed while other choices of its response did not


class ClientGone(Exception):
    """The client disconnected before a non-streamed response was ready."""


@dataclass(frozen=True, slots=True)
class ChoiceEvent:
    """One delta of one choice, or that choice's failure (then ``delta`` is None)."""

    index: int
    delta: TextDelta | None = None
    failure: GenerationFailed | None = None


@dataclass(slots=True)
class ChoiceSet:
    """The generations of one response, in choice order, with what each shows before its text."""

    generations: tuple[Generation, ...]
    prefixes: tuple[str, ...]  # chat's echo per choice ("" for none)
    prompt_tokens: int  # each prompt once (usage)
    formats: tuple[LogprobsFormat | None, ...] = ()  # per choice, when the request asked for logprobs
    failures: dict[int, GenerationFailed] = field(default_factory=dict)
    echoes: tuple[bool, ...] = ()  # per choice: completions' echo (the prompt leads its first delta)
    prompt_top: int | None = None  # vLLM's prompt_logprobs: alternatives per prompt token (None: not asked)
    _echoed: set[int] = field(default_factory=set)  # choices whose stream already carried the prompt

    def echoes_at_first_delta(self, index: int) -> bool:
        return bool(self.echoes) and self.echoes[index]

    def logprobs(self, index: int, delta: TextDelta) -> dict | None:
        """A streamed delta's logprobs object for choice ``index`` (None unless the request asked)."""
        fmt = self.formats[index] if self.formats else None
        return None if fmt is None else fmt.body(delta.logprobs)

    def streamed(self, index: int, delta: TextDelta) -> tuple[str, dict | None]:
        """A streamed delta's text and logprobs; an echoing choice's first one leads with its prompt (vLLM)."""
        if not self.echoes_at_first_delta(index) or index in self._echoed:
            return delta.text, self.logprobs(index, delta)
        self._echoed.add(index)
        fmt = self.formats[index] if self.formats else None
        return self.prefixes[index] + delta.text, self.echoed_logprobs(index, fmt, delta.prompt_logprobs,
                                                                         delta.logprobs)

    def echoed_logprobs(self, index: int, fmt: LogprobsFormat | None, prompt_scores, items) -> dict | None:
        if fmt is None:
            return None
        assert isinstance(fmt, CompletionLogprobs), "only completions echo the prompt with its logprobs"
        prompt = self.generations[index].request.prompt_token_ids
        return fmt.echoed(prompt, prompt_scores, items)

    def prompt_logprobs(self, index: int) -> list | None:
        """vLLM's ``prompt_logprobs`` of choice ``index``'s prompt (None unless asked)."""
        if self.prompt_top is None:
            return None
        generation = self.generations[index]
        return prompt_logprobs_body(generation.engine.tokenizer, generation.prompt_logprobs, self.prompt_top)

    def submit(self) -> None:
        """Submit every choice, or none: a refusal withdraws those already submitted, then propagates."""
        for count, generation in enumerate(self.generations):
            try:
                generation.submit()
            except BaseException:
                for earlier in self.generations[:count]:
                    earlier.withdraw()
                raise
        for generation in self.generations:
            generation.accepted()

    @property
    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, sum(g.completion_tokens for g in self.generations), self._cached_tokens())

    def _cached_tokens(self) -> int:
        """Prompt tokens served from a reused prefix, each prompt counted once (its first choice's), as
        prompt_tokens counts each prompt once; never more than prompt_tokens."""
        seen, cached = set(), 0
        for generation in self.generations:
            prompt = generation.request.prompt_token_ids
            if prompt not in seen:
                seen.add(prompt)
                cached += generation.cached_tokens
        return min(cached, self.prompt_tokens)

    @property
    def all_failed(self) -> bool:
        return len(self.failures) == len(self.generations)

    async def abandon(self) -> None:
        """Cancel every unfinished choice (idempotent)."""
        for generation in self.generations:
            await generation.abandon()

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Every choice's deltas as they arrive; a failed choice yields one failure event and ends."""
        if len(self.generations) == 1:
            async for event in self._relay(0):
                yield event
            return
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._pump(i, queue)) for i in range(len(self.generations))]
        try:
            for _ in tasks:
                while (item := await queue.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # each one's finally cancels its engine request

    async def _pump(self, index: int, queue: asyncio.Queue) -> None:
        try:
            async for event in self._relay(index):
                queue.put_nowait(event)
        except Exception as exc:  # a fault of ours, not the engine's: the consumer raises it
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    async def _relay(self, index: int) -> AsyncIterator[ChoiceEvent]:
        generation = self.generations[index]
        try:
            async for delta in generation.deltas():
                yield ChoiceEvent(index, delta)
            if generation.finish_reason is None:
                raise GenerationFailed("the engine ended the request without a finish reason")
        except GenerationFailed as exc:
            self.failures[index] = exc
            yield ChoiceEvent(index, failure=exc)

    def first_failure(self) -> GenerationFailed:
        return self.failures[min(self.failures)]


async def collect(choices: ChoiceSet, receive: Callable[[], Awaitable[dict]]) -> list[ChoiceResult]:
    """Every choice's whole answer, or ``ClientGone`` (after cancelling them all) if the client leaves first.

    Raises the first failure when every choice failed.
    """
    collector = asyncio.ensure_future(_join(choices))
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    done, _ = await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if collector in done:
        watcher.cancel()
        try:
            return collector.result()
        except BaseException:  # every choice failed, or a fault of ours: none may stay in the engine
            await choices.abandon()
            raise
    collector.cancel()
    await asyncio.gather(collector, return_exceptions=True)  # its finally cancels the engine requests
    await choices.abandon()
    raise ClientGone


async def _join(choices: ChoiceSet) -> list[ChoiceResult]:
    parts: list[list[str]] = [[prefix] for prefix in choices.prefixes]
    async for event in choices.events():
        if event.delta is not None:
            parts[event.index].append(event.delta.text)
    if choices.all_failed:
        raise choices.first_failure()
    return [_result(choices, index, "".join(texts)) for index, texts in enumerate(parts)]


def _result(choices: ChoiceSet, index: int, text: str) -> ChoiceResult:
    failure = choices.failures.get(index)
    if failure is not None:
        return ChoiceResult(index, text, ERROR_FINISH, generation_failed(failure).body()["error"])
    generation = choices.generations[index]
    reason = generation.finish_reason
    assert reason is not None, "a choice that did not fail has finished"
    fmt = choices.formats[index] if choices.formats else None
    if choices.echoes_at_first_delta(index):
        logprobs = choices.echoed_logprobs(index, fmt, generation.prompt_logprobs, generation.logprobs)
    else:
        logprobs = None if fmt is None else fmt.body(generation.logprobs)
    return ChoiceResult(index, text, reason.value, logprobs=logprobs, prompt_logprobs=choices.prompt_logprobs(index))


async def _wait_for_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    # Once the body is read, the server's next message for this request is its disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass
