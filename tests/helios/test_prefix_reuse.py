"""Prefix reuse through the engine (issue 21): checkpoints captured by the scheduler's snapshot plans,
restored for a later prompt that extends them, fenced while in use (docs/checkpoints.md).

The tiny slice keeps two checkpoint rows. Frame programs are the eager twins;
the state programs are the captured ones (they run no model).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch

from engine_driver import serve, wait_idle
from eager_target import assert_same_or_near_tie
from helios.runtime.checkpoint_store import CheckpointStore
from helios.runtime.engine import EngineConfig, HeliosEngine
from helios.runtime.engine_api import GenerationRequest, SamplingParams

STATE_PREFIXES = ("snapshot_", "restore_", "init_")
FIRST = "the river runs under the old bridge and the lanterns glow"
FOLLOW = " and then the boat drifted past the mill"
TOKENS = 12


def make_engine(catalog, eager, reuse: bool = True) -> HeliosEngine:
    program_for = lambda gid: catalog.program(gid) if gid.startswith(STATE_PREFIXES) else eager(gid)
    return HeliosEngine(catalog, EngineConfig(speculation="off", threads=1, prefix_reuse=reuse),
                        program_for=program_for)


def greedy(rid: str, ids, tokens: int = TOKENS) -> GenerationRequest:
    return GenerationRequest(rid, tuple(ids), tokens, SamplingParams(temperature=0.0))


async def run(engine, request):
    deltas = [d async for d in engine.submit(request)]
    return [t for d in deltas for t in d.token_ids], max((d.cached_tokens for d in deltas), default=0)


def conversation(engine):
    """Turn 1, then turn 2 whose prompt is turn 1's prompt, its answer, and more text."""
    first = tuple(engine.tokenizer.encode(FIRST, add_special_tokens=True))
    follow = tuple(engine.tokenizer.encode(FOLLOW, add_special_tokens=False))

    async def body(engine):
        answer, cached_first = await run(engine, greedy("t1", first))
        await asyncio.to_thread(wait_idle, engine)  # turn 1's terminal snapshot is published, its slot free
        second = (*first, *answer, *follow)
        reply, cached_second = await run(engine, greedy("t2", second))
        return first, answer, second, reply, cached_first, cached_second, await asyncio.to_thread(wait_idle, engine)
    return serve(engine, body)


def test_a_follow_up_turn_restores_the_terminal_checkpoint_and_answers_as_a_full_prefill(catalog, eager):
    assert catalog.checkpoint_rows >= 1
    engine = make_engine(catalog, eager)
    first, answer, second, reply, cached_first, cached_second, idle = conversation(engine)
    plain = make_engine(catalog, eager, reuse=False)
    _, plain_answer, _, plain_reply, _, plain_cached, _ = conversation(plain)

    assert cached_first == 0 and plain_cached == 0
    # the terminal capture covers prompt + answer less the pending last token (P6); the follow-up extends it
    assert cached_second == len(first) + len(answer) - 1, (cached_second, len(first), len(answer))
    assert answer == plain_answer
    assert_same_or_near_tie(second, plain_reply, reply, what="turn 2 after a restore")
    c = idle.checkpoints
    assert c.hits == 1 and c.cached_tokens == cached_second and c.captures >= 2 and c.held >= 1
    assert c.bytes_held == c.held * engine.checkpoints.row_bytes > 0
    assert plain.stats().checkpoints.rows == 0 and plain.stats().checkpoints.captures == 0
    engine.pages.assert_no_leaks()


def test_rows_in_use_are_never_evicted_and_every_row_comes_back(catalog, eager):
    """More captures than rows: K3 evicts published checkpoints only, and the engine ends idle with
    every armed destination given back (a row armed forever would leave no destination at all)."""
    engine = make_engine(catalog, eager)
    before = {name: t.clone() for name, t in engine.executor.state.items()}
    engine.warm_up()  # every program once with all rows inactive, state programs included: nothing changes
    assert all(torch.equal(before[name], t) for name, t in engine.executor.state.items())
    texts = [f"request number {i} talks about {word}" for i, word in enumerate(("rivers", "copper", "maps", "owls"))]

    async def body(engine):
        prompts = [tuple(engine.tokenizer.encode(t, add_special_tokens=True)) for t in texts]
        outcomes = await asyncio.gather(*(run(engine, greedy(f"r{i}", p, 6)) for i, p in enumerate(prompts)))
        return outcomes, await asyncio.to_thread(wait_idle, engine)

    outcomes, idle = serve(engine, body)
    assert all(len(tokens) == 6 for tokens, _ in outcomes)
    c = idle.checkpoints
    assert c.held <= c.rows == catalog.checkpoint_rows
    assert c.captures > c.rows and c.evictions >= c.captures - c.rows
    assert not engine.checkpoints._armed and not engine.checkpoints._restoring
    engine.pages.assert_no_leaks()


