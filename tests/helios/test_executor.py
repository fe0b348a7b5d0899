"""The executor: plan -> program inputs (C14 packing, sampling rows) and outputs -> records (A13)."""

from __future__ import annotations

import time

import pytest
import torch

from flare_contract.graphs import GraphDescriptor, GraphKind, ValueSource
from helios.runtime.executor import Executor, LaneContext, RowInputCache, RowSampling, bind, row_lengths
from helios.scheduler.types import LanePhase, PlannedLane, RequestHandle, ScheduledPlan, SelectionReason

MIXED = GraphDescriptor("mixed_b4_w2_p64", GraphKind.MIXED, batch_capacity=4, proposal_depth=1, width=2,
                        prefill_capacity=64, ragged=True, aggregate=70, value_source=ValueSource.QUERY_LENGTH)
PREFIX = GraphDescriptor("spec_pl", GraphKind.SPECULATIVE, batch_capacity=4, proposal_depth=3, width=4,
                         aggregate=8, ragged=True, value_source=ValueSource.PREFIX_LIMIT, proposal_source="learned",
                         confidence_width=3)
DECODE = GraphDescriptor("decode_b4", GraphKind.DECODE, batch_capacity=4)
PROMPT = tuple(range(100, 140))


def plan_of(graph, lanes, prefill_row=None):
    return ScheduledPlan(graph, tuple(lanes), SelectionReason.ORDINARY, 0, 1.0, 0.0, prefill_row=prefill_row)


def decode_lane(slot, length=1, ceiling=0):
    return PlannedLane(RequestHandle(slot, slot + 1), LanePhase.DECODE, query_length=length, ceiling=ceiling)


def prompt_lane(slot, start, count, final=True):
    return PlannedLane(RequestHandle(slot, slot + 1), LanePhase.PROMPT, prompt_start=start, prompt_tokens=count,
                       finishes_prompt=final)


def contexts(lanes, drafts=(7, 8, 9)):
    out = {}
    for lane in lanes:
        sampling = RowSampling(temperature=0.5 + lane.handle.slot, top_k=lane.handle.slot, top_p=0.9,
                               seed=1000 + lane.handle.slot)
        out[lane.handle] = LaneContext(sampling, prompt=PROMPT, drafts=drafts)
    return out


def page_table():
    return torch.zeros(4, 8, dtype=torch.int32)


def test_C14_A13_mixed_rows_pack_by_prefix_sums_whatever_their_slots():
    lanes = [decode_lane(2, 2), prompt_lane(0, 10, 5), decode_lane(3, 2)]
    frame = bind(plan_of(MIXED, lanes, prefill_row=1), contexts(lanes), page_table())
    x = frame.inputs
    assert x["query_lens"].tolist() == [2, 5, 2, 0]  # one upload for every row of the frame
    assert x["row_slots"].tolist()[:3] == [2, 0, 3]
    assert [r.offset for r in frame.rows] == [0, 2, 7]  # the prompt row's packed offset
    assert x["prefill_row"].tolist() == [1]
    assert x["prompt_tokens"][:5].tolist() == list(PROMPT[10:15]) and not x["prompt_tokens"][5:].any()
    assert x["prompt_start"].tolist() == [10] and x["prompt_final"].tolist() == [True]
    assert x["draft_tokens"].tolist() == [[7], [0], [7], [0]]  # prompt and padding rows carry no drafts
    assert [r.offered for r in frame.rows] == [1, 0, 1]


def test_C14_mixed_frame_without_a_prompt_row_says_so():
    lanes = [decode_lane(1, 2), decode_lane(0, 1)]
    frame = bind(plan_of(MIXED, lanes), contexts(lanes), page_table())
    assert frame.inputs["prefill_row"].tolist() == [-1]
    assert frame.inputs["query_lens"].tolist() == [2, 1, 0, 0]


def test_mixed_row_roles_are_validated():
    lanes = [decode_lane(2, 2), prompt_lane(0, 10, 5)]
    with pytest.raises(ValueError, match="prefill_row"):
        bind(plan_of(MIXED, lanes, prefill_row=0), contexts(lanes), page_table())
    two_prompts = [prompt_lane(0, 0, 3), prompt_lane(1, 0, 3)]
    with pytest.raises(ValueError, match="at most one prompt row"):
        bind(plan_of(MIXED, two_prompts, prefill_row=0), contexts(two_prompts), page_table())


