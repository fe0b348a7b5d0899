"""State operations through the production Scheduler: restore gating (P3), terminal snapshots (P6),
extra snapshot cuts (K2) and the snapshot-cost sweep (V4), on a simulated clock."""

from __future__ import annotations

import math
import random

import pytest
from exhaustive import EXAMPLES
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_harness import MS, decode, measured, mixed, prefill

from helios.scheduler import (
    AdmitRequest,
    CompletionRecord,
    ExecutionTiming,
    GraphDescriptor,
    GraphKind,
    LanePhase,
    PolicyConfig,
)
from helios.scheduler.prerequisites import PairShape, Ready, Waiting, best_pair, sequence_rate
from helios.scheduler.service import MIN_RATE_PER_MS
from helios.scheduler.utility import prompt_chunk_value

RESTORE = GraphDescriptor("restore_b1", GraphKind.RESTORE, 1)
SNAPSHOT = GraphDescriptor("snapshot_b1", GraphKind.SNAPSHOT, 1)


class Clock:
    """Runs each plan for its graph's synthetic duration and reports every lane as done."""

    def __init__(self, scheduler, durations_ms):
        self.s, self.ms, self.fence, self.plans = scheduler, {g.id: v for g, v in durations_ms.items()}, 0, []

    def step(self):
        plan = self.s.plan()
        if plan is None:
            return None
        self.fence += 1
        self.s.commit(plan, self.fence)
        self.plans.append(plan)
        ns = int(self.ms[plan.graph.id] * MS)
        self.s.advance_to(self.s.now_ns + ns)
        records = [self._record(lane) for lane in plan.lanes]
        self.s.complete(self.fence, records, ExecutionTiming(ns, ns))
        return plan

    @staticmethod
    def _record(lane):
        if lane.phase is LanePhase.PROMPT:
            return CompletionRecord(lane.handle, prompt_consumed=lane.prompt_tokens,
                                    tokens=(7,) if lane.finishes_prompt else ())
        if lane.phase is LanePhase.DECODE:
            return CompletionRecord(lane.handle, tokens=(7,))
        return CompletionRecord(lane.handle)

    def run(self, limit=200):
        while limit and self.step() is not None:
            limit -= 1
        return self.plans


def kinds(plans):
    return [p.graph.kind for p in plans]


def catalog(**extra):
    durations = {prefill(256): 4.0, prefill(256, 2): 4.5, decode(1): 1.0, decode(2): 1.2, RESTORE: 0.5,
                 SNAPSHOT: 0.5}
    durations.update(extra)
    return durations


def decoder_beside_held(policy):
    """One streaming decoder and one request holding its slot for the terminal capture, after one prefill."""
    durations = catalog()
    s = measured(durations, slots=2, policy=policy)
    s.admit(AdmitRequest(10, 5, 100))
    held = s.admit(AdmitRequest(10, 1, 100, terminal_snapshot=True))
    clock = Clock(s, durations)
    first = clock.step()
    assert first.graph.batch_capacity == 2 and s.holds(held)
    return s, clock, held


def test_P3_restore_runs_first_with_its_own_duration_and_earns_nothing():
    durations = catalog()
    s = measured(durations)
    h = s.admit(AdmitRequest(300, 2, 1000, cached_tokens=200, restore_row=3))
    clock = Clock(s, durations)
    first = clock.step()
    assert first.graph is RESTORE and [l.phase for l in first.lanes] == [LanePhase.RESTORE]
    lane = first.lanes[0]
    assert (lane.checkpoint_row, lane.checkpoint_tokens) == (3, 200)
    assert first.estimated_duration_ns == int(0.5 * MS)  # T alone: the following prefill's F is in no field
    view = s.request_view(h)
    assert view.prompt_done == 200 and view.produced == 0  # setup earned no token
    assert s.duration_estimates()[RESTORE.id] == int(0.5 * MS)
    second = clock.step()
    assert second.graph.kind is GraphKind.PREFILL and second.lanes[0].prompt_start == 200
    assert second.lanes[0].prompt_tokens == 100


def test_P3_a_restoring_request_is_not_prompt_ready():
    durations = catalog()
    s = measured(durations)
    h = s.admit(AdmitRequest(300, 2, 1000, cached_tokens=200, restore_row=0))
    _, population = s.selection_inputs()
    assert h not in population.prompters.handle
    with pytest.raises(ValueError, match="restore"):
        s.admit(AdmitRequest(300, 2, 1000, cached_tokens=0, restore_row=0))


