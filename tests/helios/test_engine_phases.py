"""The engine's phases without HTTP: admit, plan, commit, two frame slots, complete, publish.

Runs a small slice of the bundled catalog (``tiny_catalog``). Most engines
here call eager twins of the catalog's programs (the loaded modules equal
them bitwise, tests/ignition/test_capture.py, and load in milliseconds
instead of seconds); the greedy reference test runs the loaded programs.
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import torch

from eager_target import assert_same_or_near_tie
from engine_driver import serve, wait_idle
from helios.runtime.engine import EngineConfig, HeliosEngine, prompt_lookup
from helios.runtime.executor import neutral_control_inputs
from helios.runtime.engine_api import (
    EngineUnavailable,
    FinishReason,
    GenerationFailed,
    GenerationRequest,
    RequestRejected,
    SamplingParams,
)

CI = os.environ.get("FLARE_TEST_SCALE") == "ci"
GREEDY = SamplingParams(temperature=0.0)


def make_engine(catalog, eager, speculation="off", program_for=None) -> HeliosEngine:
    return HeliosEngine(catalog, EngineConfig(speculation=speculation, threads=1), program_for=program_for or eager)


def prompt_ids(engine, text: str) -> tuple[int, ...]:
    return tuple(engine.tokenizer.encode(text, add_special_tokens=True))


def request(engine, rid, text, max_tokens=12, sampling=GREEDY, stop=()):
    return GenerationRequest(rid, prompt_ids(engine, text), max_tokens, sampling, tuple(stop))


async def collect(engine, req):
    """(text, token ids, finish reason, deltas) of one request."""
    deltas = [d async for d in engine.submit(req)]
    ids = [t for d in deltas for t in d.token_ids]
    return "".join(d.text for d in deltas), ids, deltas[-1].finish_reason, deltas


# ---------------------------------------------------------------------------
# Reference: the loaded programs called by hand, prefill then decode
# ---------------------------------------------------------------------------


def greedy_by_hand(catalog, prompt: tuple[int, ...], count: int) -> list[int]:
    """Slot 0 owns pages 0..M-1; prefill_p64 the whole prompt, then decode_b1 ``count - 1`` times."""
    state = catalog.allocate_state()
    layout = catalog.state.layout
    table = torch.zeros(layout["request_slots"], layout["max_pages_per_slot"], dtype=torch.int32)
    table[0] = torch.arange(layout["max_pages_per_slot"], dtype=torch.int32)
    row = {"page_table": table, "row_slots": torch.tensor([0], dtype=torch.int32),
           "query_lens": torch.tensor([1], dtype=torch.int32), "temperature": torch.tensor([0.0]),
           "top_k": torch.tensor([0], dtype=torch.int32), "top_p": torch.tensor([1.0]),
           "seed": torch.tensor([0]), **neutral_control_inputs(1)}
    chunk = torch.zeros(64, dtype=torch.int64)
    chunk[: len(prompt)] = torch.tensor(prompt)
    prompt_row = {**row, "query_lens": torch.tensor([len(prompt)], dtype=torch.int32)}
    out = catalog.program("prefill_p64")(**state, **prompt_row, prompt_tokens=chunk, prompt_start=torch.tensor([0], dtype=torch.int32),
                                         prompt_final=torch.tensor([True]))
    tokens = [int(out["tokens"][0, 0])]
    decode = catalog.program("decode_b1")
    while len(tokens) < count:
        tokens.append(int(decode(**state, **row)["tokens"][0, 0]))
    return tokens


def test_greedy_output_through_the_engine_equals_prefill_then_decode_of_the_loaded_programs(catalog, eager):
    engine = make_engine(catalog, eager)
    req = request(engine, "g", "The quick brown fox", max_tokens=16)
    _, ids, reason, _ = serve(engine, lambda e: collect(e, req))
    expected = greedy_by_hand(catalog, req.prompt_token_ids, 16)
    cut = next((i + 1 for i, t in enumerate(expected) if t in engine.executor.eos_ids), len(expected))
    # The engine runs the eager twins, the reference the loaded programs: exact unless a near-tie.
    if not assert_same_or_near_tie(req.prompt_token_ids, expected[:cut], ids, what="engine vs by hand"):
        assert reason is (FinishReason.LENGTH if cut == 16 else FinishReason.STOP)


def test_S1_speculative_rounds_commit_what_plain_decoding_would(catalog, eager):
    texts = ["abcabcabcabc abc", "one two one two one", "zzzzzzzz"]

    async def body(engine):
        return await asyncio.gather(*(collect(engine, request(engine, f"s{i}", t, 20)) for i, t in enumerate(texts)))

    plain = serve(make_engine(catalog, eager, "off"), body)
    speculative_engine = make_engine(catalog, eager, "adaptive")
    speculative = serve(speculative_engine, body)
    for text, want, got in zip(texts, plain, speculative):  # other widths: exact up to near-ties
        assert_same_or_near_tie(prompt_ids(speculative_engine, text), want[1], got[1],
                                what=f"speculative vs plain {text!r}")
    stats = speculative_engine.stats()
    assert sum(t.rounds for t in stats.speculative) > 0 and sum(t.draft_tokens for t in stats.speculative) > 0
    assert any(e.graph_kind == "speculative" for e in stats.executions)


def test_A13_C14_prompts_arriving_during_decode_may_run_mixed_and_commit_what_serial_runs_would(catalog, eager):
    texts = ["a long running stream", "late arrival number one", "another late prompt here"]

    async def serial(engine):
        return [await collect(engine, request(engine, f"q{i}", t, 30)) for i, t in enumerate(texts)]

    async def overlapping(engine):
        first = asyncio.ensure_future(collect(engine, request(engine, "q0", texts[0], 30)))
        late = []
        for i, text in enumerate(texts[1:], start=1):
            await asyncio.sleep(0.05)  # arrive while the first stream decodes
            late.append(asyncio.ensure_future(collect(engine, request(engine, f"q{i}", text, 30))))
        return [await first, *[await t for t in late]]

    expected = serve(make_engine(catalog, eager, "adaptive"), serial)
    engine = make_engine(catalog, eager, "adaptive")
    engine.warm_up()
    got = serve(engine, overlapping)
    for text, want, have in zip(texts, expected, got):  # mixed frames: exact up to near-ties
        assert_same_or_near_tie(prompt_ids(engine, text), want[1], have[1],
                                what=f"overlapping vs serial {text!r}")
    assert any(e.graph_kind == "mixed" for e in engine.stats().executions), engine.stats().executions


def test_prompt_lookup_copies_what_followed_the_last_ngram():
    assert prompt_lookup([1, 2, 3, 9, 1, 2, 3], 2) == (9, 1)
    assert prompt_lookup([5, 6, 7], 3) == (7, 7, 7)  # nothing to copy: repeat the last token
    assert prompt_lookup([4, 8, 4], 2) == (8, 4)


# ---------------------------------------------------------------------------
# Publication, frame slots, FIFO admission
# ---------------------------------------------------------------------------


def test_A4_A7_publication_precedes_the_next_completion_and_a_second_decode_frame_is_queued(catalog, eager):
    engine = make_engine(catalog, eager)
    calls: list[tuple[str, int]] = []
    scheduler = engine.scheduler
    complete, published, commit = scheduler.complete, scheduler.published_output, scheduler.commit
    queued_kinds = []

    def traced_commit(plan, fence):
        if scheduler.queued_fences:
            queued_kinds.append(plan.graph.kind.value)
        return commit(plan, fence)

    scheduler.complete = lambda fence, *a: (calls.append(("complete", fence)), complete(fence, *a))[1]
    scheduler.published_output = lambda h, fence: (calls.append(("published", fence)), published(h, fence))[1]
    scheduler.commit = traced_commit
    admit, still_waiting = engine._admit_waiting, []
    engine._admit_waiting = lambda: (admit(), still_waiting.append([live.request.request_id for live in engine._waiting]))
    texts = [f"stream number {i} says" for i in range(6)]  # 6 requests, 4 slots: two wait in the FIFO

    async def body(engine):
        return await asyncio.gather(*(collect(engine, request(engine, f"p{i}", t, 24)) for i, t in enumerate(texts)))

    async def body_then_idle(engine):
        results = await body(engine)
        await asyncio.to_thread(wait_idle, engine)
        return results

    results = serve(engine, body_then_idle)
    for _, ids, reason, deltas in results:
        assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
        assert reason is FinishReason.LENGTH and len(ids) == 24 or reason is FinishReason.STOP
    completed = [f for kind, f in calls if kind == "complete"]
    assert completed == sorted(completed)
    for i, (kind, fence) in enumerate(calls):
        if kind == "published":
            last_completed = max(f for k, f in calls[:i] if k == "complete")
            assert fence == last_completed, "a publication is reported before the next completion (A4)"
    assert queued_kinds and set(queued_kinds) <= {"decode", "speculative"}, "only generation frames queue (A7)"
    assert engine.frame_counters().queued_commits == len(queued_kinds)
    assert max(map(len, still_waiting)) >= 1, "requests beyond the slots waited"
    waited = [ids for ids in still_waiting if ids]
    assert all(ids == sorted(ids, key=lambda rid: int(rid[1:])) for ids in waited), "the waiting line is FIFO"
    engine.pages.assert_no_leaks()


def test_A6_cancellation_frees_pages_after_the_last_fence_no_leaks_after_50_random_cancels(catalog, eager):
    rng = random.Random(5)
    count = 20 if CI else 50
    engine = make_engine(catalog, eager)
    engine.warm_up()  # first calls are slow: cancels should find streams in every phase

    async def one(i):
        stream = engine.submit(request(engine, f"c{i}", f"cancel me {i} " * rng.randint(1, 12), rng.randint(2, 40)))
        await asyncio.sleep(rng.random() * 0.4)
        engine.cancel(f"c{i}")
        return [d async for d in stream]

    async def body(engine):
        results = await asyncio.gather(*(one(i) for i in range(count)), return_exceptions=True)
        assert not [r for r in results if isinstance(r, Exception)]
        assert any(results) and not all(results), "some cancels hit running streams, some waiting ones"
        assert all(d.finish_reason is not FinishReason.ABORT for r in results for d in r)
        return await asyncio.to_thread(wait_idle, engine)

    stats = serve(engine, body)
    assert stats.kv_pages_used == 0 and stats.kv_pages_free == engine.pages.layout.num_pages
    engine.pages.assert_no_leaks()
    assert engine.pages.owners == ()
    assert not any(engine.scheduler.is_active(live.handle) for live in engine._by_slot.values())


# ---------------------------------------------------------------------------
# Stops, limits, sampling
# ---------------------------------------------------------------------------


def test_stop_string_split_across_tokens_is_never_delivered(catalog, eager):
    sampling = SamplingParams(temperature=1.0, seed=1234)
    engine = make_engine(catalog, eager)

    async def body(engine):
        free = await collect(engine, request(engine, "free", "Tell me a story", 30, sampling))
        tokens = free[1]
        pieces = [engine.tokenizer.decode([t]) for t in tokens]
        # a stop string that starts inside one token and ends inside a later one
        start = next(i for i in range(2, len(pieces) - 2) if pieces[i] and pieces[i + 1])
        before = "".join(pieces[:start])
        stop = pieces[start][-1] + pieces[start + 1]
        stopped = await collect(engine, request(engine, "stop", "Tell me a story", 30, sampling, [stop]))
        return free, stopped, stop

    free, stopped, stop = serve(engine, body)
    text, _, reason, deltas = stopped
    assert reason is FinishReason.STOP
    assert text == free[0][: free[0].find(stop)]
    assert all(stop not in d.text for d in deltas) and stop not in text


def test_max_tokens_eos_and_context_limit_end_a_request(catalog, eager):
    engine = make_engine(catalog, eager)
    engine.context_length = 40

    async def body(engine):
        limited = await collect(engine, request(engine, "m", "count to ten", 5))
        free = await collect(engine, request(engine, "f", "count to ten", 12))
        engine.executor.eos_ids = frozenset({free[1][3]})  # pretend the 4th token is an end of sequence
        eos = await collect(engine, request(engine, "e", "count to ten", 12))
        engine.executor.eos_ids = frozenset()
        long_prompt = tuple(range(60, 97))  # 37 tokens: 3 fit before the context limit of 40
        context = await collect(engine, GenerationRequest("c", long_prompt, 30, GREEDY))
        return limited, free, eos, context

    limited, free, eos, context = serve(engine, body)
    assert len(limited[1]) == 5 and limited[2] is FinishReason.LENGTH
    first_eos = free[1].index(free[1][3]) + 1
    assert eos[1] == free[1][:first_eos] and eos[2] is FinishReason.STOP
    assert len(context[1]) == 3 and context[2] is FinishReason.LENGTH


def test_a_prompt_beyond_the_context_is_refused_at_submit(catalog, eager):
    engine = make_engine(catalog, eager)

    async def body(engine):
        with pytest.raises(RequestRejected, match="context"):
            engine.submit(GenerationRequest("long", (5,) * engine.context_length, 4, GREEDY))

    serve(engine, body)


def test_seeded_sampling_reproduces_across_different_concurrency(catalog, eager):
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=77)

    async def alone(engine):
        return await collect(engine, request(engine, "x", "Once upon a time", 20, sampling))

    async def crowded(engine):
        others = [collect(engine, request(engine, f"o{i}", f"noise {i} " * (i + 1), 25,
                                          SamplingParams(temperature=1.0))) for i in range(3)]
        results = await asyncio.gather(alone(engine), *others)
        return results[0]

    engine = make_engine(catalog, eager)
    first = serve(engine, alone)
    second = serve(make_engine(catalog, eager, "adaptive"), crowded)
    # (seed, position) noise makes the cohort irrelevant; only a near-tie of the noised scores may flip
    assert_same_or_near_tie(prompt_ids(engine, "Once upon a time"), first[1], second[1],
                            sampling, "seeded alone vs crowded")


# ---------------------------------------------------------------------------
# Failures and drain
# ---------------------------------------------------------------------------


POISON = 254  # a byte token only the poisoned prompt contains


def _serve_beside_a_poisoned_request(engine):
    """Three healthy requests beside one whose prompt holds POISON, then one more: every result (a
    GenerationFailed where it failed) and the last request's."""
    async def body(engine):
        healthy = [collect(engine, request(engine, f"h{i}", f"healthy request {i}", 16)) for i in range(3)]
        poisoned = collect(engine, GenerationRequest("bad", (10, 11, POISON, 12), 16, GREEDY))
        results = await asyncio.gather(poisoned, *healthy, return_exceptions=True)
        after = await collect(engine, request(engine, "after", "still serving", 6))
        await asyncio.to_thread(wait_idle, engine)
        return results, after

    return serve(engine, body)


