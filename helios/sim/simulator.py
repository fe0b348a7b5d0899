"""The production scheduler on a discrete-event clock (``flare simulate``).

The simulator drives the real ``helios.scheduler.Scheduler`` exactly as the
runtime engine does (admit, advance_to, plan, commit, complete,
published_output), but the device is synthetic: each committed frame runs, in
commit order, for its graph's catalog duration (plus seeded jitter), and the
clock jumps from event to event (an arrival or a frame completion). Every
published burst and every committed plan is recorded, so scheduling properties
such as time to first output, output gaps and fairness can be checked exactly
and reproducibly.

The life of one simulated run:
1. build the Scheduler from the synthetic catalog and the trace's policy;
2. unless ``cold``, feed one duration observation per graph at time zero (a
   "measured" catalog: estimates start unknown and become known through the
   normal cost path, which also starts their staleness clocks);
3. repeat: admit arrivals that have a free slot, plan/commit until the
   scheduler declines, jump to the next event, complete the frame that ends
   there and publish its visible bursts at that time.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Sequence

from flare_contract.graphs import GraphDescriptor, GraphKind
from helios.scheduler import Scheduler
from helios.scheduler.checkpoints import AnchorRole, Checkpoint, CheckpointIndex, RowUse
from helios.scheduler.core import skips_draft_absorption
from helios.scheduler.types import (
    AdmitRequest,
    CompletionRecord,
    ExecutionTiming,
    GeneratedToken,
    LanePhase,
    PlannedLane,
    PlanTrace,
    RequestHandle,
    ScheduledPlan,
)
from helios.sim.files import (
    AcceptanceModel,
    FixedAcceptance,
    SimulationFileError,
    SyntheticCatalog,
    Trace,
    TraceRequest,
)

NS_PER_MS = 1_000_000
MAX_QUEUED_FRAMES = 16  # far above the two frame slots: only a broken scheduler reaches it


class SimulationError(RuntimeError):
    """The scheduler broke the contract the simulator relies on."""


@dataclass(frozen=True, slots=True)
class SimulationOptions:
    cold: bool = False  # feed no duration observation at time zero
    until_ns: int | None = None  # stop the clock here (None: run until every request finishes)


# ---------------------------------------------------------------------------
# What a run produces
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Burst:
    """One visible publication: when, and how many tokens it carried."""

    time_ns: int
    tokens: int


@dataclass(slots=True)
class RequestOutcome:
    id: str
    arrival_ns: int
    admitted_ns: int | None = None
    finished_ns: int | None = None
    bursts: list[Burst] = field(default_factory=list)
    prompt_tokens: int = 0  # the whole prompt (a follow-up turn's includes the conversation so far)
    cached_tokens: int = 0  # restored from a checkpoint instead of prefilled

    @property
    def tokens(self) -> int:
        return sum(burst.tokens for burst in self.bursts)

    def first_output_ms(self) -> float | None:
        """Time from arrival to the first visible output."""
        return (self.bursts[0].time_ns - self.arrival_ns) / NS_PER_MS if self.bursts else None

    def gaps_ms(self) -> list[float]:
        """Intervals between consecutive visible bursts."""
        times = [burst.time_ns for burst in self.bursts]
        return [(later - earlier) / NS_PER_MS for earlier, later in zip(times, times[1:])]

    def tokens_by(self, time_ns: int) -> int:
        """Tokens published at or before ``time_ns``."""
        return sum(burst.tokens for burst in self.bursts if burst.time_ns <= time_ns)


@dataclass(frozen=True, slots=True)
class PlanRecord:
    """One committed plan as it ran on the synthetic device."""

    fence: int
    start_ns: int
    end_ns: int
    graph: GraphDescriptor
    cohort: tuple[str, ...]
    reason: str
    estimated_ns: int
    actual_ns: int
    lane_widths: tuple[int, ...] = ()  # per cohort member: target rows its lane may use (ceiling or query length)
    trace: PlanTrace | None = None  # A12, as the scheduler planned it


@dataclass(frozen=True, slots=True)
class SimulationResult:
    requests: tuple[RequestOutcome, ...]
    plans: tuple[PlanRecord, ...]
    end_ns: int
    stalled: bool  # work was left but the scheduler planned nothing and nothing was pending
    cold: bool

    def request(self, request_id: str) -> RequestOutcome:
        return next(outcome for outcome in self.requests if outcome.id == request_id)

    def summary(self) -> dict[str, Any]:
        first = [o.first_output_ms() for o in self.requests if o.bursts]
        gaps = [gap for o in self.requests for gap in o.gaps_ms()]
        return {
            "end_ms": self.end_ns / NS_PER_MS,
            "catalog": "cold" if self.cold else "measured",
            "requests": len(self.requests),
            "finished": sum(o.finished_ns is not None for o in self.requests),
            "stalled": self.stalled,
            "output_tokens": sum(o.tokens for o in self.requests),
            "bursts": sum(len(o.bursts) for o in self.requests),
            "max_first_output_ms": max(first, default=None),
            "max_gap_ms": max(gaps, default=None),
            "plans": len(self.plans),
            "plans_by_kind": dict(Counter(p.graph.kind.value for p in self.plans)),
            "plans_by_reason": dict(Counter(p.reason for p in self.plans)),
            "device_busy_ms": sum(p.actual_ns for p in self.plans) / NS_PER_MS,
            "device_ms_by_reason": self.device_ms_by_reason(),
        }

    def device_ms_by_reason(self) -> dict[str, float]:
        """Device time of the committed plans per selection reason (D9 as the simulator saw it)."""
        totals: Counter[str] = Counter()
        for plan in self.plans:
            totals[plan.reason] += plan.actual_ns
        return {reason: ns / NS_PER_MS for reason, ns in totals.items()}

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document (docs/simulation.md describes every field)."""
        return {
            "requests": {o.id: _request_json(o) for o in self.requests},
            "plans": [_plan_json(p) for p in self.plans],
            "summary": self.summary(),
        }