def test_row_sampling_masks_leave_padding_rows_greedy_and_uncut():
    lanes = [decode_lane(3), decode_lane(1)]
    x = bind(plan_of(DECODE, lanes), contexts(lanes), page_table()).inputs
    assert x["temperature"].tolist() == [3.5, 1.5, 0.0, 0.0]
    assert x["top_k"].tolist() == [3, 1, 0, 0]
    assert x["top_p"].tolist() == pytest.approx([0.9, 0.9, 1.0, 1.0])
    assert x["seed"].tolist() == [1003, 1001, 0, 0]
    assert "draft_tokens" not in x and "prompt_tokens" not in x


def test_a_repeated_batch_reuses_its_row_tensors_and_any_changed_value_binds_afresh():
    """The engine's cache: the same rows and sampling bind the same tensors; a change binds the new values."""
    cache, lanes = RowInputCache(), [decode_lane(3), decode_lane(1)]
    names = ("row_slots", "query_lens", "temperature", "top_k", "top_p", "seed", "min_p", "repetition_penalty",
             "bias_ids")
    first = bind(plan_of(DECODE, lanes), contexts(lanes), page_table(), cache).inputs
    again = bind(plan_of(DECODE, lanes), contexts(lanes), page_table(), cache).inputs
    assert all(again[name] is first[name] for name in names)
    uncached = bind(plan_of(DECODE, lanes), contexts(lanes), page_table()).inputs
    assert all(torch.equal(first[name], uncached[name]) for name in names)
    changes = {"slot": [decode_lane(2), decode_lane(1)], "length": [decode_lane(3, 2), decode_lane(1)],
               "order": [decode_lane(1), decode_lane(3)]}
    for what, changed in changes.items():
        got = bind(plan_of(MIXED, changed), contexts(changed), page_table(), cache).inputs
        want = bind(plan_of(MIXED, changed), contexts(changed), page_table()).inputs
        assert all(torch.equal(got[name], want[name]) for name in names), what
    other = contexts(lanes)
    other[lanes[0].handle] = LaneContext(RowSampling(temperature=0.5, seed=7, repetition_penalty=1.3))
    got = bind(plan_of(DECODE, lanes), other, page_table(), cache).inputs
    assert got["seed"].tolist() == [7, 1001, 0, 0] and got["repetition_penalty"].tolist()[:2] == pytest.approx([1.3, 1.0])
    assert bind(plan_of(DECODE, lanes), contexts(lanes), page_table(), cache).inputs["seed"] is first["seed"]


def test_S2_prefix_limit_rows_carry_their_ceilings_even_when_they_sum_above_P():
    lanes = [decode_lane(0, ceiling=4), decode_lane(1, ceiling=4), decode_lane(2, ceiling=3)]
    frame = bind(plan_of(PREFIX, lanes), contexts(lanes), page_table())
    assert row_lengths(plan_of(PREFIX, lanes)) == [4, 4, 3]  # 11 > P = 8: the device allocates
    assert frame.inputs["query_lens"].tolist() == [4, 4, 3, 0]
    assert "draft_tokens" not in frame.inputs  # learned: the program draws its own proposals


def test_S2_a_ceiling_beyond_D_plus_one_is_refused_at_bind():
    lanes = [decode_lane(0, ceiling=5)]
    with pytest.raises(ValueError, match="ceilings \\[5\\] outside 1..min\\(D \\+ 1, W\\) = 1..4"):
        bind(plan_of(PREFIX, lanes), contexts(lanes), page_table())


class FakeProgram:
    """Returns fixed tokens; records the inputs it was called with."""

    def __init__(self, tokens, counts):
        self.tokens, self.counts, self.calls = tokens, counts, []

    def __call__(self, **named):
        self.calls.append(named)
        return {"tokens": torch.tensor(self.tokens), "num_tokens": torch.tensor(self.counts, dtype=torch.int32)}


def test_A3_the_wall_interval_ends_when_the_call_returns_not_when_its_outputs_are_read():
    """The engine's worker calls the program and the control thread reads the outputs later
    (Executor.call, then Executor.finish): an isolated frame's service interval, max(device, wall) (A3),
    must not grow by the wait between the two."""
    lanes = [decode_lane(0, 1)]
    program = FakeProgram([[7], [0], [0], [0]], [1, 0, 0, 0])  # decode_b4: four rows, one active
    executor = Executor({"k_cache": torch.zeros(1)}, lambda graph_id: program, frozenset({99}))
    frame = bind(plan_of(DECODE, lanes), contexts(lanes), page_table())
    dispatched = time.monotonic_ns()
    outputs, device_ns, ended = executor.call(frame)
    assert dispatched <= ended <= time.monotonic_ns()
    time.sleep(0.05)  # the frame waits for the control thread
    result = executor.finish(frame, outputs, device_ns, ended, dispatched)
    assert result.records[0].tokens == (7,)
    assert result.timing.wall_ns == ended - dispatched < 50_000_000