def test_a_raising_program_fails_only_its_frames_requests(catalog, eager):
    failed_rows = []

    def program_for(graph_id):
        program = eager(graph_id)

        def maybe_raise(**named):
            if "prompt_tokens" in named and (named["prompt_tokens"] == POISON).any():
                failed_rows.append(int((named["query_lens"] > 0).sum()))
                raise RuntimeError("injected failure")
            return program(**named)
        return maybe_raise

    engine = make_engine(catalog, eager, program_for=program_for)
    results, after = _serve_beside_a_poisoned_request(engine)
    failed = [r for r in results if isinstance(r, Exception)]
    assert isinstance(results[0], GenerationFailed) and "injected failure" in str(results[0])
    assert all(isinstance(r, GenerationFailed) for r in failed)
    assert len(failed_rows) == 1 and len(failed) == failed_rows[0], "exactly the rows of the failing frame fail"
    assert all(r[2] is not None for r in results if not isinstance(r, Exception))
    assert len(after[1]) == 6
    engine.pages.assert_no_leaks()


def test_outputs_that_break_the_contract_fail_only_their_frames_requests(catalog, eager):
    """The worker hands a frame's outputs over unread and the control thread reads them (Executor.finish):
    a broken output found there fails that frame's requests, as a raising program does, and the engine
    goes on serving."""
    broken_rows = []

    def program_for(graph_id):
        program = eager(graph_id)

        def maybe_break(**named):
            outputs = program(**named)
            if "prompt_tokens" in named and (named["prompt_tokens"] == POISON).any():
                broken_rows.append(int((named["query_lens"] > 0).sum()))
                return {**outputs, "tokens": outputs["tokens"][:, :0]}  # a shape the contract does not allow
            return outputs
        return maybe_break

    engine = make_engine(catalog, eager, program_for=program_for)
    results, after = _serve_beside_a_poisoned_request(engine)
    failed = [r for r in results if isinstance(r, Exception)]
    assert isinstance(results[0], GenerationFailed) and "tokens has shape" in str(results[0])
    assert len(broken_rows) == 1 and len(failed) == broken_rows[0], "exactly the rows of the broken frame fail"
    assert len(after[1]) == 6
    engine.pages.assert_no_leaks()