def _request_json(outcome: RequestOutcome) -> dict[str, Any]:
    return {
        "arrival_ms": outcome.arrival_ns / NS_PER_MS,
        "admitted_ms": _ms_or_none(outcome.admitted_ns),
        "bursts": [[burst.time_ns / NS_PER_MS, burst.tokens] for burst in outcome.bursts],
        "finished_ms": _ms_or_none(outcome.finished_ns),
    }


def _plan_json(plan: PlanRecord) -> dict[str, Any]:
    graph = plan.graph
    return {
        "fence": plan.fence,
        "start_ms": plan.start_ns / NS_PER_MS,
        "end_ms": plan.end_ns / NS_PER_MS,
        "graph": graph.id,
        "kind": graph.kind.value,
        "batch_capacity": graph.batch_capacity,
        "proposal_depth": graph.proposal_depth,
        "width": graph.width,
        "aggregate": graph.target_rows,
        "prefill_capacity": graph.prefill_capacity,
        "cohort": list(plan.cohort),
        "lane_widths": list(plan.lane_widths),
        "reason": plan.reason,
        "estimated_ms": plan.estimated_ns / NS_PER_MS,
        "actual_ms": plan.actual_ns / NS_PER_MS,
        **_trace_json(plan.trace),
    }


def _trace_json(trace: PlanTrace | None) -> dict[str, Any]:
    """A12 fields: the selected cost, how old its last observation was, and both credits."""
    if trace is None:
        return {}
    return {
        "selected_cost_ms": trace.selected_cost_ns / NS_PER_MS,
        "observation_age_ms": _ms_or_none(trace.observation_age_ns),
        "exploration_credit_ms": {
            "timing_refresh": trace.timing_refresh_credit_ns / NS_PER_MS,
            "acceptance_learning": trace.acceptance_learning_credit_ns / NS_PER_MS,
        },
    }


