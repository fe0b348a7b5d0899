"""Admission limits of the real engine (issue 17, parts 4 and 5).

- the waiting line is bounded: beyond ``max_waiting`` requests without a slot,
  ``submit`` refuses at once with ``EngineOverloaded`` (a 503 with Retry-After);
- a request that waits longer than ``queue_timeout_s`` for a slot ends with
  ``QueueTimeout`` while the running ones are unaffected.

Slots are held deterministically: every program call waits on a gate the
test opens, so the requests that got slots cannot finish until then.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from helios.engine import EngineConfig, HeliosEngine
from helios.engine_api import EngineOverloaded, GenerationRequest, QueueTimeout, SamplingParams
from helios.waiting import WaitingLine

GREEDY = SamplingParams(temperature=0.0)


def gated(eager):
    """``program_for`` whose programs all wait until ``gate`` is set, and the gate."""
    gate = threading.Event()

    def program_for(graph_id):
        program = eager(graph_id)

        def call(**named):
            gate.wait()
            return program(**named)
        return call

    return program_for, gate


def run(engine: HeliosEngine, gate: threading.Event, body):
    async def main():
        await engine.start()
        try:
            return await asyncio.wait_for(body(engine), 120)
        finally:
            gate.set()  # whatever happened, let the device worker finish so the engine can stop
            await engine.stop()
    return asyncio.run(main())


def request(rid: str, max_tokens: int = 4) -> GenerationRequest:
    return GenerationRequest(rid, (10, 11, 12, 13), max_tokens, GREEDY)


async def drain(stream) -> list:
    return [delta async for delta in stream]


async def until(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def test_the_waiting_line_counts_a_submission_before_the_control_thread_sees_it():
    line: WaitingLine[str] = WaitingLine(limit=2)
    line.reserve()
    line.reserve()
    with pytest.raises(EngineOverloaded, match="2 requests are already waiting") as refused:
        line.reserve()
    assert refused.value.retry_after_s == 1 and line.refused == 1
    line.append("a", now=0.0)
    assert line.popleft() == "a" and line.waiting() == 1
    line.reserve()  # room again once one left the line
    assert line.waiting() == 2
    line.reserve(free_slots=1)  # one more may come while a slot is free for it
    with pytest.raises(EngineOverloaded):
        line.reserve(free_slots=1)


def test_a_full_waiting_line_refuses_at_submit_and_drains_normally(catalog, eager):
    program_for, gate = gated(eager)
    engine = HeliosEngine(catalog, EngineConfig(speculation="off", threads=1, max_waiting=2), program_for=program_for)
    slots = engine.scheduler.request_slots

    async def body(engine):
        running = [asyncio.ensure_future(drain(engine.submit(request(f"run{i}")))) for i in range(slots)]
        await until(lambda: engine.stats().requests_running == slots, "every slot to be taken")
        waiting = [asyncio.ensure_future(drain(engine.submit(request(f"wait{i}")))) for i in range(2)]
        with pytest.raises(EngineOverloaded, match="2 requests are already waiting for a slot") as refused:
            engine.submit(request("one-too-many"))
        stats = engine.stats()
        gate.set()
        finished = await asyncio.gather(*running, *waiting)
        later = await drain(engine.submit(request("later")))
        return refused.value, stats, finished, later, engine.stats()

    refused, stats, finished, later, after = run(engine, gate, body)
    assert refused.retry_after_s == 1
    assert stats.requests_waiting == 2 and stats.shed_waiting_full == 1
    assert len(finished) == slots + 2 and all(deltas[-1].finish_reason is not None for deltas in finished)
    assert later[-1].finish_reason is not None
    assert after.shed_waiting_full == 1 and after.requests_waiting == 0
    engine.pages.assert_no_leaks()


def test_a_request_waiting_past_the_queue_timeout_fails_alone(catalog, eager):
    program_for, gate = gated(eager)
    engine = HeliosEngine(catalog, EngineConfig(speculation="off", threads=1, queue_timeout_s=0.05),
                          program_for=program_for)
    slots = engine.scheduler.request_slots

    async def body(engine):
        running = [asyncio.ensure_future(drain(engine.submit(request(f"run{i}", 6)))) for i in range(slots)]
        await until(lambda: engine.stats().requests_running == slots, "every slot to be taken")
        with pytest.raises(QueueTimeout, match="waited 0.05 s for a free slot") as expired:
            await drain(engine.submit(request("late")))
        stats = engine.stats()
        gate.set()
        return expired.value, stats, await asyncio.gather(*running)

    expired, stats, finished = run(engine, gate, body)
    assert expired.retry_after_s == 1
    assert stats.shed_queue_timeout == 1 and stats.requests_waiting == 0
    assert len(finished) == slots and all(deltas[-1].finish_reason is not None for deltas in finished)
    engine.pages.assert_no_leaks()


def test_config_refuses_a_nonsense_line():
    with pytest.raises(ValueError, match="max_waiting must be >= 1"):
        WaitingLine(limit=0)
    with pytest.raises(ValueError, match="queue_timeout_s must be None"):
        WaitingLine(timeout_s=float("inf"))
