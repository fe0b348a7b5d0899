"""Speculation end to end through the engine, on the captured tiny slice (issue 6).

Engines here call eager twins of the slice's programs (``tiny_catalog``), so
they start in milliseconds. Each speculative configuration is compared with
speculation off over the same prompts:

- greedy: outputs must be equal; where one differs, its first divergence must
  be a numerical near-tie of the target (top-two logits of the eager model
  within twice the model's reordering tolerance, tests/helios/numerics.py),
  since fp32 reductions over different row counts may round differently; the
  test prints how often that happened;
- seeded sampling at temperature 0.8: the same tokens, because the target
  samples every position with (seed, position) noise whatever the width; the
  same near-tie rule applies to the noised scores the exponential race compares.

Configurations are load-time selections (``fixed``, ``adaptive``) and, to
force each proposal and value source to run, adaptive engines restricted to
one family of wider programs (``Restricted``). A family the slice lacks is
skipped, saying so.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from flare_contract.graphs import GraphDescriptor, ValueSource
from helios.runtime.engine import EngineConfig, HeliosEngine
from helios.runtime.engine_api import GenerationRequest, SamplingParams
from eager_target import assert_same_or_near_tie, reference_choice

CI = os.environ.get("FLARE_TEST_SCALE") == "ci"
PROMPTS = 12 if CI else 24
TOKENS = 12 if CI else 16
WORDS = ("river", "copper", "lantern", "orbit", "meadow", "signal", "harbor", "ember", "the", "and", "of")


def prompts(engine: HeliosEngine, count: int) -> list[tuple[int, ...]]:
    """Distinct short prompts, some repetitive (copy proposals find matches there), some not."""
    texts = []
    for i in range(count):
        words = [WORDS[(i * 7 + j * (i % 3 + 1)) % len(WORDS)] for j in range(4 + i % 5)]
        texts.append(" ".join(words * (2 if i % 2 else 1)) + f" {i}")
    return [tuple(engine.tokenizer.encode(t, add_special_tokens=True)) for t in texts]


# ---------------------------------------------------------------------------
# Engines: load-time modes and forced families
# ---------------------------------------------------------------------------


@dataclass
class Recorder:
    """Wraps ``program_for``: records every program id called and checks each row's pages first."""

    catalog: object
    program_for: Callable
    engine: HeliosEngine | None = None
    called: list[str] = field(default_factory=list)
    rows: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)  # per call: program, its active rows' slots
    short: list[str] = field(default_factory=list)

    def __call__(self, program_id: str):
        program = self.program_for(program_id)
        graph = self.catalog.entry(program_id).descriptor

        def run(**named):
            self.called.append(program_id)
            self.rows.append((program_id, self._active_slots(named)))
            self._check_pages(graph, named)
            return program(**named)
        return run

    def _check_pages(self, graph: GraphDescriptor, named) -> None:
        """S3, A11: every decode row's page table covers what it may write, at the moment it runs.

        ``seq_lens`` here is the device's committed length after every earlier
        frame (queued ones included) has run; the frame's own page table, bound
        at commit, must cover its rows (ceiling or query length) and the
        draft's D steps after that length.
        """
        if "query_lens" not in named or graph.kind.value in ("prefill", "scored_prefill"):
            return  # state programs (snapshot, restore) have no rows of their own to check
        page = self.catalog.state.layout["page_size"]
        prompt_row = int(named["prefill_row"][0]) if "prefill_row" in named else -1
        rows = zip(named["row_slots"].tolist(), named["query_lens"].tolist())
        for index, (slot, length) in enumerate(rows):
            if length == 0 or index == prompt_row:
                continue
            extent = int(named["seq_lens"][slot]) + max(length, graph.proposal_depth + 1)
            covered = self._pages_bound(named["page_table"][slot].tolist(), slot) * page
            if extent > covered:
                self.short.append(f"{graph.id} slot {slot}: writes to {extent}, its pages cover {covered}")

    @staticmethod
    def _active_slots(named) -> tuple[int, ...]:
        """Slots of the call's rows that run (a mixed frame's prompt row included)."""
        if "row_slots" not in named or "query_lens" not in named:
            return ()
        return tuple(slot for slot, length in zip(named["row_slots"].tolist(), named["query_lens"].tolist()) if length)

    def _pages_bound(self, row: list[int], slot: int) -> int:
        """Pages of ``slot`` in the frame's table: the prefix it shares with the allocator's list now.

        A frame's pages stay owned until it completes, so they are a prefix of
        the allocator's current list (a page 0 right after that prefix could
        only make this count one too high, never too low).
        """
        current = self.engine.pages.slot_pages(slot)
        count = 0
        while count < len(current) and row[count] == current[count]:
            count += 1
        return count