def _ms_or_none(ns: int | None) -> float | None:
    return None if ns is None else ns / NS_PER_MS


# ---------------------------------------------------------------------------
# The synthetic device: how long a frame takes and what each lane produced
# ---------------------------------------------------------------------------


def accepted_drafts(model: AcceptanceModel, offered: int, rng: random.Random) -> int:
    """Length of the accepted draft prefix in one round that verified ``offered`` drafts."""
    if isinstance(model, FixedAcceptance):
        return min(model.accepted_drafts, offered)
    draw = rng.random()
    # survival is nonincreasing, so the positions it keeps form a prefix
    return sum(1 for survival in model.survival[:offered] if survival > draw)


def prefix_confidence(model: AcceptanceModel, depth: int) -> tuple[float, ...]:
    """The device's joint prefix probability for draft prefixes 1..depth."""
    if isinstance(model, FixedAcceptance):
        return tuple(1.0 if d <= model.accepted_drafts else 0.0 for d in range(1, depth + 1))
    padded = model.survival + (0.0,) * depth
    return padded[:depth]


def allocate_prefixes(ceilings: Sequence[int], confidence: Sequence[Sequence[float]], slots: Sequence[int], rows: int) -> list[int]:
    """The device rule for prefix-limit rounds (spec S2): per-lane lengths within P rows.

    Every lane keeps its pending token. Remaining rows go one at a time to the
    best immediate causal frontier: the lane whose next draft prefix has the
    highest joint prefix probability, ties to the shorter prefix, then to the
    lower original request slot. A lane never grows past its ceiling.
    """
    lengths = [1] * len(ceilings)
    frontier = [(-confidence[i][0], 1, slots[i], i) for i in range(len(ceilings)) if ceilings[i] > 1]
    heapq.heapify(frontier)
    spare = rows - len(ceilings)
    while spare > 0 and frontier:
        _, _, _, lane = heapq.heappop(frontier)
        lengths[lane] += 1
        spare -= 1
        if lengths[lane] < ceilings[lane]:
            next_prob = confidence[lane][lengths[lane] - 1]
            heapq.heappush(frontier, (-next_prob, lengths[lane], slots[lane], lane))
    return lengths


class SyntheticDevice:
    """Frame durations and per-lane outcomes, both seeded by the trace."""

    def __init__(self, catalog: SyntheticCatalog, rng: random.Random):
        self.graphs = {graph.descriptor.id: graph for graph in catalog.graphs}
        self.rng = rng

    def duration_ns(self, graph: GraphDescriptor) -> int:
        synthetic = self.graphs[graph.id]
        jitter = self.rng.uniform(-synthetic.jitter_ns, synthetic.jitter_ns) if synthetic.jitter_ns else 0.0
        return max(1, int(round(synthetic.duration_ns + jitter)))

    def run(self, plan: ScheduledPlan, owners: dict[RequestHandle, _SimulatedRequest]) -> _FrameOutput:
        lanes = plan.lanes
        lengths = [lane.query_length for lane in lanes]
        confidence = None
        if plan.graph.is_prefix_limit:  # the same test the scheduler uses to route completions
            confidence = [self._confidence(plan.graph, lane, owners[lane.handle]) for lane in lanes]
            lengths = self._allocate(plan, confidence)
        records = [self._record(lane, owners[lane.handle], length) for lane, length in zip(lanes, lengths)]
        return _FrameOutput(tuple(records), None if confidence is None else tuple(confidence))

    def _confidence(self, graph: GraphDescriptor, lane: PlannedLane, owner: _SimulatedRequest) -> tuple[float, ...]:
        if lane.phase is LanePhase.PROMPT:
            return (0.0,) * graph.proposal_depth
        return prefix_confidence(owner.acceptance(), graph.proposal_depth)

    def _allocate(self, plan: ScheduledPlan, confidence: list[tuple[float, ...]]) -> list[int]:
        # A mixed program's prompt row keeps one row of P here: conservative, never over P.
        graph = plan.graph
        ceilings = [_ceiling(graph, lane) for lane in plan.lanes]
        slots = [lane.handle.slot for lane in plan.lanes]
        return allocate_prefixes(ceilings, confidence, slots, graph.target_rows)

    def _record(self, lane: PlannedLane, owner: _SimulatedRequest, length: int) -> CompletionRecord:
        if lane.phase in (LanePhase.RESTORE, LanePhase.SNAPSHOT):
            return CompletionRecord(lane.handle)  # a state copy: no prompt, no token
        if lane.phase is LanePhase.PROMPT:
            tokens = owner.next_tokens(1) if lane.finishes_prompt else ()
            return CompletionRecord(lane.handle, prompt_consumed=lane.prompt_tokens, tokens=tokens)
        offered = max(0, length - 1)
        accepted = accepted_drafts(owner.acceptance(), offered, self.rng)
        return CompletionRecord(lane.handle, tokens=owner.next_tokens(accepted + 1), offered=offered)