def test_A13_records_prompt_row_commits_its_chunk_decode_rows_cut_after_eos():
    eos = 99
    lanes = [decode_lane(2, 2), prompt_lane(0, 10, 5, final=False), decode_lane(3, 2)]
    program = FakeProgram([[eos, 4], [0, 0], [5, 6], [0, 0]], [2, 0, 2, 0])
    state = {"k_cache": torch.zeros(1)}
    executor = Executor(state, lambda graph_id: program, frozenset({eos}))
    frame = bind(plan_of(MIXED, lanes, prefill_row=1), contexts(lanes), page_table())
    result = executor.run(frame, dispatched_ns=0)
    first, prompt, last = result.records
    assert first.tokens == (eos,) and first.terminated and first.offered == 1
    assert prompt.prompt_consumed == 5 and prompt.tokens == () and not prompt.terminated
    assert last.tokens == (5, 6) and not last.terminated
    assert program.calls[0]["k_cache"] is state["k_cache"]  # state is passed, not copied
    assert result.timing.device_ns > 0 and result.timing.wall_ns > 0


def test_a_finishing_prompt_row_publishes_its_first_token():
    lanes = [prompt_lane(1, 0, 40)]
    graph = GraphDescriptor("prefill_p64", GraphKind.PREFILL, batch_capacity=1, prefill_capacity=64)
    executor = Executor({}, lambda graph_id: FakeProgram([[42]], [1]), frozenset())
    record, = executor.run(bind(plan_of(graph, lanes), contexts(lanes), page_table()), 0).records
    assert record.prompt_consumed == 40 and record.tokens == (42,)


def test_a_plan_that_overflows_the_packed_capacity_is_refused():
    lanes = [prompt_lane(0, 0, 40)]
    graph = GraphDescriptor("prefill_p32", GraphKind.PREFILL, batch_capacity=1, prefill_capacity=32)
    with pytest.raises(ValueError, match="packed tokens exceed"):
        bind(plan_of(graph, lanes), contexts(lanes), page_table())


# ---------------------------------------------------------------------------
# Program contract version 2: proposals, verified lengths, sidecars (S1, S2, C12, C13, A2)
# ---------------------------------------------------------------------------

LEARNED = GraphDescriptor("spec_b2_d3_w4_p8", GraphKind.SPECULATIVE, batch_capacity=2, proposal_depth=3, width=4,
                          aggregate=8, value_source=ValueSource.QUERY_LENGTH, proposal_source="learned")
COPY = GraphDescriptor("spec_b2_d3_w4_p8_copy", GraphKind.SPECULATIVE, batch_capacity=2, proposal_depth=3, width=4,
                       aggregate=8, value_source=ValueSource.QUERY_LENGTH, proposal_source="copy")
SLOTS = 4


class V2Program(FakeProgram):
    """A fake v2 program: fixed outputs plus whichever sidecars it is given."""

    def __init__(self, tokens, counts, verified, **sidecars):
        super().__init__(tokens, counts)
        self.extra = {"verified_lens": torch.tensor(verified, dtype=torch.int32),
                      **{k: torch.tensor(v, dtype=torch.float32) for k, v in sidecars.items()}}

    def __call__(self, **named):
        return {**super().__call__(**named), **self.extra}


def run_v2(graph, lanes, program, drafts=(7, 8, 9)):
    frame = bind(plan_of(graph, lanes), contexts(lanes, drafts), page_table())
    return Executor({}, lambda graph_id: program, frozenset({99})).run(frame, 0).records, program.calls[0]


def confidence_sidecar(rows_by_slot):
    """[2, S, D]: per-position probabilities and their cumulative products, zero for absent slots."""
    plane = torch.zeros(SLOTS, 3)
    for slot, row in rows_by_slot.items():
        plane[slot] = torch.tensor(row)
    return torch.stack([plane, plane.cumprod(dim=1)]).tolist()


def test_S4_learned_programs_take_no_host_drafts_and_offer_what_they_verified():
    lanes = [decode_lane(1, 4), decode_lane(3, 2)]
    program = V2Program([[5, 6, 7, 0], [8, 0, 0, 0]], [3, 1], [4, 2], survival=[[0.9, 0.5, 0.0], [0.2, 0.0, 0.0]])
    records, inputs = run_v2(LEARNED, lanes, program)
    assert "draft_tokens" not in inputs and inputs["query_lens"].tolist() == [4, 2]
    assert [r.offered for r in records] == [3, 1]
    assert [r.tokens for r in records] == [(5, 6, 7), (8,)]
    assert records[0].survival == pytest.approx((0.9, 0.5, 0.0)) and records[1].survival == pytest.approx((0.2,))


