"""A failure stays with the requests it concerns; the engine keeps serving (issue 17, part 1).

Before this, a value that overflowed a program input while the control
thread packed a frame's rows (``seed`` 2**63, ``top_k`` 2**31) failed every
request, refused every later one and turned /health to draining, for good.
Each test runs the tiny slice's eager programs in-process (``speculation
off``), lets a few greedy streams decode, then sends one marked request whose
frame fails at one stage of its life (row packing, the program call,
completion) and checks that:

- exactly the requests of the failing frame fail, with ``GenerationFailed``;
- every other stream, concurrent or later, finishes with the same tokens it
  has when nothing fails;
- every page comes back and the engine still admits requests.
"""

from __future__ import annotations

import asyncio

import pytest

import helios.runtime.executor
from engine_driver import serve, wait_idle
from helios.runtime.engine import EngineConfig, HeliosEngine
from helios.runtime.engine_api import FinishReason, GenerationFailed, GenerationRequest, SamplingParams

TOKENS = 24
BACKGROUND = ("the river runs under the old bridge", "copper lantern signal", "import os and sys")
VICTIM_TEXT = "a request whose frame fails"
VICTIM_SEED = 4242  # greedy rows ignore their seed: it only marks the victim's row
LATE_TEXT = "served after the failure"


def make_engine(catalog, eager, program_for=None) -> HeliosEngine:
    return HeliosEngine(catalog, EngineConfig(speculation="off", threads=1), program_for=program_for or eager)


def greedy(engine, rid: str, text: str, seed: int | None = None, tokens: int = TOKENS) -> GenerationRequest:
    ids = tuple(engine.tokenizer.encode(text, add_special_tokens=True))
    return GenerationRequest(rid, ids, tokens, SamplingParams(temperature=0.0, seed=seed))


async def token_ids(stream) -> list[int]:
    return [t async for delta in stream for t in delta.token_ids]


@pytest.fixture(scope="module")
def reference(catalog, eager) -> dict[str, list[int]]:
    """Each background and late request's tokens, served one at a time by an engine where nothing fails."""
    async def body(engine):
        texts = {f"b{i}": text for i, text in enumerate(BACKGROUND)} | {"late": LATE_TEXT}
        return {rid: await token_ids(engine.submit(greedy(engine, rid, text))) for rid, text in texts.items()}
    return serve(make_engine(catalog, eager), body)


def seed_of(engine, handle) -> int:
    return engine._by_slot[handle.slot].sampling.seed


class Fault:
    """Raises once, in the first frame that carries the victim's row, and remembers that frame's rows."""

    def __init__(self) -> None:
        self.frame_seeds: tuple[int, ...] | None = None

    def maybe_raise(self, seeds) -> None:
        seeds = tuple(int(s) for s in seeds)
        if self.frame_seeds is None and VICTIM_SEED in seeds:
            self.frame_seeds = seeds
            raise RuntimeError("injected fault")


def inject_in_row_packing(monkeypatch, engine, fault: Fault) -> None:
    pack = helios.runtime.executor._row_inputs

    def packing(graph, rows, contexts):
        fault.maybe_raise(contexts[r.lane.handle].sampling.seed for r in rows)
        return pack(graph, rows, contexts)
    monkeypatch.setattr(helios.runtime.executor, "_row_inputs", packing)


def inject_in_program_call(monkeypatch, engine, fault: Fault) -> None:
    program_for = engine.executor.program_for

    def faulty(graph_id):
        program = program_for(graph_id)

        def call(**named):
            active = named["query_lens"] > 0
            fault.maybe_raise(named["seed"][active].tolist())
            return program(**named)
        return call
    engine.executor.program_for = faulty


def inject_in_completion(monkeypatch, engine, fault: Fault) -> None:
    complete = engine.scheduler.complete

    def completing(fence, records, timing):
        fault.maybe_raise(seed_of(engine, r.handle) for r in records)
        return complete(fence, records, timing)
    monkeypatch.setattr(engine.scheduler, "complete", completing)