class Restricted(HeliosEngine):
    """An adaptive engine whose wider rounds are only ``keep``'s family (the rest of the selection stays)."""

    keep: Callable[[GraphDescriptor], bool] = staticmethod(lambda g: True)

    def _graphs(self) -> tuple[GraphDescriptor, ...]:
        return tuple(g for g in super()._graphs() if not g.draws_proposals or self.keep(g))


FAMILIES: dict[str, Callable[[GraphDescriptor], bool]] = {
    "learned_query_length": lambda g: g.proposal_source == "learned" and g.value_source is ValueSource.QUERY_LENGTH,
    "learned_prefix_limit": lambda g: g.value_source is ValueSource.PREFIX_LIMIT,
    "copy": lambda g: g.proposal_source == "copy",
    "mixed": lambda g: g.kind.value == "mixed",
}


def make(catalog, eager, speculation: str, family: str | None = None,
         floor: str | None = None) -> tuple[HeliosEngine, Recorder]:
    """An engine of ``speculation`` mode; ``family``: only that family's wider rounds. The floor defaults to
    the engine's ("plain") without a family, and to "draft" with one: a forced family must get to run, and
    under the plain floor a row that ran ordinary decode first never drafts again."""
    recorder = Recorder(catalog, eager)
    floor = floor or ("plain" if family is None else "draft")
    config = EngineConfig(speculation=speculation, threads=1, adaptive_floor=floor)
    if family is None:
        engine = HeliosEngine(catalog, config, program_for=recorder)
    else:
        engine_class = type(f"Only_{family}", (Restricted,), {"keep": staticmethod(FAMILIES[family])})
        engine = engine_class(catalog, config, program_for=recorder)
    recorder.engine = engine
    return engine, recorder


def family_present(catalog, family: str) -> bool:
    return any(g.draws_proposals and FAMILIES[family](g) for g in catalog.descriptors)


def generate(engine: HeliosEngine, ids: list[tuple[int, ...]], sampling: Callable[[int], SamplingParams]):
    """Every prompt at once (the scheduler batches them as it likes); token ids per prompt."""
    async def one(i: int, prompt: tuple[int, ...]) -> list[int]:
        request = GenerationRequest(f"r{i}", prompt, TOKENS, sampling(i))
        return [t async for d in engine.submit(request) for t in d.token_ids]

    async def main():
        await engine.start()
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(ids))), 300)
        finally:
            await engine.stop()
    return asyncio.run(main())


# ---------------------------------------------------------------------------
# The reference: the eager target model's logits
# ---------------------------------------------------------------------------


def top_two(tokens: list[int], sampling: SamplingParams | None = None) -> tuple[int, float, float]:
    """The reference's choice after ``tokens``, its lead over the runner-up, and the near-tie margin."""
    return reference_choice(tokens, sampling)


def assert_equal_or_near_ties(name: str, prompts_: list, reference: list[list[int]], got: list[list[int]],
                              sampling: Callable[[int], SamplingParams] | None = None) -> int:
    """Equal outputs, or a first divergence at a near-tie of the reference; returns how many diverged."""
    diverged = sum(assert_same_or_near_tie(prompt, want, have, sampling(i) if sampling else None, f"{name} #{i}")
                   for i, (prompt, want, have) in enumerate(zip(prompts_, reference, got)))
    print(f"\n{name}: {diverged} of {len(reference)} outputs diverge from speculation off, each at a near-tie")
    return diverged


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------