def _ceiling(graph: GraphDescriptor, lane: PlannedLane) -> int:
    if lane.phase is LanePhase.PROMPT:
        return 1
    return lane.ceiling or min(graph.proposal_depth + 1, graph.width)


@dataclass(frozen=True, slots=True)
class _FrameOutput:
    records: tuple[CompletionRecord, ...]
    confidence: tuple[tuple[float, ...], ...] | None  # per lane, device-allocated rounds only


# ---------------------------------------------------------------------------
# The event loop
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class _SimulatedRequest:
    """A trace request's simulated state: its outcome so far and its scheduler handle."""

    spec: TraceRequest
    outcome: RequestOutcome
    handle: RequestHandle | None = None
    produced: int = 0  # output tokens the device has committed so far
    tokens: tuple[int, ...] = ()  # the whole prompt's synthetic ids (set at arrival)
    restoring: Checkpoint | None = None  # the checkpoint its restore reads (guarded until it completes)
    held: bool = False  # finished, holding its slot for the terminal snapshot (P6)

    def history(self) -> tuple[int, ...]:
        """Prompt and committed output: what a follow-up turn's prompt starts with."""
        return self.tokens + tuple(range(self.produced))

    def acceptance(self) -> AcceptanceModel:
        """The acceptance model in force now (``acceptance_schedule`` may change it mid-stream)."""
        return self.spec.acceptance_after(self.produced)

    def next_tokens(self, count: int) -> tuple[int, ...]:
        """Synthetic token ids; the device never emits past the output limit."""
        count = max(0, min(count, self.spec.max_tokens - self.produced))
        start = self.produced
        self.produced += count
        return tuple(range(start, start + count))


@dataclass(frozen=True, slots=True)
class _Frame:
    fence: int
    plan: ScheduledPlan
    start_ns: int
    end_ns: int


def _loaded(graphs: Sequence[GraphDescriptor], speculation: str, floor: str | None = None) -> tuple[GraphDescriptor, ...]:
    """What the scheduler is given: with speculation off, the programs that draw no proposals (as
    ``flare run --speculation off`` loads them); with the "draft" adaptive floor, no ordinary decode or
    mixed program beside learned rounds (as ``flare run --adaptive-floor draft``)."""
    if speculation == "off":
        return tuple(g for g in graphs if not g.draws_proposals)
    if floor == "draft" and any(g.proposal_source == "learned" and g.draws_proposals for g in graphs):
        return tuple(g for g in graphs if not skips_draft_absorption(g))
    return tuple(graphs)


