"""The access log: one line per finished generation request on the ``flare.requests`` logger.

``flare run`` sends that logger to stdout (``--disable-log-requests`` turns it
off). A line reads, for example::

    request_id=cmpl-3f2a... endpoint=completions status=200 finish_reason=stop prompt_tokens=5 output_tokens=3 ttft_s=0.012 duration_s=0.034

``finish_reason`` is the engine's (stop, length, abort) or what ended the
request otherwise: ``cancelled`` (the client left), ``error``, ``rejected``
(refused before it reached the engine: the status says why). ``ttft_s`` is
``-`` when no output token was delivered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("flare.requests")


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    request_id: str
    endpoint: str  # "completions" | "chat"
    status: int  # the HTTP status the client got (200 for any stream that started)
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None
    duration_s: float

    def line(self) -> str:
        ttft = "-" if self.ttft_s is None else f"{self.ttft_s:.3f}"
        return (f"request_id={self.request_id} endpoint={self.endpoint} status={self.status} "
                f"finish_reason={self.finish_reason} prompt_tokens={self.prompt_tokens} "
                f"output_tokens={self.output_tokens} ttft_s={ttft} duration_s={self.duration_s:.3f}")


def log_request(record: FinishedRequest) -> None:
    log.info("%s", record.line())