def greedy(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0)


def seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=1000 + i)


@pytest.fixture(scope="module")
def reference(catalog, eager):
    """Speculation off: the outputs every configuration must reproduce (greedy and seeded)."""
    engine, recorder = make(catalog, eager, "off")
    ids = prompts(engine, PROMPTS)
    greedy_out = generate(engine, ids, greedy)
    engine, _ = make(catalog, eager, "off")
    seeded_out = generate(engine, ids, seeded)
    assert not any(catalog.entry(p).descriptor.draws_proposals for p in recorder.called)
    return ids, greedy_out, seeded_out


CONFIGURATIONS = [
    ("fixed", None),
    ("adaptive", None),
    ("adaptive:draft", None),
    ("adaptive", "learned_query_length"),
    ("adaptive", "learned_prefix_limit"),
    ("adaptive", "copy"),
    ("adaptive", "mixed"),
]


@pytest.mark.slow
@pytest.mark.parametrize("mode, family", CONFIGURATIONS)
def test_Y3_S1_S2_S4_greedy_output_equals_speculation_off_up_to_near_ties(catalog, eager, reference, mode, family):
    if family is not None and not family_present(catalog, family):
        pytest.skip(f"the tiny slice has no {family} speculative program")
    ids, reference_out, _ = reference
    mode, _, floor = mode.partition(":")
    engine, recorder = make(catalog, eager, mode, family, floor or None)
    got = generate(engine, ids, greedy)
    assert_equal_or_near_ties(f"{mode}/{family or 'all'}", ids, reference_out, got)
    ran = {p for p in recorder.called if catalog.entry(p).descriptor.draws_proposals}
    assert ran, f"{mode}/{family}: no speculative round ran"
    if family is not None:
        assert all(FAMILIES[family](catalog.entry(p).descriptor) for p in ran), ran
    assert not recorder.short, recorder.short[:3]
    print(f"{mode}/{family or 'all'}: programs {sorted(set(recorder.called))}, "
          f"{engine.frame_counters().queued_commits} frames queued behind a running one")
    if mode == "fixed":  # fixed width never probes acceptance (D8)
        assert not any(e.category == "acceptance_learning" for e in engine.stats().executions)
    totals = {t.source: t for t in engine.stats().speculative}
    sources = {catalog.entry(p).descriptor.proposal_source for p in ran}
    assert set(totals) <= sources and sum(t.rounds for t in totals.values()) > 0, (totals, sources)
    for t in totals.values():  # metrics: per-position acceptances add up, never more than offered
        assert sum(t.accepted_by_position) == t.accepted_tokens <= t.draft_tokens
        assert t.emitted_tokens == t.accepted_tokens + t.rounds


