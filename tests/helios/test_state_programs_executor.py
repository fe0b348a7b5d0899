"""The executor's state operations (helios/runtime/state_ops.py) on the tiny slice's captured programs.

A prompt prefilled in one slot, snapshotted by the captured snapshot program,
restored into another slot and finished there, then decoded, commits what one
uninterrupted prefill commits (bundled model, exported state programs);
binding refuses what would fail half-way; a program reporting other copies
than were bound fails before any result exists (A2).
"""

from __future__ import annotations

import pytest
import torch

from helios.runtime.executor import Executor, LaneContext, RowSampling, bind
from helios.runtime.frame_outputs import FrameOutputError
from helios.runtime.state_ops import StateCopy, StoreShape, bind_state, state_copies
from helios.scheduler.types import LanePhase, PlannedLane, RequestHandle, ScheduledPlan, SelectionReason
from numerics import assert_tokens_match, qwen3_tolerance, recorded_decisions
from tiny_catalog import bundled_checkpoints

STATE_PREFIXES = ("snapshot_", "restore_", "init_")


def plan_of(graph, lanes):
    return ScheduledPlan(graph, tuple(lanes), SelectionReason.ORDINARY, 0, 1.0, 0.0)


def handle(slot):
    return RequestHandle(slot, 1)


def page_table(catalog, slots_pages):
    layout = catalog.state.layout
    table = torch.full((layout["request_slots"], layout["max_pages_per_slot"]), -1, dtype=torch.int32)
    for slot, pages in slots_pages.items():
        table[slot, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return table


@pytest.fixture
def executor(catalog, eager):
    """Exported state programs; eager twins of the frame programs, so their decisions can be recorded."""
    program_for = lambda gid: catalog.program(gid) if gid.startswith(STATE_PREFIXES) else eager(gid)
    return Executor(catalog.allocate_state(), program_for, frozenset())


def prefill(executor, catalog, table, slot, prompt, start, count, final):
    graph = catalog.entry("prefill_p64").descriptor
    lane = PlannedLane(handle(slot), LanePhase.PROMPT, prompt_start=start, prompt_tokens=count, finishes_prompt=final)
    context = {lane.handle: LaneContext(RowSampling(), prompt=tuple(prompt))}
    return executor.run(bind(plan_of(graph, [lane]), context, table), 0).records[0].tokens


def decode(executor, catalog, table, slot, steps):
    graph = catalog.entry("decode_b1").descriptor
    lane = PlannedLane(handle(slot), LanePhase.DECODE, query_length=1)
    context = {lane.handle: LaneContext(RowSampling())}
    return [executor.run(bind(plan_of(graph, [lane]), context, table), 0).records[0].tokens[0] for _ in range(steps)]


def copy(executor, catalog, table, graph_id, copies):
    bound = bind_state(catalog.entry(graph_id).descriptor, copies, table, StoreShape.of(executor.state))
    return executor.run_state(bound, 0)


@pytest.mark.numerics
def test_snapshot_restore_then_remainder_equals_one_prefill_on_the_captured_programs(catalog, executor):
    """n = 37 tokens (two pages of 16 and a partial third), m = 20 more after the restore, k = 6 greedy tokens."""
    prompt = [(7 * i + 3) % 200 + 50 for i in range(57)]
    n, k = 37, 6
    table = page_table(catalog, {0: [5, 9, 2, 40], 1: [11, 3, 30, 31], 3: [20, 21, 22, 23]})
    with recorded_decisions() as decisions:
        want = list(prefill(executor, catalog, table, 3, prompt, 0, len(prompt), True))
        want += decode(executor, catalog, table, 3, k)
    reference_history = {n_: executor.state[n_][3].clone() for n_ in ("token_counts", "prompt_seen", "seq_lens")}
    prefill(executor, catalog, table, 0, prompt[:n], 0, n, False)
    result = copy(executor, catalog, table, "snapshot_b2", [StateCopy(0, 1, n), StateCopy(2, -1, 0)])
    assert result.copied == (n, 0) and result.timing.device_ns > 0
    copy(executor, catalog, table, "init_b2", [StateCopy(0)])  # the source slot is free again
    assert int(executor.state["seq_lens"][0]) == 0
    assert copy(executor, catalog, table, "restore_b1", [StateCopy(1, 1, n)]).copied == (n,)
    got = list(prefill(executor, catalog, table, 1, prompt, n, len(prompt) - n, True))
    got += decode(executor, catalog, table, 1, k)
    tolerance = qwen3_tolerance(bundled_checkpoints()[0].config, len(prompt) + k)
    if not assert_tokens_match(torch.tensor(got), torch.tensor(want), decisions, tolerance, "tokens"):
        for name, value in reference_history.items():
            assert torch.equal(executor.state[name][1], value), name


def test_draft_caches_travel_with_the_snapshot(catalog, executor):
    """The slice keeps learned draft state: a restore hands the draft's KV over too."""
    table = page_table(catalog, {0: [1, 2], 2: [7, 8]})
    state = executor.state
    assert "draft_k_cache" in state and "checkpoint_draft_k" in state
    prompt = list(range(60, 80))
    prefill(executor, catalog, table, 0, prompt, 0, 20, False)
    copy(executor, catalog, table, "snapshot_b1", [StateCopy(0, 0, 20)])
    copy(executor, catalog, table, "restore_b2", [StateCopy(2, 0, 20)])
    for name in ("k_cache", "v_cache", "draft_k_cache", "draft_v_cache"):
        first = state[name][:, 1].clone(), state[name][:, 2, :4].clone()
        assert torch.equal(state[name][:, 7], first[0]) and torch.equal(state[name][:, 8, :4], first[1]), name


def test_binding_refuses_what_would_fail_half_way(catalog):
    table = page_table(catalog, {0: [1, 2], 1: [3]})
    store = StoreShape(rows=2, page_size=16)
    snapshot = catalog.entry("snapshot_b2").descriptor
    cases = [
        ([StateCopy(0, 2, 20)], "checkpoint row 2 outside the store's 0..1"),
        ([StateCopy(1, 0, 20)], "slot 1 has no page for some of its first 20 positions"),
        ([StateCopy(0, 1, 20), StateCopy(1, 1, 10)], "two rows write one checkpoint row"),
        ([StateCopy(0, 0, 1)] * 3, "3 copies exceed B = 2"),
        ([StateCopy(9, 0, 1)], "slots \\[9\\] outside 0..3"),
    ]
    for copies, message in cases:
        with pytest.raises(ValueError, match=message):
            bind_state(snapshot, copies, table, store)
    with pytest.raises(ValueError, match="two rows write one slot"):
        bind_state(catalog.entry("restore_b2").descriptor, [StateCopy(0, 0, 5), StateCopy(0, 1, 5)], table, store)
    with pytest.raises(ValueError, match="not a state program"):
        bind_state(catalog.entry("decode_b1").descriptor, [], table, store)
    bound = bind_state(snapshot, [StateCopy(1, -1, 20)], table, store)  # inactive: no destination, nothing checked
    assert bound.inputs["checkpoint_rows"].tolist() == [-1, -1] and bound.inputs["checkpoint_tokens"].tolist() == [0, 0]


def test_A2_a_state_program_reporting_other_copies_fails_before_any_result(catalog):
    table = page_table(catalog, {0: [1, 2]})
    graph = catalog.entry("snapshot_b2").descriptor
    bound = bind_state(graph, [StateCopy(0, 0, 20)], table, StoreShape(rows=2, page_size=16))
    liar = lambda gid: (lambda **named: {"copied_tokens": torch.tensor([16, 0], dtype=torch.int32)})
    with pytest.raises(FrameOutputError, match="rows report \\[16, 0\\] but \\[20, 0\\] were bound"):
        Executor({}, liar, frozenset()).run_state(bound, 0)


def test_state_lanes_become_copies_with_the_destinations_the_engine_bound(catalog):
    graph = catalog.entry("snapshot_b2").descriptor
    lanes = [PlannedLane(handle(0), LanePhase.SNAPSHOT, checkpoint_tokens=30),
             PlannedLane(handle(2), LanePhase.SNAPSHOT, checkpoint_tokens=12)]
    assert state_copies(plan_of(graph, lanes), {handle(0): 1}) == (StateCopy(0, 1, 30), StateCopy(2, -1, 12))
    restore = [PlannedLane(handle(3), LanePhase.RESTORE, checkpoint_row=0, checkpoint_tokens=30)]
    assert state_copies(plan_of(graph, restore)) == (StateCopy(3, 0, 30),)


def test_catalog_lists_state_programs_apart_from_inference(catalog):
    kinds = {d.kind.value for d in catalog.state_descriptors}
    assert kinds == {"snapshot", "restore", "init"}
    assert not any(d.kind.value in kinds for d in catalog.descriptors)  # what the scheduler and warm-up see today
    assert catalog.checkpoint_rows == 2
    assert all(not catalog.entry(d.id).compiled_file for d in catalog.state_descriptors)


@pytest.mark.numerics
def test_packed_weights_give_the_eager_models_tokens(catalog, eager):
    """A catalog whose linear weights are packed (what the engine runs on an AVX-512 CPU) prefills and
    decodes greedily to the eager model's tokens, the unpacked layout, within the model's near-tie bound."""
    from helios.catalog.load import load
    from helios.ops import kernels

    if not kernels.packs_linear_weights():
        pytest.skip("packed weights are the native AVX-512 kernel's")
    packed = load(catalog.path)
    assert packed.pack_linear_weights() > 0
    prompt, k = [(5 * i + 11) % 200 + 40 for i in range(57)], 6
    table = page_table(catalog, {0: [5, 9, 2, 40]})
    reference = Executor(catalog.allocate_state(), eager, frozenset())
    with recorded_decisions() as decisions:
        want = list(prefill(reference, catalog, table, 0, prompt, 0, len(prompt), True))
        want += decode(reference, catalog, table, 0, k)
    run = Executor(packed.allocate_state(), packed.program, frozenset())
    got = list(prefill(run, packed, table, 0, prompt, 0, len(prompt), True))
    got += decode(run, packed, table, 0, k)
    tolerance = qwen3_tolerance(bundled_checkpoints()[0].config, len(prompt) + k)
    assert_tokens_match(torch.tensor(got), torch.tensor(want), decisions, tolerance, "packed tokens")
