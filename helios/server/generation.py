"""One engine submission as the server drives it: relay, count, and cancel if abandoned.

Whatever ends the relay early (a client that disconnects, a stream the server
stops reading, a failure) reaches ``Generation.deltas``' ``finally`` or, for
a stream that never started relaying, the response's ``abandon()``; both
cancel the request in the engine unless it already finished, once. The
close is also where a request is accounted for: its outcome counted, its
latency phases observed (when it reached a finish reason), and its access-log
line written (when ``log_requests``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from helios.runtime.engine_api import (
    Engine,
    FinishReason,
    GenerationFailed,
    GenerationRequest,
    QueueTimeout,
    TextDelta,
    TokenLogprob,
)
from helios.server.metrics import FINISH_OUTCOMES, DeliveryClock, ServerMetrics
from helios.server.request_log import FinishedRequest, log_request

CLIENT_CLOSED = 499  # nginx's status for "client closed request": nobody reads it, logs do


@dataclass(slots=True)
class Generation:
    """Relays one request's deltas and keeps its usage and outcome."""

    engine: Engine
    request: GenerationRequest
    metrics: ServerMetrics
    endpoint: str  # metric label: "completions" | "chat"
    clock: DeliveryClock
    stream: bool = False  # a streamed response is a 200 whatever ends it
    log_requests: bool = False
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine restored from a checkpoint
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # every delta's, in order (when the request asked)
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()  # the prompt's scores (the first delta's, when asked)
    _stream: AsyncIterator[TextDelta] | None = field(default=None, repr=False)
    _failure: Exception | None = None
    _closed: bool = False

    def submit(self) -> None:
        """Hand the request to the engine; raises RequestRejected / EngineUnavailable at once.

        Its prompt tokens are counted by ``accepted`` once every choice of the response was submitted.
        """
        self._stream = self.engine.submit(self.request)
        self.clock.handed_over()

    def accepted(self) -> None:
        self.metrics.prompt_tokens.inc(len(self.request.prompt_token_ids))

    def withdraw(self) -> None:
        """Take back a submitted request whose response was refused (another choice of it was): cancelled
        in the engine, and neither counted nor logged, since the refusal is. Its iterator never started,
        so there is nothing to close."""
        self._closed = True
        self.engine.cancel(self.request.request_id)

    async def deltas(self) -> AsyncIterator[TextDelta]:
        assert self._stream is not None, "submit() before deltas()"
        outcome = "cancelled"
        try:
            async for delta in self._stream:
                self._count(delta)
                yield delta
                if delta.finish_reason is not None:
                    outcome = delta.finish_reason.value
                    break
        except Exception as exc:  # GenerationFailed, or a fault of ours: either way the request ended in error
            outcome, self._failure = "error", exc
            raise
        finally:
            await self._close(outcome)

    def _count(self, delta: TextDelta) -> None:
        self.completion_tokens += len(delta.token_ids)
        self.cached_tokens = delta.cached_tokens
        self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs:
            self.prompt_logprobs = delta.prompt_logprobs
        self.clock.delivered(len(delta.token_ids))
        if delta.finish_reason is not None:
            self.clock.ended()
            self.finish_reason = delta.finish_reason

    async def abandon(self) -> None:
        """End the relay wherever it stands: cancels the request unless it finished (idempotent)."""
        await self._close("cancelled")

    async def _close(self, outcome: str) -> None:
        if self._closed:
            return
        self._closed = True
        if self.finish_reason is None:
            self.engine.cancel(self.request.request_id)
        self._account(outcome)
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            await aclose()

    def _account(self, outcome: str) -> None:
        prompt_tokens = len(self.request.prompt_token_ids)
        self.metrics.finished(self.endpoint, outcome)
        if outcome in FINISH_OUTCOMES:
            self.metrics.completed(self.clock, prompt_tokens, self.completion_tokens)
        if outcome in ("cancelled", FinishReason.ABORT.value):
            self.metrics.aborted("client_gone" if outcome == "cancelled" else "shutdown_drain")
        if self.log_requests:
            log_request(FinishedRequest(self.request.request_id, self.endpoint, self._status(outcome), outcome,
                                        prompt_tokens, self.completion_tokens, self.clock.ttft_s,
                                        time.perf_counter() - self.clock.arrived))

    def _status(self, outcome: str) -> int:
        """The status the client got: a stream's headers (200) went out before its end was known."""
        if self.stream or outcome in FINISH_OUTCOMES:
            return 200
        if outcome == "cancelled":
            return CLIENT_CLOSED
        return 503 if isinstance(self._failure, QueueTimeout) else 500