def test_drain_refuses_new_work_and_aborts_what_outlives_the_grace(catalog, eager):
    engine = make_engine(catalog, eager)

    async def body(engine):
        stream = engine.submit(request(engine, "long", "a long answer", 3000))
        first = await stream.__anext__()
        engine.begin_drain(0.05)
        with pytest.raises(EngineUnavailable):
            engine.submit(request(engine, "late", "too late", 4))
        rest = [d async for d in stream]
        return first, rest, await asyncio.to_thread(wait_idle, engine)

    first, rest, idle = serve(engine, body)
    assert rest[-1].finish_reason is FinishReason.ABORT
    assert not idle.accepting
    engine.pages.assert_no_leaks()


def test_warm_up_calls_every_program_with_inactive_rows_and_mutates_nothing(catalog, eager):
    called = []

    def program_for(graph_id):
        called.append(graph_id)
        return eager(graph_id)

    engine = make_engine(catalog, eager, "adaptive", program_for=program_for)
    for tensor in engine.executor.state.values():
        tensor.fill_(3)
    before = {name: t.clone() for name, t in engine.executor.state.items()}
    engine.warm_up()
    assert sorted(called) == sorted(g.id for g in engine.scheduler.graphs)  # the selected programs (Y3)
    assert all(torch.equal(t, before[name]) for name, t in engine.executor.state.items())