@pytest.mark.parametrize("inject", [inject_in_row_packing, inject_in_program_call, inject_in_completion],
                         ids=["row-packing", "program-call", "completion"])
def test_a_fault_in_one_frame_fails_only_that_frames_requests_and_the_engine_keeps_serving(
        catalog, eager, reference, monkeypatch, inject):
    engine = make_engine(catalog, eager)
    fault = Fault()
    inject(monkeypatch, engine, fault)

    async def body(engine):
        streams = [engine.submit(greedy(engine, f"b{i}", text, seed=i)) for i, text in enumerate(BACKGROUND)]
        firsts = [await stream.__anext__() for stream in streams]  # every background stream is decoding now
        victim = asyncio.ensure_future(token_ids(engine.submit(greedy(engine, "victim", VICTIM_TEXT, VICTIM_SEED))))
        rests = [asyncio.ensure_future(token_ids(s)) for s in streams]
        outcomes = await asyncio.gather(victim, *rests, return_exceptions=True)
        late = await token_ids(engine.submit(greedy(engine, "late", LATE_TEXT, seed=99)))
        return firsts, outcomes, late, await asyncio.to_thread(wait_idle, engine)

    firsts, (victim, *rests), late, idle = serve(engine, body)
    assert isinstance(victim, GenerationFailed) and "injected fault" in str(victim), victim
    assert fault.frame_seeds is not None
    survivors = 0
    for i, (first, rest) in enumerate(zip(firsts, rests)):
        if i in fault.frame_seeds:  # shared the failing frame: fails with it
            assert isinstance(rest, GenerationFailed), f"b{i} shared the failing frame but got {rest!r}"
        else:
            assert not isinstance(rest, Exception), f"b{i} was not in the failing frame but failed: {rest!r}"
            assert [*first.token_ids, *rest] == reference[f"b{i}"], f"b{i}'s text changed"
            survivors += 1
    assert survivors >= 2, "a prompt frame holds at most one decode row, so two streams ran on beside it"
    assert late == reference["late"]
    assert idle.accepting and idle.kv_pages_used == 0
    engine.pages.assert_no_leaks()


def test_seeds_and_top_k_beyond_the_program_input_types_are_reduced_not_fatal(catalog, eager, reference):
    """seed is an int64 input and top_k an int32 one: larger values used to overflow while packing rows."""
    engine = make_engine(catalog, eager)
    prompt = tuple(engine.tokenizer.encode("Once upon a time", add_special_tokens=True))

    def sampled(rid: str, **sampling) -> GenerationRequest:
        return GenerationRequest(rid, prompt, 12, SamplingParams(temperature=1.0, **sampling))

    async def body(engine):
        background = asyncio.ensure_future(token_ids(engine.submit(greedy(engine, "b0", BACKGROUND[0], seed=0))))
        names = {"top_seed": dict(seed=2**63), "unsigned_max": dict(seed=2**64 - 1), "minus_one": dict(seed=-1),
                 "huge_top_k": dict(top_k=2**31, seed=5), "no_top_k": dict(seed=5)}
        results = await asyncio.gather(*(token_ids(engine.submit(sampled(n, **s))) for n, s in names.items()))
        return dict(zip(names, results)), await background, await asyncio.to_thread(wait_idle, engine)

    got, background, idle = serve(engine, body)
    assert all(len(ids) > 0 for ids in got.values()), got
    assert got["unsigned_max"] == got["minus_one"], "a seed and the same seed minus 2**64 share their 64 bits"
    assert got["huge_top_k"] == got["no_top_k"], "a top_k beyond the vocabulary cuts nothing"
    assert background == reference["b0"]
    assert idle.accepting and idle.kv_pages_used == 0