class Simulation:
    """One run of a trace against a synthetic catalog; ``run()`` returns the result."""

    def __init__(
        self,
        catalog: SyntheticCatalog,
        trace: Trace,
        options: SimulationOptions = SimulationOptions(),
        scheduler: Scheduler | None = None,
    ):
        """``scheduler`` replaces the real one only in tests of the loop's own mechanics."""
        self.catalog = catalog
        self.options = options
        self.speculation = trace.speculation
        self.floor = trace.adaptive_floor
        if scheduler is None:
            scheduler = Scheduler(
                _loaded(catalog.descriptors(), trace.speculation, self.floor), request_slots=catalog.request_slots,
                policy=trace.policy, speculation=trace.speculation,
            )
            if self.floor == "plain":
                scheduler.track_draft_state()
        self.scheduler = scheduler
        self.device = SyntheticDevice(catalog, random.Random(trace.seed))
        # by arrival; follow-up turns (whose arrival is known only at run time) after, in trace order
        ordered = sorted(trace.requests, key=lambda r: r.arrival_ns if r.follows is None else math.inf)
        self.everyone = [_SimulatedRequest(r, RequestOutcome(r.id, r.arrival_ns)) for r in ordered]
        # conversations: a follow-up arrives think_ms after the turn it follows leaves its slot
        # reuse needs both state programs in the catalog: a catalog without them runs as before
        kinds = {g.descriptor.kind for g in catalog.graphs}
        self.reuse = trace.reuse and {GraphKind.RESTORE, GraphKind.SNAPSHOT} <= kinds
        self.checkpoints = CheckpointIndex()
        self.checkpoint_rows = trace.checkpoint_rows
        self.stamp = 0
        self.followers: dict[str, list[_SimulatedRequest]] = {}
        for number, request in enumerate(self.everyone):
            if request.spec.follows is None:
                request.tokens = _fresh_tokens(number, request.spec.prompt_tokens)
            else:
                self.followers.setdefault(request.spec.follows, []).append(request)
        self.arrivals: deque[_SimulatedRequest] = deque(r for r in self.everyone if r.spec.follows is None)
        self.waiting: deque[_SimulatedRequest] = deque()  # arrived, no free slot yet
        self.owners: dict[RequestHandle, _SimulatedRequest] = {}  # every admitted request (handles never repeat)
        self.active = 0  # admitted and not finished: occupies a request slot
        self.frames: deque[_Frame] = deque()
        self.plans: list[PlanRecord] = []
        self.now = 0
        self.fence = 0
        self.stalled = False  # work was left, yet nothing was planned, queued or arriving

    def run(self) -> SimulationResult:
        self.scheduler.advance_to(0)
        if not self.options.cold:
            self._measure_catalog()
        while True:
            self._admit_arrivals()
            self._submit_plans()
            next_ns = self._next_event_ns()
            if next_ns is None:
                self.stalled = self._unfinished()
                break
            if self._past_end(next_ns):
                break
            self.now = next_ns
            self.scheduler.advance_to(self.now)
            if self.frames and self.frames[0].end_ns == self.now:
                self._complete(self.frames.popleft())
        return self._result()

    def _measure_catalog(self) -> None:
        """One observation per graph at time zero, through the normal cost path."""
        loaded = set(_loaded(self.catalog.descriptors(), self.speculation, self.floor))
        for graph in self.catalog.graphs:
            if graph.descriptor in loaded:
                self.scheduler.observe_duration(graph.descriptor.id, graph.duration_ns)

    def _admit_arrivals(self) -> None:
        while self.arrivals and self.arrivals[0].outcome.arrival_ns <= self.now:
            self.waiting.append(self.arrivals.popleft())
        while self.waiting and self.active < self.catalog.request_slots and self._admit(self.waiting[0]):
            self.waiting.popleft()

    def _admit(self, request: _SimulatedRequest) -> bool:
        """Admit one waiting request; False while the scheduler still holds every slot.

        A finished request keeps its slot until the last frame naming it
        completes (spec A1), so a refusal here is normal while frames run. The
        trace was validated on load, so a refusal with nothing running is a bug.
        """
        spec = request.spec
        prompt = len(request.tokens)
        found = self.checkpoints.lookup(request.tokens, self._next_stamp()) if self.reuse else None
        hit = found.checkpoint if found is not None else None
        admit = AdmitRequest(
            prompt_tokens=prompt,
            max_tokens=spec.max_tokens,
            context_limit=prompt + spec.max_tokens,
            proposal_sources=(spec.proposal_source,),
            cached_tokens=hit.length if hit else 0,
            restore_row=hit.row if hit else -1,
            terminal_snapshot=self.reuse,
            scored_prompt=spec.scored_prompt,
        )
        try:
            request.handle = self.scheduler.admit(admit)
        except ValueError as exc:
            if self.frames:
                return False
            raise SimulationError(f"the scheduler refused request {spec.id!r} with nothing running: {exc}") from None
        request.outcome.admitted_ns = self.now
        request.outcome.prompt_tokens = prompt
        if hit is not None:
            hit.use = RowUse.GUARDED  # K3: the row it restores from is no victim until the restore completes
            request.restoring = hit
            request.outcome.cached_tokens = hit.length
        self.owners[request.handle] = request
        self.active += 1
        if spec.preseed_acceptance:
            preseed_acceptance(self.scheduler, request.handle, spec, self._deepest_round(), self.device.rng)
        return True

    def _deepest_round(self) -> int:
        """Most drafts any round of this catalog can offer."""
        return max((min(g.descriptor.proposal_depth, g.descriptor.width - 1) for g in self.catalog.graphs), default=0)

    def _submit_plans(self) -> None:
        while (plan := self.scheduler.plan()) is not None:
            if len(self.frames) >= MAX_QUEUED_FRAMES:
                raise SimulationError(f"the scheduler queued {len(self.frames)} frames without completion feedback")
            self.fence += 1
            self.scheduler.commit(plan, self.fence)
            start = max(self.now, self.frames[-1].end_ns if self.frames else 0)
            frame = _Frame(self.fence, plan, start, start + self.device.duration_ns(plan.graph))
            self.frames.append(frame)
            self.plans.append(self._plan_record(frame))

    def _plan_record(self, frame: _Frame) -> PlanRecord:
        plan = frame.plan
        return PlanRecord(
            fence=frame.fence,
            start_ns=frame.start_ns,
            end_ns=frame.end_ns,
            graph=plan.graph,
            cohort=tuple(self.owners[lane.handle].spec.id for lane in plan.lanes),
            reason=plan.reason.value,
            estimated_ns=plan.estimated_duration_ns,
            actual_ns=frame.end_ns - frame.start_ns,
            lane_widths=tuple(lane.ceiling or lane.query_length for lane in plan.lanes),
            trace=plan.trace,
        )

    def _next_event_ns(self) -> int | None:
        candidates = []
        if self.frames:
            candidates.append(self.frames[0].end_ns)
        if self.arrivals:
            candidates.append(self.arrivals[0].outcome.arrival_ns)
        return min(candidates, default=None)

    def _past_end(self, next_ns: int) -> bool:
        return self.options.until_ns is not None and next_ns > self.options.until_ns

    def _complete(self, frame: _Frame) -> None:
        output = self.device.run(frame.plan, self.owners)
        duration = frame.end_ns - frame.start_ns
        timing = ExecutionTiming(device_ns=duration, wall_ns=duration)
        if output.confidence is not None:
            generated = self.scheduler.complete_packed_round(frame.fence, output.records, timing, output.confidence)
        else:
            generated = self.scheduler.complete(frame.fence, output.records, timing)
        for token in generated:
            self._publish(token, frame.fence)
        for lane in frame.plan.lanes:
            if lane.phase is LanePhase.RESTORE:
                self._restored(self.owners[lane.handle])
            elif lane.phase is LanePhase.SNAPSHOT:
                self._captured(self.owners[lane.handle], lane.checkpoint_tokens)

    def _next_stamp(self) -> int:
        self.stamp += 1
        return self.stamp

    def _restored(self, request: _SimulatedRequest) -> None:
        if request.restoring is not None:
            request.restoring.use = RowUse.FREE_TO_EVICT
            request.restoring = None

    def _captured(self, request: _SimulatedRequest, tokens: int) -> None:
        """A snapshot completed: publish its checkpoint (K3 destination), then free the held slot (P6)."""
        row = self.checkpoints.destination(range(self.checkpoint_rows))
        if row is not None:
            self.checkpoints.add(request.history()[:tokens], row, AnchorRole.TERMINAL, self._next_stamp())
        if request.held:
            request.held = False
            self._left(request)

    def _left(self, request: _SimulatedRequest) -> None:
        """The request's slot is free: its follow-up turns arrive after their think time."""
        self.active -= 1
        for follower in self.followers.get(request.spec.id, ()):
            follower.tokens = request.history() + _fresh_tokens(self.everyone.index(follower), follower.spec.prompt_tokens)
            arrival = self.now + int(round(follower.spec.think_ms * NS_PER_MS))
            follower.outcome.arrival_ns = arrival
            at = next((i for i, r in enumerate(self.arrivals) if r.outcome.arrival_ns > arrival), len(self.arrivals))
            self.arrivals.insert(at, follower)

    def _publish(self, token: GeneratedToken, fence: int) -> None:
        request = self.owners[token.handle]
        if token.tokens:  # a visible burst, reported before the next completion (A4)
            request.outcome.bursts.append(Burst(self.now, len(token.tokens)))
            self.scheduler.published_output(token.handle, fence)
        if token.finished:
            request.outcome.finished_ns = self.now
            if self.reuse and self.scheduler.holds(token.handle):
                request.held = True  # the slot frees when the terminal snapshot completes
            else:
                self._left(request)

    def _unfinished(self) -> bool:
        """Work left: arrivals, waiting requests, or requests in their slots."""
        return bool(self.arrivals or self.waiting or self.active)


    def _result(self) -> SimulationResult:
        stopped_early = self.options.until_ns is not None and self._unfinished() and not self.stalled
        return SimulationResult(
            requests=tuple(request.outcome for request in self.everyone),
            plans=tuple(self.plans),
            end_ns=self.options.until_ns if stopped_early else self.now,
            stalled=self.stalled,
            cold=self.options.cold,
        )