def test_the_near_tie_reference_is_the_model_speculation_off_runs(reference):
    """The divergence check is only as good as its reference: it must predict what the programs produced."""
    ids, reference_out, seeded_out = reference
    for i, (prompt, output, drawn) in enumerate(list(zip(ids, reference_out, seeded_out))[:3]):
        for cut in (0, len(output) // 2):
            token, gap, _ = top_two([*prompt, *output[:cut]])
            assert token == output[cut] and gap >= 0.0
            token, gap, _ = top_two([*prompt, *drawn[:cut]], seeded(i))
            assert token == drawn[cut] and gap >= 0.0


@pytest.mark.slow
@pytest.mark.parametrize("mode, family", [("fixed", None), ("adaptive", None), ("adaptive", "learned_prefix_limit")])
def test_seeded_sampling_gives_the_same_tokens_with_speculation_off_fixed_and_adaptive(catalog, eager, reference,
                                                                                       mode, family):
    if family is not None and not family_present(catalog, family):
        pytest.skip(f"the tiny slice has no {family} speculative program")
    ids, _, reference_out = reference
    engine, recorder = make(catalog, eager, mode, family)
    assert_equal_or_near_ties(f"seeded {mode}/{family or 'all'}", ids, reference_out, generate(engine, ids, seeded),
                              seeded)
    assert any(catalog.entry(p).descriptor.draws_proposals for p in recorder.called)


class PrefixLimitOnly(HeliosEngine):
    """Decodes with prefix-limit rounds only (no width-one program to fall back on near the end)."""

    def _graphs(self) -> tuple[GraphDescriptor, ...]:
        return tuple(g for g in super()._graphs() if g.kind.value == "prefill" or g.is_prefix_limit)


def test_S3_a_prefix_limit_lane_at_the_end_of_the_context_keeps_room_for_every_draft_step(catalog, eager):
    """A prefix-limit row runs all D draft steps whatever its ceiling, even with one token of room left."""
    if not family_present(catalog, "learned_prefix_limit"):
        pytest.skip("the tiny slice has no prefix_limit program")
    recorder = Recorder(catalog, eager)
    engine = recorder.engine = PrefixLimitOnly(catalog, EngineConfig(threads=1), program_for=recorder)
    prompt = prompts(engine, 1)[0]
    prompt = (prompt * (engine.context_length // len(prompt) + 1))[: engine.context_length - 6]
    request = GenerationRequest("edge", prompt, 16, SamplingParams(temperature=0.0))

    async def main():
        await engine.start()
        try:
            return [d async for d in engine.submit(request)]
        finally:
            await engine.stop()
    deltas = asyncio.run(main())  # a write beyond the slot's pages would fail the request here
    produced = sum(len(d.token_ids) for d in deltas)
    assert deltas[-1].finish_reason.value == "length" and produced == 6, (len(prompt), engine.context_length, produced)
    assert {p for p in recorder.called if catalog.entry(p).descriptor.draws_proposals} == {
        g.id for g in engine.scheduler.graphs if g.is_prefix_limit}
    assert not recorder.short, recorder.short[:3]


def learned_rounds_after_a_plain_frame(catalog, recorder: Recorder) -> list[str]:
    """Calls of learned rounds naming a slot whose request ran an ordinary decode or mixed frame before
    (a prefill of the slot starts a request afresh: its prompt's last token is always computed)."""
    behind: set[int] = set()
    found = []
    for program_id, slots in recorder.rows:
        graph = catalog.entry(program_id).descriptor
        if graph.kind.value in ("prefill", "scored_prefill"):
            behind -= set(slots)
        elif graph.kind.value == "decode" or (graph.kind.value == "mixed" and graph.proposal_source is None):
            behind |= set(slots)
        elif graph.proposal_source == "learned" and graph.draws_proposals and behind & set(slots):
            found.append(f"{program_id} runs slots {sorted(behind & set(slots))}")
    return found


@pytest.mark.slow
def test_the_plain_floor_runs_ordinary_decode_beside_speculation_with_the_output_of_speculation_off(
        catalog, eager, reference):
    """Adaptive with ``adaptive_floor`` "plain": greedy output equal to speculation off (up to near-ties,
    as every configuration above), ordinary decode frames ran, and no learned round ever ran a row
    after an ordinary frame left its draft cache behind."""
    ids, reference_out, _ = reference
    engine, recorder = make(catalog, eager, "adaptive", floor="plain")
    got = generate(engine, ids, greedy)
    assert_equal_or_near_ties("adaptive/plain floor", ids, reference_out, got)
    kinds = [catalog.entry(p).descriptor for p in recorder.called]
    assert any(g.kind.value == "decode" for g in kinds), sorted(set(recorder.called))
    assert any(g.draws_proposals for g in kinds), sorted(set(recorder.called))
    assert not learned_rounds_after_a_plain_frame(catalog, recorder)
    assert not recorder.short, recorder.short[:3]