def test_P6_finished_request_holds_its_slot_until_its_terminal_snapshot():
    durations = catalog()
    s = measured(durations, slots=1)
    h = s.admit(AdmitRequest(10, 1, 100, terminal_snapshot=True))
    clock = Clock(s, durations)
    clock.step()  # the prompt finishes and publishes its only token: generation ends
    assert s.holds(h) and not s.is_active(h)
    with pytest.raises(ValueError, match="no free request slot"):
        s.admit(AdmitRequest(10, 1, 100))
    snap = clock.step()
    assert snap.graph is SNAPSHOT and snap.lanes[0].checkpoint_tokens == 10  # prompt + 1 output - the pending one
    assert not s.holds(h)
    s.admit(AdmitRequest(10, 1, 100))  # the slot is free again


def test_P6_terminal_value_and_age_price_as_the_spec_writes_them():
    """Score of a lone terminal capture: (terminal_value + price*sigma*(A+T))/T - T/2 * price (its own wait)."""
    durations = catalog()
    policy = PolicyConfig(terminal_value=100.0, terminal_age_price=0.5)
    s = measured(durations, slots=2, policy=policy)
    s.admit(AdmitRequest(10, 1, 100, terminal_snapshot=True))
    Clock(s, durations).step()
    s.advance_to(s.now_ns + 3 * MS)  # A = 3 ms
    plan = s.plan()
    t, sigma, age = 0.5, 0.5, 3.0  # one held row: sigma = K*T/min(B, K) = 0.5
    expected = (100.0 + 0.5 * sigma * (age + t)) / t - 0.5 * t * 0.5
    assert plan.graph is SNAPSHOT
    assert plan.scaled_value_rate / math.exp(plan.log_scale) == pytest.approx(expected, rel=1e-12)


def test_P6_held_terminal_coefficient_enters_every_candidates_waiting_cost():
    durations = catalog()
    s = measured(durations, slots=2, policy=PolicyConfig(terminal_age_price=2.0))
    s.admit(AdmitRequest(10, 1, 100, terminal_snapshot=True))
    _, before = s.selection_inputs()
    Clock(s, durations).step()
    _, after = s.selection_inputs()
    assert after.active_age_price - before.active_age_price == pytest.approx(2.0)


def test_P6_terminal_capture_has_no_priority_override():
    """With no terminal preference the capture waits behind a decoder worth more (it still runs when idle)."""
    s, clock, held = decoder_beside_held(PolicyConfig(terminal_value=0.0, terminal_age_price=0.0))
    order = kinds(clock.run())[1:]  # after the shared prefill
    assert order[:4] == [GraphKind.DECODE] * 4 and order[-1] is GraphKind.SNAPSHOT
    assert not s.holds(held)


def test_P6_policy_flags_drive_the_terminal_capture():
    """The same state, two terminal preferences (PolicyConfig.preset, as --scheduler-terminal-value /
    --scheduler-terminal-age-price build it): a high terminal value takes the device first."""
    _, clock, _ = decoder_beside_held(PolicyConfig.preset(terminal_value=0.0, terminal_age_price=0.0))
    assert clock.step().graph.kind is GraphKind.DECODE
    _, clock, _ = decoder_beside_held(PolicyConfig.preset(terminal_value=1e4))
    assert clock.step().graph.kind is GraphKind.SNAPSHOT
    _, clock, _ = decoder_beside_held(PolicyConfig.preset(terminal_value=0.0, terminal_age_price=1e4))
    assert clock.step().graph.kind is GraphKind.SNAPSHOT


def test_K2_an_armed_point_cuts_prefill_and_the_snapshot_precedes_the_rest():
    """A copy of 0.2 ms fits 5% of the 8 ms prefill; the cut falls on a message end (no extra split)."""
    durations = catalog(**{})
    durations[SNAPSHOT] = 0.2
    s = measured(durations)
    s.admit(AdmitRequest(400, 2, 1000, snapshot_points=(128,), endpoints=(128,)))
    plans = Clock(s, durations).run()
    first, snap, rest = plans[0], plans[1], plans[2]
    assert first.graph.kind is GraphKind.PREFILL and first.lanes[0].prompt_tokens == 128
    assert not first.lanes[0].finishes_prompt  # a cut before the prompt's end publishes nothing
    assert snap.graph is SNAPSHOT and snap.lanes[0].checkpoint_tokens == 128
    assert rest.lanes[0].prompt_start == 128