PRESEED_ROUNDS = 64


def _fresh_tokens(number: int, count: int) -> tuple[int, ...]:
    """Synthetic prompt ids no other request shares (output ids count from zero, prompt ids from 10**7)."""
    base = (number + 1) * 10_000_000
    return tuple(range(base, base + count))


def preseed_acceptance(
    scheduler: Scheduler, handle: RequestHandle, spec: TraceRequest, offered: int, rng: random.Random
) -> None:
    """Give a fresh request the acceptance history of 64 completed rounds (trace ``preseed_acceptance``).

    Each synthetic round offers the catalog's deepest draft prefix and accepts
    what the request's own acceptance model says; ``Scheduler.seed_acceptance``
    folds them in exactly as completed rounds would be (S6), without aging, so
    the history looks as if it had been observed just before admission.
    """
    rounds = [(offered, accepted_drafts(spec.acceptance, offered, rng)) for _ in range(PRESEED_ROUNDS)]
    scheduler.seed_acceptance(handle, spec.proposal_source, rounds)


def simulate(catalog: SyntheticCatalog, trace: Trace, options: SimulationOptions = SimulationOptions()) -> SimulationResult:
    """Run ``trace`` on ``catalog`` with the real scheduler; the library entry of ``flare simulate``."""
    return Simulation(catalog, trace, options).run()