def test_an_internal_error_fails_every_request_and_stops_admitting_instead_of_hanging(catalog, eager):
    engine = make_engine(catalog, eager)

    def broken(*args, **kwargs):
        raise RuntimeError("scheduler bug")

    engine._expire_waiting = broken  # a control-loop step outside admission and planning (those are isolated)

    async def body(engine):
        results = await asyncio.gather(*(collect(engine, request(engine, f"b{i}", "hello", 4)) for i in range(2)),
                                       return_exceptions=True)
        with pytest.raises(EngineUnavailable):
            engine.submit(request(engine, "later", "hello", 4))
        return results

    results = serve(engine, body)
    assert all(isinstance(r, GenerationFailed) and "scheduler bug" in str(r) for r in results)
    assert not engine.stats().accepting


def test_deliveries_of_one_burst_wake_the_event_loop_once_and_keep_their_order():
    """The control thread's puts wait in the outbox until it wakes the loop once; they arrive in order."""
    import threading

    from helios.runtime.engine import _Outbox

    async def body():
        loop = asyncio.get_running_loop()
        wakes = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda fn, *a: wakes.append(fn) or real(fn, *a)
        due = []
        outbox, first, second = _Outbox(loop, due), asyncio.Queue(), asyncio.Queue()

        def control_step(puts):
            for i, q in puts:
                outbox.put(q, i)
            woken = list(due)
            due.clear()
            for o in woken:
                o.wake()
        worker = threading.Thread(target=control_step, args=([(0, first), (1, second), (2, first)],))
        worker.start()
        worker.join()  # all three put, one wake-up, before the loop ran again
        got = [await first.get(), await second.get(), await first.get()]
        control_step([(3, second)])  # after the drain: a new wake-up
        got.append(await second.get())
        return got, len(wakes)

    assert asyncio.run(body()) == ([0, 1, 2, 3], 2)