@pytest.mark.parametrize("speculation", ["adaptive", "fixed"])
def test_prompt_end_snapshots_run_when_only_speculative_programs_decode(catalog, eager, speculation):
    """With speculation loaded and no plain decode program (adaptive with the draft floor keeps the
    draft-keeping width-one rounds, fixed one wider width): the snapshot a finished prompt waits for must
    still be planned. It was not (the lookahead paired snapshots with plain decode only), and every stream
    stalled for good."""
    program_for = lambda gid: catalog.program(gid) if gid.startswith(STATE_PREFIXES) else eager(gid)
    engine = HeliosEngine(catalog, EngineConfig(speculation=speculation, threads=1, prefix_reuse=True,
                                                adaptive_floor="draft"), program_for=program_for)
    assert not any(g.kind.value == "decode" for g in engine.scheduler.graphs)
    rng = random.Random(7)

    async def one(engine, i, gate):
        async with gate:
            words = " ".join(rng.choice(("river", "copper", "owl", "map")) for _ in range(rng.randint(4, 60)))
            ids = tuple(engine.tokenizer.encode(f"Request {i}: {words}", add_special_tokens=True))
            request = GenerationRequest(f"r{i}", ids, rng.randint(2, 8), SamplingParams(temperature=0.8, seed=i))
            async for _ in engine.submit(request):
                if i % 3 == 0:
                    engine.cancel(f"r{i}")
                    break

    async def body(engine):
        gate = asyncio.Semaphore(4)
        await asyncio.wait_for(asyncio.gather(*(one(engine, i, gate) for i in range(16))), 90)
        return await asyncio.to_thread(wait_idle, engine)

    idle = serve(engine, body)
    assert idle.checkpoints.captures >= 8  # prompt-end and terminal snapshots ran
    engine.pages.assert_no_leaks()


def test_a_terminal_snapshot_that_fails_to_bind_gives_its_finished_requests_slot_back(catalog, eager, monkeypatch):
    """P6: a finished request held for its terminal snapshot whose frame fails while being prepared
    gives the capture up *and* its slot and pages: the request had already ended, so ending it again
    released nothing, and the slot stayed owned until the engine stopped."""
    engine = make_engine(catalog, eager)
    choose = CheckpointStore.destination
    failed = []

    def destination(store, handle):
        live = engine._by_slot.get(handle.slot)
        if live is not None and live.done:
            failed.append(handle)
            raise RuntimeError("injected: no destination for a terminal snapshot")
        return choose(store, handle)

    monkeypatch.setattr(CheckpointStore, "destination", destination)
    prompt = tuple(engine.tokenizer.encode(FIRST, add_special_tokens=True))

    async def body(engine):
        tokens, _ = await run(engine, greedy("t1", prompt))
        return tokens, await asyncio.to_thread(wait_idle, engine, 5.0)

    tokens, idle = serve(engine, body)
    assert failed, "no terminal snapshot was attempted"
    assert len(tokens) == TOKENS and idle.requests_running == 0
    assert not engine._by_slot and not engine.checkpoints._armed
    engine.pages.assert_no_leaks()


def _snapshots_through(catalog, eager, call):
    """program_for: state programs from the catalog, the rest eager; each snapshot call goes through
    ``call(gid, program, named)``, which runs the program when the test lets it."""
    def program_for(gid):
        program = catalog.program(gid) if gid.startswith(STATE_PREFIXES) else eager(gid)
        if not gid.startswith("snapshot_"):
            return program
        return lambda **named: call(gid, program, named)
    return program_for