def test_K2_extras_fit_the_allowance_and_unknown_costs_disable_them():
    durations = catalog()
    # a 0.5 ms copy does not fit 5% of the 8 ms prefill
    s = measured(durations)
    s.admit(AdmitRequest(400, 2, 1000, snapshot_points=(128,), endpoints=(128,)))
    assert GraphKind.SNAPSHOT not in kinds(Clock(s, durations).run())
    durations[SNAPSHOT] = 0.2
    # a zero fraction admits no extra copy
    s = measured(durations, policy=PolicyConfig(checkpoint_extra_work_fraction=0.0))
    s.admit(AdmitRequest(400, 2, 1000, snapshot_points=(128,), endpoints=(128,)))
    assert GraphKind.SNAPSHOT not in kinds(Clock(s, durations).run())
    # an unmeasured snapshot program: the copy's cost is unknown, so no extra cut
    s = measured(durations, cold=(SNAPSHOT,))
    s.admit(AdmitRequest(400, 2, 1000, snapshot_points=(128,), endpoints=(128,)))
    first = s.plan()
    assert first.graph.kind is GraphKind.PREFILL and first.lanes[0].prompt_tokens > 128


def test_P1_restore_cost_sweep_enables_a_shared_mixed_batch_only_with_enough_value_per_time():
    """Two decoders stream; a third request waits for its restore, which enables a shared mixed batch.

    Across restore costs the scheduler takes the restore first exactly when the two-stage sequence
    (restore, then the mixed graph carrying the new prompt beside both decoders) has a higher value
    rate than the best ordinary program, computed here from the decision's own inputs.
    """
    outcomes = []
    for cost in (0.05, 0.2, 0.5, 1, 2, 4, 8, 16, 32, 64):
        mix = mixed(4, 256)
        durations = {decode(2): 1.0, mix: 3.0, prefill(256): 2.5, RESTORE: cost, SNAPSHOT: 0.5}
        s = measured(durations, slots=4)
        clock = Clock(s, durations)
        for _ in range(2):
            s.admit(AdmitRequest(8, 400, 1000))
        while len(s.selection_inputs()[1].decoders) < 2:
            clock.step()
        s.admit(AdmitRequest(220, 8, 1000, cached_tokens=200, restore_row=1))
        timings, population = s.selection_inputs()
        ordinary = s.selector.select(timings, population)
        d = population.decoders
        ready = [Ready(tp + dp + credit, slope)
                 for tp, dp, credit, slope in zip(d.token_price, d.delivery_price, d.age_credit, d.age_slope)]
        state = s._slots[2]
        x = state.service.token_rate
        newly = prompt_chunk_value(20, 20, 1.0 + 16.0 / x, 64.0 + 16.0 / x, None)
        pair = PairShape(cost, 1, 3.0, 3)
        sequence = sequence_rate(newly + sum(r.value + r.slope * (cost + 3.0) for r in ready), pair,
                                 Waiting(population.active_age_price), 0.0)
        restore_first = s.plan().graph is RESTORE
        assert restore_first == (sequence > ordinary.score), cost
        outcomes.append(restore_first)
    assert outcomes[0] and not outcomes[-1]
    assert outcomes == sorted(outcomes, reverse=True)  # one threshold: cheaper restores win


def test_U8_an_unmeasured_restore_is_discovered_like_any_graph():
    durations = catalog()
    s = measured(durations, cold=(RESTORE,))
    s.admit(AdmitRequest(300, 2, 1000, cached_tokens=200, restore_row=0))
    plan = s.plan()
    assert plan.graph is RESTORE and plan.reason.value == "discovery" and plan.estimated_duration_ns == 0


def test_state_lanes_are_checked_at_commit_and_completion():
    durations = catalog()
    s = measured(durations)
    h = s.admit(AdmitRequest(300, 2, 1000, cached_tokens=200, restore_row=0))
    plan = s.plan()
    s.commit(plan, 1)
    with pytest.raises(ValueError, match="consumes no prompt and commits no token"):
        s.complete(1, [CompletionRecord(h, tokens=(3,))], ExecutionTiming(MS, MS))
    with pytest.raises(ValueError):
        s.commit(plan, 2)  # stale: the restore is already in flight (and the window is full of feedback)
    s.complete(1, [CompletionRecord(h)], ExecutionTiming(MS, MS))
    s.advance_to(MS)
    with pytest.raises(ValueError, match="stale plan"):
        s.commit(plan, 2)  # the request no longer waits for a restore


def test_P6_cancelling_a_held_request_gives_the_capture_up():
    durations = catalog()
    s = measured(durations, slots=1)
    h = s.admit(AdmitRequest(10, 1, 100, terminal_snapshot=True))
    Clock(s, durations).step()
    assert s.holds(h)
    s.cancel(h)
    assert not s.holds(h) and s.plan() is None
    s.admit(AdmitRequest(10, 1, 100))