def test_the_event_loops_wake_ups_are_written_by_the_waker_thread_never_the_control_thread(catalog, eager):
    """The self-pipe write of ``call_soon_threadsafe`` (and the GIL wait after it) stays off the control thread."""
    import threading

    async def body(engine):
        loop = asyncio.get_running_loop()
        writers = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda fn, *a: writers.append(threading.current_thread().name) or real(fn, *a)
        result = await collect(engine, request(engine, "w", "hello there", 8))
        return result, list(writers)  # before stop(), whose to_thread completes through the same call

    (_, ids, _, deltas), writers = serve(make_engine(catalog, eager), body)
    assert len(ids) == 8 and len(deltas) >= 2
    assert writers and set(writers) == {"helios-waker"}


def test_the_engine_runs_with_its_switch_interval_and_gives_the_interpreters_back_when_it_stops(catalog, eager):
    """A worker whose program returned waits at most the switch interval for the GIL (docs/runtime.md, "Threads")."""
    import sys

    before = sys.getswitchinterval()
    wanted = 0.0023 if abs(before - 0.0023) > 1e-6 else 0.0031
    engine = HeliosEngine(catalog, EngineConfig(speculation="off", threads=1, switch_interval_s=wanted), program_for=eager)

    async def body(engine):
        await collect(engine, request(engine, "s", "hello", 2))
        return sys.getswitchinterval()

    assert serve(engine, body) == pytest.approx(wanted, rel=1e-6)  # the interpreter keeps microseconds
    assert sys.getswitchinterval() == before
    untouched = HeliosEngine(catalog, EngineConfig(speculation="off", threads=1, switch_interval_s=None), program_for=eager)
    assert serve(untouched, lambda e: asyncio.sleep(0, sys.getswitchinterval())) == before

    async def two_at_once(first):  # engines running together share the value; the last to stop restores it
        second = HeliosEngine(catalog, EngineConfig(speculation="off", threads=1, switch_interval_s=wanted),
                              program_for=eager)
        await second.start()
        await first.stop()
        during = sys.getswitchinterval()
        await second.stop()
        return during

    assert serve(HeliosEngine(catalog, EngineConfig(speculation="off", threads=1, switch_interval_s=wanted),
                              program_for=eager), two_at_once) == pytest.approx(wanted, rel=1e-6)
    assert sys.getswitchinterval() == before
    with pytest.raises(ValueError, match="switch_interval_s"):
        EngineConfig(switch_interval_s=0.0)