def test_a_top_p_that_rounds_to_zero_in_float32_keeps_the_most_likely_token(catalog, eager):
    """As vLLM does, top-p sampling keeps at least one token: the output is the greedy one, never empty."""
    engine = make_engine(catalog, eager)

    async def body(engine):
        plain = await token_ids(engine.submit(greedy(engine, "g", BACKGROUND[1], tokens=12)))
        tiny = GenerationRequest("t", tuple(engine.tokenizer.encode(BACKGROUND[1], add_special_tokens=True)), 12,
                                 SamplingParams(temperature=1.0, top_p=1e-50, seed=3))
        deltas = [d async for d in engine.submit(tiny)]
        return plain, deltas

    plain, deltas = serve(engine, body)
    assert [t for d in deltas for t in d.token_ids] == plain
    assert "".join(d.text for d in deltas) and deltas[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)


def test_a_failing_admission_fails_only_that_request(catalog, eager, reference, monkeypatch):
    """Admission raising (a scheduler bug, or a request it cannot hold) used to stop the engine for good."""
    engine = make_engine(catalog, eager)
    victim_length = len(greedy(engine, "victim", VICTIM_TEXT).prompt_token_ids)
    assert all(len(greedy(engine, "x", t).prompt_token_ids) != victim_length for t in (*BACKGROUND, LATE_TEXT))
    admit = engine.scheduler.admit

    def admitting(request):
        if request.prompt_tokens == victim_length:
            raise RuntimeError("injected admission fault")
        return admit(request)
    monkeypatch.setattr(engine.scheduler, "admit", admitting)

    async def body(engine):
        streams = [engine.submit(greedy(engine, f"b{i}", text)) for i, text in enumerate(BACKGROUND)]
        firsts = [await stream.__anext__() for stream in streams]
        victim = asyncio.ensure_future(token_ids(engine.submit(greedy(engine, "victim", VICTIM_TEXT))))
        rests = [asyncio.ensure_future(token_ids(s)) for s in streams]
        outcomes = await asyncio.gather(victim, *rests, return_exceptions=True)
        late = await token_ids(engine.submit(greedy(engine, "late", LATE_TEXT)))
        return firsts, outcomes, late, await asyncio.to_thread(wait_idle, engine)

    firsts, (victim, *rests), late, idle = serve(engine, body)
    assert isinstance(victim, GenerationFailed) and "injected admission fault" in str(victim), victim
    for i, (first, rest) in enumerate(zip(firsts, rests)):
        assert [*first.token_ids, *rest] == reference[f"b{i}"], f"b{i} changed"
    assert late == reference["late"]
    assert idle.accepting and idle.kv_pages_used == 0
    engine.pages.assert_no_leaks()


def test_a_failing_plan_fails_the_resident_requests_and_the_engine_serves_later_ones(
        catalog, eager, reference, monkeypatch):
    """plan() raising blames no single frame: the resident requests fail, nothing is left waiting, and the
    engine goes on admitting and serving (it used to turn /health to 503 for good)."""
    engine = make_engine(catalog, eager)
    plan, raised = engine.scheduler.plan, []

    def planning():
        if not raised and len(engine._by_slot) == len(BACKGROUND):
            raised.append(True)
            raise RuntimeError("injected planning fault")
        return plan()
    monkeypatch.setattr(engine.scheduler, "plan", planning)

    async def body(engine):
        streams = [engine.submit(greedy(engine, f"b{i}", text)) for i, text in enumerate(BACKGROUND)]
        outcomes = await asyncio.gather(*(token_ids(s) for s in streams), return_exceptions=True)
        late = await token_ids(engine.submit(greedy(engine, "late", LATE_TEXT)))
        return outcomes, late, await asyncio.to_thread(wait_idle, engine)

    outcomes, late, idle = serve(engine, body)
    assert raised, "the fault never fired: all three requests were never resident together"
    assert all(isinstance(o, GenerationFailed) and "injected planning fault" in str(o) for o in outcomes), outcomes
    assert late == reference["late"]
    assert idle.accepting and idle.kv_pages_used == 0
    engine.pages.assert_no_leaks()