def test_V4_snapshot_cost_sweep_enables_the_shared_decode_batch_only_with_enough_value_per_time():
    """V4. Two decoders stream; a third request's prompt ended at an armed snapshot point, so it may
    decode only after its snapshot. Either the two decode now (C waits), or the snapshot runs and a
    shared batch of four rows then decodes all three. Across snapshot costs the scheduler takes the
    snapshot first exactly when that whole sequence (snapshot T, then the shared batch F, ages to T+F)
    has a higher value rate than the best ordinary program; cheap snapshots win, dear ones wait.
    """
    outcomes = []
    policy = PolicyConfig(checkpoint_extra_work_fraction=1.0)  # arm the point at every cost of the sweep
    for cost in (0.05, 0.2, 0.5, 1, 2, 4, 8, 16, 25):
        durations = {decode(2): 1.0, decode(4): 1.3, prefill(256): 30.0, SNAPSHOT: cost, RESTORE: 0.5}
        s = measured(durations, slots=4, policy=policy)
        clock = Clock(s, durations)
        for _ in range(2):
            s.admit(AdmitRequest(8, 400, 1000))
        while len(s.selection_inputs()[1].decoders) < 2:
            clock.step()
        c = s.admit(AdmitRequest(200, 400, 1000, snapshot_points=(200,)))
        while s.request_view(c).prompt_done < 200:
            clock.step()
        timings, population = s.selection_inputs()
        assert c not in population.decoders.handle  # waits for its snapshot
        ordinary = s.selector.select(timings, population)
        d = population.decoders
        ready = [Ready(tp + dp + credit, slope)
                 for tp, dp, credit, slope in zip(d.token_price, d.delivery_price, d.age_credit, d.age_slope)]
        state = s._slots[c.slot]
        x, z = s._queue.projected_token_rate(state), state.service.delivery_rate
        newly = 64.0 + 16.0 / x + (4.0 / max(z, MIN_RATE_PER_MS) if z is not None else 0.0)
        # the shared batch of four (all three decode), or a batch of two (C and the better stream)
        sequence = max(best_pair(PairShape(cost, 1, f_ms, rows), [newly], ready, [],
                                 Waiting(population.active_age_price)).score
                       for f_ms, rows in ((1.3, 4), (1.0, 2)))
        plan = s.plan()
        snapshot_first = plan.graph is SNAPSHOT
        assert snapshot_first == (sequence > ordinary.score), cost
        if snapshot_first:
            assert plan.lanes[0].checkpoint_tokens == 200 and plan.estimated_duration_ns == int(cost * MS)
        outcomes.append(snapshot_first)
    assert outcomes[0] and not outcomes[-1]
    assert outcomes == sorted(outcomes, reverse=True)  # one threshold: cheaper snapshots win


