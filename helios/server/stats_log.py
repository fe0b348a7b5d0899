"""The periodic stats line on the ``flare.stats`` logger, as vLLM prints every few seconds.

Every ``interval_s`` (``flare run --log-stats-interval``, 0: off) one line
with what runs now and what happened over the last interval::

    running: 2 reqs, waiting: 0 reqs, pages used: 12.5% (8 of 64), prompt throughput: 40.0 tokens/s, generation throughput: 31.9 tokens/s, speculative acceptance: 62.5% (10 of 16 drafts)

Throughputs are the server's counters (prompt tokens accepted, output tokens
delivered) over the interval; acceptance is over the drafts verified in the
interval, ``-`` when none were.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from helios.runtime.engine_api import EngineStats

log = logging.getLogger("flare.stats")


@dataclass(frozen=True, slots=True)
class StatsSample:
    """What one line needs at one moment: gauges now, cumulative counters since start."""

    at_s: float  # monotonic clock
    running: int
    waiting: int
    pages_used: int
    pages_free: int
    prompt_tokens: float
    generation_tokens: float
    draft_tokens: int
    accepted_tokens: int

    @classmethod
    def of(cls, stats: EngineStats, prompt_tokens: float, generation_tokens: float, at_s: float) -> StatsSample:
        return cls(at_s, stats.requests_running, stats.requests_waiting, stats.kv_pages_used, stats.kv_pages_free,
                   prompt_tokens, generation_tokens, sum(s.draft_tokens for s in stats.speculative),
                   sum(s.accepted_tokens for s in stats.speculative))


def stats_line(before: StatsSample, now: StatsSample) -> str:
    """The line for the interval from ``before`` to ``now``."""
    elapsed = max(now.at_s - before.at_s, 1e-9)
    pages = now.pages_used + now.pages_free
    used = 100.0 * now.pages_used / pages if pages else 0.0
    drafts = now.draft_tokens - before.draft_tokens
    accepted = now.accepted_tokens - before.accepted_tokens
    acceptance = f"{100.0 * accepted / drafts:.1f}% ({accepted} of {drafts} drafts)" if drafts > 0 else "-"
    return (f"running: {now.running} reqs, waiting: {now.waiting} reqs, "
            f"pages used: {used:.1f}% ({now.pages_used} of {pages}), "
            f"prompt throughput: {(now.prompt_tokens - before.prompt_tokens) / elapsed:.1f} tokens/s, "
            f"generation throughput: {(now.generation_tokens - before.generation_tokens) / elapsed:.1f} tokens/s, "
            f"speculative acceptance: {acceptance}")


async def log_stats_every(interval_s: float, sample: Callable[[], StatsSample]) -> None:
    """Log a stats line every ``interval_s`` until cancelled (the app's lifespan runs it)."""
    assert interval_s > 0, "an interval of 0 means no stats task at all"
    before = sample()
    while True:
        await asyncio.sleep(interval_s)
        now = sample()
        log.info("%s", stats_line(before, now))
        before = now


def sampler(stats: Callable[[], EngineStats], totals: Callable[[], tuple[float, float]]) -> Callable[[], StatsSample]:
    def sample() -> StatsSample:
        prompt, generated = totals()
        return StatsSample.of(stats(), prompt, generated, time.monotonic())

    return sample