def test_a_frame_completing_as_the_engine_stops_is_not_lost_and_a_restarted_engine_serves(catalog, eager):
    """Stopping with a frame in flight (with reuse on, a finished request's terminal snapshot always is):
    a completion the control thread took together with the stop was dropped, its fence stayed queued in
    the scheduler for good, and the engine started again planned nothing: the next request never
    finished (the intermittent stall of the sampling-controls tests, which serve one engine twice).

    The snapshot is held on the device until the control thread is parked behind the engine's lock,
    so its completion and the stop are queued together, deterministically."""
    parked, snapshot_calls = threading.Event(), []

    def held(gid, program, named):
        snapshot_calls.append(gid)
        if len(snapshot_calls) == 1:
            assert parked.wait(20), "the test never released the first snapshot"
        return program(**named)

    engine = HeliosEngine(catalog, EngineConfig(speculation="off", threads=1, prefix_reuse=True),
                          program_for=_snapshots_through(catalog, eager, held))
    first = tuple(engine.tokenizer.encode(FIRST, add_special_tokens=True))
    follow = tuple(engine.tokenizer.encode(FOLLOW, add_special_tokens=False))

    def wait_for(condition, what):
        deadline = time.monotonic() + 20
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.005)

    async def turn_one():
        await engine.start()
        answer, _ = await run(engine, greedy("t1", first))  # its terminal snapshot is submitted, and held
        stopper = threading.Thread(target=engine.shutdown)
        with engine._lock:  # the control thread takes its next event, then waits here
            engine.cancel("no-such-request")
            await asyncio.to_thread(wait_for, lambda: engine._events.empty(), "the control thread took no event")
            await asyncio.sleep(0.2)  # it is parked on the lock, its batch taken
            parked.set()  # the snapshot completes: its completion is queued ...
            await asyncio.to_thread(wait_for, lambda: engine._events.qsize() == 1, "the snapshot never completed")
            stopper.start()  # ... and then the stop, behind it: the next batch holds both
            await asyncio.to_thread(wait_for, lambda: engine._events.qsize() == 2, "the stop was never queued")
        await asyncio.to_thread(stopper.join, 20)
        assert not stopper.is_alive()
        return answer

    answer = asyncio.run(turn_one())
    assert snapshot_calls, "no terminal snapshot ran: the test proves nothing"
    assert engine.scheduler.queued_fences == (), "a stopped engine still waits for a frame's completion"

    async def turn_two(engine):
        return await asyncio.wait_for(run(engine, greedy("t2", (*first, *answer, *follow))), 30)

    reply, cached = serve(engine, turn_two)
    assert len(reply) == TOKENS
    assert cached == len(first) + len(answer) - 1  # the snapshot completed during the stop was published
    engine.pages.assert_no_leaks()


def test_a_follow_up_sent_as_the_first_turn_ends_waits_for_its_terminal_snapshot(catalog, eager):
    """P6: snapshot completion and cache publication precede admission of an immediate continuation.
    The follow-up is sent the moment turn 1's last delta arrives, while turn 1's terminal snapshot is
    still on the device (held there 0.3 s): admitted at once it found no checkpoint and prefilled all."""
    def slow(gid, program, named):
        time.sleep(0.3)
        return program(**named)

    engine = HeliosEngine(catalog, EngineConfig(speculation="off", threads=1, prefix_reuse=True),
                          program_for=_snapshots_through(catalog, eager, slow))
    first = tuple(engine.tokenizer.encode(FIRST, add_special_tokens=True))
    follow = tuple(engine.tokenizer.encode(FOLLOW, add_special_tokens=False))

    async def body(engine):
        answer, _ = await run(engine, greedy("t1", first))
        held = engine.stats().kv_pages_used  # read as the follow-up is sent: t1 still holds its pages
        reply, cached = await run(engine, greedy("t2", (*first, *answer, *follow)))
        return answer, reply, cached, held, await asyncio.to_thread(wait_idle, engine)

    answer, reply, cached, held, idle = serve(engine, body, timeout_s=60)
    assert held > 0, "turn 1's terminal snapshot had completed already: the test proves nothing"
    assert len(reply) == TOKENS
    assert cached == len(first) + len(answer) - 1, (cached, len(first), len(answer))
    assert idle.checkpoints.hits == 1
    engine.pages.assert_no_leaks()