def test_K2_a_prompt_end_snapshot_is_planned_while_no_decode_program_is_measured():
    """A request whose armed point is its prompt's end waits, as a decoder, for that snapshot. The
    lookahead pairs a decoder only with decode-capable shapes; when the only measured following
    shapes are prefills (say an earlier request ended at its first token, so prefill and snapshot
    ran but decode never did), the snapshot must still be planned, with the unmeasured decode
    shapes compared optimistically (U8). It was not: no state choice, no ordinary one, and the
    request stalled for good."""
    durations = catalog()
    durations[SNAPSHOT] = 0.2
    s = measured(durations, cold=(decode(1), decode(2)))
    handle = s.admit(AdmitRequest(400, 3, 1000, snapshot_points=(400,)))
    plans = Clock(s, durations).run()
    assert kinds(plans)[:3] == [GraphKind.PREFILL, GraphKind.PREFILL, GraphKind.SNAPSHOT]
    assert kinds(plans).count(GraphKind.DECODE) == 2  # the prompt's end gave the first of 3 tokens
    assert not s.is_active(handle) and s.requests() == ()


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_P1_P2_P4_a_state_decision_reads_each_shapes_rows_once_and_decides_as_each_program_alone(seed):
    """``best_state_choice`` builds each following shape's rows once for every state program
    (``_ShapeRows``) and the lanes of the winning pair only; it must pick what building every option of
    every state program on its own and taking the first best picks, lanes and score exactly (P1/P2
    pairs, P4 chains, P6 terminal rows), on random catalogs, timings and rows."""
    from helios.scheduler.select.population import Decoders, Population, Prompters
    from helios.scheduler.select.timing import GraphTiming
    from helios.scheduler.state_ops import (Enabled, Held, StateChoice, StateInputs, _chain, _following_shapes,
                                            _pair, _pair_choice, _terminal_only, _terminal_sigma,
                                            _terminal_values, best_state_choice)
    from helios.scheduler.types import RequestHandle
    from helios.scheduler.utility import PrefillTimes

    rng = random.Random(seed)
    graphs = [GraphDescriptor(f"snapshot_b{b}", GraphKind.SNAPSHOT, b) for b in (1, 2, 4)]
    graphs += [GraphDescriptor(f"restore_b{b}", GraphKind.RESTORE, b) for b in (1, 2)]
    graphs += [prefill(64), prefill(256), prefill(256, 2), decode(1), decode(2), decode(4), mixed(2, 64),
               mixed(4, 64)]
    timings = [GraphTiming(0 if rng.random() < 0.15 else int(rng.uniform(0.3, 9.0) * MS), True) for _ in graphs]
    # twins: a second program of the same shape and duration (ties between pairs: the first must stand)
    for twin, of in ((GraphDescriptor("decode_b2_twin", GraphKind.DECODE, 2), 9),
                     (GraphDescriptor("snapshot_b2_twin", GraphKind.SNAPSHOT, 2), 1)):
        graphs.append(twin)
        timings.append(timings[of])
    slot = iter(range(64))

    def enabled(n):
        return [Enabled(RequestHandle(next(slot), 1), 0, rng.randint(1, 600), rng.uniform(1, 3), rng.uniform(0, 2),
                        rng.randint(1, 600), rng.randint(-1, 3), rng.randint(0, 5),
                        rng.uniform(0.5, 4) if rng.random() < 0.4 else None) for _ in range(n)]

    dec, prm = Decoders(), Prompters(times=PrefillTimes.of([(64, 1.5), (256, 4.0)]) if rng.random() < 0.7 else None)
    for _ in range(rng.randint(0, 4)):
        dec.handle.append(RequestHandle(next(slot), 1))
        dec.token_price.append(rng.uniform(0.5, 3))
        dec.delivery_price.append(rng.uniform(0, 1))
        dec.age_credit.append(rng.uniform(0, 2))
        dec.age_slope.append(rng.uniform(0, 0.3))
        dec.room.append(rng.choice([0, 1, 20]))
        dec.survival.append({})
        dec.recency.append(rng.randint(0, 5))
    for _ in range(rng.randint(0, 3)):
        prm.handle.append(RequestHandle(next(slot), 1))
        left = rng.randint(1, 700)
        prm.start.append(0)
        prm.remaining.append(left)
        prm.to_endpoint.append(left)
        prm.price.append(rng.uniform(1, 3))
        prm.first_token.append(rng.uniform(0, 2))
        prm.recency.append(rng.randint(0, 5))
    held = [Held(RequestHandle(next(slot), 1), rng.uniform(0, 20), rng.randint(1, 500), rng.randint(0, 5))
            for _ in range(rng.choice([0, 0, 1, 2]))]
    inputs = StateInputs(enabled(rng.randint(0, 3)), enabled(rng.randint(0, 3)), held,
                         Population(dec, prm, rng.uniform(0, 1)), rng.uniform(0, 1), rng.uniform(0, 3),
                         rng.uniform(0, 0.2), prm.times)
    following, sigma = _following_shapes(graphs, timings), _terminal_sigma(graphs, timings, len(held))

    def every_option(graph, timing, enabled, holding):
        terminals = _terminal_values(holding, inputs, timing.duration_ns / 1e6, sigma)
        options = [_terminal_only(graph, timing, terminals, inputs)] if terminals else []
        for shape in following:  # each pair's rows read afresh, its lanes built
            pair = _pair(graph, timing, enabled, terminals, inputs, shape)
            options.append(None if pair is None else _pair_choice(*pair[1]))
        options.append(_chain(graph, timing, enabled, terminals, inputs))
        return max([o for o in options if o is not None], key=StateChoice.key, default=None)

    alone = None
    for graph, timing in zip(graphs, timings):
        if graph.kind is GraphKind.RESTORE and inputs.restores:
            found = every_option(graph, timing, inputs.restores, ())
        elif graph.kind is GraphKind.SNAPSHOT and (inputs.snapshots or inputs.held):
            found = every_option(graph, timing, inputs.snapshots, inputs.held)
        else:
            continue
        if found is not None and (alone is None or found.key() > alone.key()):
            alone = found
    assert best_state_choice(graphs, timings, inputs) == alone