def test_a_steps_deliveries_wake_the_event_loop_after_it_submitted_the_next_frame(catalog, eager):
    """The loop's turn (HTTP writes in a server) must overlap the next frame's program, not delay its start."""
    engine = make_engine(catalog, eager)
    log = []
    work = engine._work

    class Recorded:  # the worker's queue, logging each frame handed to it (None: stop)
        put = staticmethod(lambda item: (item is not None and log.append("submit")) or work.put(item))
        get = staticmethod(work.get)

    engine._work = Recorded()
    wake_listeners, step = engine._wake_listeners, engine._step
    engine._wake_listeners = lambda: log.append("wake" if engine._due else "idle") or wake_listeners()
    engine._step = lambda batch: log.append("step") or step(batch)
    _, ids, _, deltas = serve(engine, lambda e: collect(e, request(e, "w", "hello there", 8)))
    assert len(ids) == 8
    segments = [s.split() for s in " ".join(entry for entry in log if entry != "idle").split("step") if s.strip()]
    assert all("submit" not in segment[segment.index("wake"):] for segment in segments if "wake" in segment)
    # steps that published a token and had a frame to plan submitted it before waking the loop: most of them
    # (a step may plan nothing while a frame runs, e.g. a duration probe waiting for the empty window, A8, or
    # complete two frames at once; with the worker taking the GIL back sooner, both happen run to run)
    assert sum(1 for segment in segments if segment[-2:] == ["submit", "wake"]) >= len(deltas) // 2