def test_S4_copy_programs_take_the_host_prompt_lookup_drafts_after_the_pending_token():
    lanes = [decode_lane(0, 3), decode_lane(2, 1)]
    program = V2Program([[5, 6, 0, 0], [8, 0, 0, 0]], [2, 1], [3, 1])
    records, inputs = run_v2(COPY, lanes, program, drafts=(41, 42, 43))
    assert inputs["draft_tokens"].tolist() == [[41, 42, 0], [0, 0, 0]]  # D bounds the supplied prefix
    assert [r.offered for r in records] == [2, 0] and records[0].survival is None


def test_C12_S2_prefix_limit_records_carry_their_slots_joint_prefix_probabilities():
    lanes = [decode_lane(2, ceiling=4), decode_lane(0, ceiling=2)]
    conf = confidence_sidecar({2: [0.8, 0.5, 0.5], 0: [0.6, 0.9, 0.9]})
    program = V2Program([[5, 6, 0, 0], [7, 8, 0, 0], [0] * 4, [0] * 4], [2, 2, 0, 0], [3, 2, 0, 0], confidence=conf)
    records, _ = run_v2(PREFIX, lanes, program)
    assert [r.offered for r in records] == [2, 1]  # the device allocation, not the ceilings
    assert records[0].confidence == pytest.approx((0.8, 0.4, 0.2))
    assert records[1].confidence == pytest.approx((0.6, 0.54, 0.486))


def _pl_program(verified=(3, 2, 0, 0), counts=(1, 1, 0, 0), confidence=None, **sidecars):
    conf = confidence_sidecar({2: [0.8, 0.5, 0.5], 0: [0.6, 0.9, 0.9]}) if confidence is None else confidence
    return V2Program([[5, 0, 0, 0], [7, 0, 0, 0], [0] * 4, [0] * 4], list(counts), list(verified),
                     confidence=conf, **sidecars)


@pytest.mark.parametrize("program, match", [
    (_pl_program(verified=(3, 3, 0, 0)), "verified 3 rows, outside 1..its ceiling 2"),
    (_pl_program(verified=(0, 2, 0, 0)), "verified 0 rows, outside 1..its ceiling 4"),
    (_pl_program(counts=(4, 1, 0, 0)), "num_tokens 4 outside 1..3"),
    (_pl_program(confidence=[[[0.5] * 3] * SLOTS]), "confidence has shape \\(1, 4, 3\\), expected \\(2, 4, 3\\)"),
    (_pl_program(confidence=[[[0.5] * 3] * SLOTS, [[1.5] * 3] * SLOTS]), "confidence holds 1.5, not a probability"),
    (_pl_program(survival=[[0.5, float("nan"), 0.0]] * 4), "survival holds nan, not a probability"),
    (_pl_program(survival=[[0.5, 0.5]] * 4), "survival has shape \\(4, 2\\), expected \\(4, 3\\)"),
])
def test_A2_malformed_outputs_fail_the_frame_before_any_record_exists(program, match):
    from helios.runtime.frame_outputs import FrameOutputError

    lanes = [decode_lane(2, ceiling=4), decode_lane(0, ceiling=2)]
    with pytest.raises(FrameOutputError, match=match):
        run_v2(PREFIX, lanes, program)


def test_A2_S2_device_allocation_beyond_P_fails_the_frame():
    from helios.runtime.frame_outputs import FrameOutputError

    lanes = [decode_lane(s, ceiling=4) for s in range(3)]
    program = _pl_program(verified=(4, 4, 1, 0), counts=(1, 1, 1, 0))
    with pytest.raises(FrameOutputError, match="9 target rows, more than P = 8"):
        run_v2(PREFIX, lanes, program)


def test_A2_a_program_declaring_confidence_must_return_it():
    from helios.runtime.frame_outputs import FrameOutputError

    lanes = [decode_lane(2, ceiling=4)]
    program = V2Program([[5, 0, 0, 0]] + [[0] * 4] * 3, [1, 0, 0, 0], [1, 0, 0, 0])
    with pytest.raises(FrameOutputError, match="confidence_width 3 but returned no 'confidence'"):
        run_v2(PREFIX, lanes, program)


def test_S1_a_host_allocated_row_must_verify_exactly_what_the_host_bound():
    from helios.runtime.frame_outputs import FrameOutputError

    lanes = [decode_lane(1, 3)]
    program = V2Program([[5, 0, 0, 0], [0] * 4], [1, 0], [4, 0])
    with pytest.raises(FrameOutputError, match="verified 4 rows but the host bound 3"):
        run_v2(LEARNED, lanes, program)
