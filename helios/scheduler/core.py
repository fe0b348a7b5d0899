"""The Scheduler: request state, admission, commit, completion and publication accounting.

API additions beyond DESIGN.md (additive; nothing renamed or removed):
- ``Scheduler.observe_duration(graph_id_or_key, device_ns)`` feeds one device
  interval through the normal cost path (the simulator's measured catalog).
- ``Scheduler.now_ns``, ``Scheduler.queued_fences``, ``Scheduler.is_active(h)``,
  ``Scheduler.request_view(h)`` and ``Scheduler.acceptance_of(h)`` are
  read-only conveniences for drivers/tests.
- ``Scheduler.seed_acceptance(handle, source, rounds)`` folds (offered, accepted)
  pairs into a request's acceptance history as completed rounds would (S6),
  without aging: a preseeded history (the simulator's ``preseed_acceptance``).
- ``complete_packed_round(fence, records, timing, confidence)``: ``confidence``
  is one sequence of joint prefix probabilities per record (rank zero's rows of
  the sidecar), or None; ``*_with_survival`` variants take ``survival`` the same
  way. Both are validated before any lane is applied (A2); confidence rows
  feed the request's forecast and the population prior (S7), survival rows
  replace binary acceptance observations (S10).
- ``Scheduler(..., speculation="off" | "fixed" | "adaptive")``
  (``config.SPECULATION_MODES``): fixed-width execution never runs acceptance
  probes (D8); ``off`` neither, and refuses programs that draw proposals.
  ``execution_counters()`` gives D9's executions and nanoseconds per
  selection reason.
- ``Scheduler(..., cost=, selector=)``: the duration model
  (``cost.DurationModel``, default ``CostModel``) and the choice of each plan
  (``selector.Selector``, default ``HeliosSelector``) are injected; the
  timing table (``CatalogTiming``) always runs over the cost model in use.
- ``requests()``, ``inflight(h)``, ``queued_output(h)``,
  ``duration_estimates()`` and ``selection_inputs()`` are read-only views for
  the engine, the debug server and tests (the engine mirrors none of it).
- ``acceptance_prior`` is S7's population prior (not the columnar population
  snapshot a plan selects on).
- ``track_draft_state()`` (before the first admission) and ``draft_current(h)``:
  with ordinary decode loaded beside learned rounds (the engine's "plain"
  adaptive floor), a request an ordinary frame ran is never offered a learned
  round again (docs/scheduling-utility.md, "Departures from the spec", item 5).

Funded exploration (docs/exploration.md, last section): ordinary completions earn
credit; with full credit and an empty queue, ``plan`` may replace its measured
winner by a stale alternative (timing refresh) or an acceptance probe
(``explore.py``); commit opens the episode, completion closes it. The device
is idle, and positive credit lapses, when a completion or a cancellation
leaves the frame queue empty with no runnable request (time alone never
changes that, so ``advance_to`` need not check).

The execution queue (two frame slots, the feedback gate, the projection to the
queue's end: A6-A11) is ``queue.FrameQueue``; this module asks it whether a
plan may be queued, where the next plan starts, and what each request's
service will be when the queue drains.

Life of a request: ``admit`` gives a slot and a generation; while prompt is
left it competes as a prompter; a completion that consumes the last prompt
token makes it a decoder (A7: only then); every completion updates committed
counters, service history and acceptance; a finished or cancelled request keeps
its slot until the last frame naming it completes, so no later occupant of the
slot is ever charged for it (A1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Sequence

from flare_contract.graphs import GENERATION_KINDS, CostKey, GraphDescriptor, GraphKind
from helios.scheduler.select.population import MAX_REQUEST_SLOTS, Decoders, Population, Prompters, cumulative_gains
from helios.scheduler.select.timing import GraphTiming
from helios.scheduler import queue as fq
from helios.scheduler.catalog_timing import CatalogTiming
from helios.scheduler.config import SPECULATION_MODES, PolicyConfig
from helios.scheduler.cost import CostModel, DurationModel
from helios.scheduler.explore import Decision, ProbeSubject
from helios.scheduler.queue import FrameQueue, lane_output_bound
from helios.scheduler.refresh import EXPLORATION_REASONS, ExplorationAccounts, ReasonTotals
from helios.scheduler.selector import HeliosSelector, Selector
from helios.scheduler import state_ops
from helios.scheduler.state_ops import RequestOps
from helios.scheduler.service import (
    DeliveryFamily,
    MIN_RATE_PER_MS,
    ServiceHistory,
    fair_token_rate,
    guaranteed_tokens,
    reference_interval_ms,
)
from helios.scheduler.speculation import (
    AcceptancePopulation,
    CompletedRound,
    PopulationPrior,
    ProposalDraws,
    RequestAcceptance,
    aging_factor,
    extrapolated_survival,
    survival_observations,
)
from helios.scheduler.utility import decision_log_scale, decode_age_price
from helios.scheduler.types import (
    AdmitRequest,
    CompletionRecord,
    ExecutionTiming,
    Fence,
    GeneratedToken,
    LanePhase,
    PlannedLane,
    PlanTrace,
    RequestHandle,
    ScheduledPlan,
    SelectionReason,
)

PROPOSAL_SOURCES = ("learned", "copy")
HOST_TIME_WEIGHT = 0.125  # each unqueued completion moves the exposed-host-time average this far (``_observe_host_time``)


# ---------------------------------------------------------------------------
# Request state: one object per request
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class RequestState:
    handle: RequestHandle
    request: AdmitRequest
    family: DeliveryFamily
    service: ServiceHistory
    acceptance: RequestAcceptance
    admitted_ns: int
    prompt_done: int  # committed prompt position (cached prefix included)
    output_cap: int  # most output tokens the request may ever commit: min(max_tokens, context - prompt)
    produced: int = 0  # committed output tokens
    survival: dict[str, tuple[float, ...]] = field(default_factory=dict)  # selection means per source
    gains: dict[str, list[float]] = field(default_factory=dict)  # select.population.cumulative_gains of each, kept with it
    # per source: (means, weights) of its estimates at depths 1..max (``PrefixSurvival.means_and_weights``)
    estimates: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = field(default_factory=dict)
    last_output_ns: int | None = None  # last visible publication (output age)
    decoder_since_ns: int | None = None  # when the prompt finished (age before any output)
    last_selected_ns: int = -1  # last commit naming it (tie order: least recently used)
    queued_prompt: int = 0  # prompt tokens in submitted, uncompleted frames
    queued_output: int = 0  # A11 bound on output tokens in those frames
    inflight: int = 0  # submitted, uncompleted frames with a lane for it
    cancelled: bool = False
    finished: bool = False
    ops: RequestOps = field(default_factory=RequestOps)  # restores, snapshots, terminal hold (state_ops)
    # its draft cache covers every committed position; False once a frame that skips draft absorption
    # (ordinary decode or mixed) is committed for it, for good: it is never offered a learned round again
    draft_current: bool = True
    # (slot, generation) of ``handle``: a key hashed in C, which queued frames use (``Frame.terms``)
    key: tuple[int, int] = field(init=False, default=(0, 0))

    def __post_init__(self) -> None:
        self.key = (self.handle.slot, self.handle.generation)

    @property
    def phase(self) -> LanePhase:
        return LanePhase.PROMPT if self.prompt_done < self.request.prompt_tokens else LanePhase.DECODE

    @property
    def live(self) -> bool:
        """Runnable: neither cancelled nor finished."""
        return not (self.cancelled or self.finished)

    def room(self) -> int:
        """Output tokens it may still commit beyond everything already submitted (its limit and context)."""
        return max(0, self.output_cap - self.produced - self.queued_output)

    def next_endpoint_distance(self, position: int) -> int:
        remaining = self.request.prompt_tokens - position
        ahead = [e - position for e in self.request.endpoints if e > position]
        return min(ahead, default=remaining)


@dataclass(frozen=True, slots=True)
class RequestView:
    """Read-only numbers about one request (for drivers, tests and ``/debug/state``)."""

    phase: LanePhase
    prompt_done: int
    produced: int
    token_rate: float
    delivery_rate: float | None
    inflight: int  # submitted, uncompleted frames with a lane for it
    handle: RequestHandle
    prompt_tokens: int
    max_tokens: int
    queued_output: int  # A11: most output tokens those frames may still commit
    cancelled: bool
    finished: bool

    @classmethod
    def of(cls, s: RequestState) -> "RequestView":
        return cls(s.phase, s.prompt_done, s.produced, s.service.token_rate, s.service.delivery_rate, s.inflight,
                   s.handle, s.request.prompt_tokens, s.request.max_tokens, s.queued_output, s.cancelled, s.finished)


def skips_draft_absorption(graph: GraphDescriptor) -> bool:
    """Ordinary decode and mixed programs: they advance a row without running the draft model over it
    (prefill, speculative and draft-keeping mixed programs absorb every committed token)."""
    return (graph.kind in (GraphKind.DECODE, GraphKind.MIXED) and graph.proposal_source is None
            and not graph.speculation_enabled)  # capture flags every speculative mixed program too


def draft_keeping_twins(graphs: Sequence[GraphDescriptor]) -> dict[int, int]:
    """Each draft-keeping width-one program (catalog index) -> the ordinary program of its shape (index):
    the same rows, the same prompt capacity, the same target work, without the draft's absorption step."""
    plain = {(g.kind is GraphKind.MIXED, g.batch_capacity, g.prefill_capacity): i
             for i, g in enumerate(graphs) if skips_draft_absorption(g)}
    twins = {}
    for i, g in enumerate(graphs):
        if (g.speculation_enabled and g.width == 1 and g.proposal_depth == 0 and not g.ragged
                and g.kind in (GraphKind.DECODE, GraphKind.SPECULATIVE, GraphKind.MIXED)):
            found = plain.get((g.kind is GraphKind.MIXED, g.batch_capacity, g.prefill_capacity))
            if found is not None:
                twins[i] = found
    return twins


_RECENCY = attrgetter("last_selected_ns")  # least recently selected first (U8 tie order)


# ---------------------------------------------------------------------------
# The scheduler
# ---------------------------------------------------------------------------


class Scheduler:
    """Chooses, commits and accounts prepared-graph executions (see module docstring)."""

    def __init__(
        self,
        graphs: Sequence[GraphDescriptor],
        *,
        request_slots: int,
        policy: PolicyConfig | None = None,
        speculation: str = "adaptive",
        cost: DurationModel | None = None,
        selector: Selector | None = None,
    ) -> None:
        """``cost``: the duration model (default ``CostModel`` at the policy's TTL); ``selector``: the
        choice of each plan (default ``HeliosSelector``, which needs a ``CostModel``)."""
        _check_catalog(graphs, request_slots, speculation)
        self.graphs: tuple[GraphDescriptor, ...] = tuple(graphs)
        self._by_id = {g.id: g for g in self.graphs}
        # built once: every plan's trace, commit and completion reads one (``cost_key()`` builds a new one)
        self._cost_keys = {g.id: g.cost_key() for g in self.graphs}
        self.request_slots = request_slots
        self.policy = policy or PolicyConfig()
        self.cost: DurationModel = cost if cost is not None else CostModel(self.policy.estimate_ttl_ns)
        self._timing = CatalogTiming(self.graphs, self.cost)  # per-graph timings and normalizer, kept current
        # the last reference intervals (U5): (timing list, decoders per family, sigma per family)
        self._sigmas: tuple[Sequence[GraphTiming], dict, dict] | None = None
        self._full_cadence: tuple[Sequence[GraphTiming], float | None] | None = None  # (timings, d) of ``_full_cadence_ms``
        # ``PolicyConfig.token_rate_by_value`` takes effect only where a mixed program carries a prompt row
        # beside decoders (P7; docs/scheduling-utility.md, "What x measures"): without one a prompt valued
        # against a by-value x has nothing to share its frames with, and its chunks run back to back.
        # ``age_price_by_cadence`` likewise: without a frame that serves decoders beside a prompt, a
        # cadence-sized c only makes prompts wait ("The age price from first principles")
        self._shares_frames = any(g.kind is GraphKind.MIXED and g.prefill_capacity > 0 for g in self.graphs)
        self._apply_choices()
        self._feasible: tuple[Sequence[GraphTiming], dict[int, float | None]] | None = None  # ``_fair_rate``'s
        self.now_ns = 0
        self._slots: list[RequestState | None] = [None] * request_slots
        self._generation = 0
        self._queue = FrameQueue()
        # host time a frame run with an empty queue exposes (wall minus device, averaged; None until one
        # completes): what A7's second slot can hide (``PolicyConfig.queue_ahead_by_host_time``)
        self._exposed_host_ns: float | None = None
        self._last_fence: Fence | None = None
        self._max_depth = max((g.proposal_depth for g in self.graphs), default=0)
        self._tracks_draft = False  # ``track_draft_state``
        self._admitted_any = False
        self.speculation = speculation
        self.exploration = ExplorationAccounts()  # D6-D9: both ledgers and the per-reason counters
        self.acceptance_prior = PopulationPrior()  # S7: where every confidence forecast starts
        # verified outcomes of every completed round, per proposal source: where a new request's acceptance
        # starts (``PolicyConfig.acceptance_from_population``)
        self.acceptance_population = {source: AcceptancePopulation() for source in PROPOSAL_SOURCES}
        self.proposal_draws = ProposalDraws()  # S12
        self.selector: Selector = selector if selector is not None else HeliosSelector(
            self.graphs, self._timing, self.cost, self.policy, fixed_width=speculation != "adaptive")

    # -- configuration and clock -------------------------------------------

    def configure_policy(self, policy: PolicyConfig) -> None:
        if self._admitted_any:
            raise ValueError("configure_policy must be called before the first admission")
        self.policy = policy
        self._apply_choices()
        self.cost.ttl_ns = policy.estimate_ttl_ns
        self._timing.reset(self.now_ns)
        self.selector.configure(policy)

    def track_draft_state(self) -> bool:
        """Keep, per request, whether its draft cache is current (``RequestState.draft_current``); before
        the first admission. Learned rounds read the draft cache and ordinary decode and mixed programs skip
        its absorption, so where both are loaded (an adaptive engine's "plain" floor, ``EngineConfig.
        adaptive_floor``; a simulated trace's ``adaptive_floor: plain``) a request that ran an ordinary frame
        is never offered a learned round again. Returns whether the catalog has both (else nothing to track).
        Off by default: a catalog that loads both without it treats every program as draft-keeping."""
        if self._admitted_any:
            raise ValueError("track_draft_state must be called before the first admission")
        self._tracks_draft = (any(g.proposal_source == "learned" and g.draws_proposals for g in self.graphs)
                              and any(skips_draft_absorption(g) for g in self.graphs))
        if self._tracks_draft:
            # A twin is then worth its extra draft step only through the learned rounds it keeps open, which
            # selection values on their own; so a twin never reads cheaper than its plain program, and noisy
            # early samples cannot keep rows on twins where no learned round pays (issue 22, item 6).
            self._timing.floor_twins(draft_keeping_twins(self.graphs), self.now_ns)
        return self._tracks_draft

    def execution_counters(self) -> dict[str, ReasonTotals]:
        """D9: executions and physical nanoseconds per selection reason (metric label spelling)."""
        return {label: ReasonTotals(n, ns) for label, (n, ns) in self.exploration.counters.as_labels().items()}

    def advance_to(self, now_ns: int) -> None:
        if now_ns < self.now_ns:
            raise ValueError(f"advance_to is monotonic: {now_ns} ns is before the current {self.now_ns} ns")
        self.now_ns = now_ns

    def observe_duration(self, graph: str | CostKey | GraphDescriptor, device_ns: int) -> None:
        """One device interval through the normal cost path (e.g. a measured catalog at t=0)."""
        self._observe_cost(self._cost_key(graph), device_ns, 0)

    def duration_estimates(self) -> dict[str, int]:
        """Graph id -> the current duration estimate in ns (0: unmeasured), as selection reads it now."""
        return {g.id: t.duration_ns for g, t in zip(self.graphs, self._timing.at(self.now_ns))}

    def _cost_key(self, graph: str | CostKey | GraphDescriptor) -> CostKey:
        if isinstance(graph, CostKey):
            return graph
        if isinstance(graph, GraphDescriptor):
            return graph.cost_key()
        if graph not in self._by_id:
            raise ValueError(f"unknown graph id {graph!r}; the catalog has {sorted(self._by_id)[:8]}...")
        return self._by_id[graph].cost_key()

    # -- admission and cancellation ----------------------------------------

    def admit(self, request: AdmitRequest) -> RequestHandle:
        _validate_admission(request)
        if request.scored_prompt and not any(g.kind is GraphKind.SCORED_PREFILL for g in self.graphs):
            raise ValueError("a scored prompt needs a scored_prefill program, and the catalog has none")
        slot = next((i for i, s in enumerate(self._slots) if s is None), None)
        if slot is None:
            raise ValueError(f"no free request slot (all {self.request_slots} are owned)")
        self._generation += 1
        handle = RequestHandle(slot, self._generation)
        residents = 1 + sum(1 for s in self._slots if s is not None and s.live)
        state = RequestState(
            handle=handle,
            request=request,
            family=self._family_of(request),
            service=ServiceHistory.starting_at(self._fair_rate(residents)),
            acceptance=RequestAcceptance(starts=self._acceptance_starts(request)),
            admitted_ns=self.now_ns,
            # at least the last prompt token is computed: it yields the first output
            prompt_done=min(request.cached_tokens, request.prompt_tokens - 1),
            output_cap=min(request.max_tokens, request.context_limit - request.prompt_tokens),
        )
        state.ops.restore_pending = request.restore_row >= 0
        self._refresh_survival(state)
        self._slots[slot] = state
        self._admitted_any = True
        return handle

    def _acceptance_starts(self, request: AdmitRequest) -> dict[str, PopulationPrior]:
        """Each proposal source's starting means for a new request (``PolicyConfig.acceptance_from_population``):
        a copy of the population's verified acceptance where S9's bound on its first-draft mean is below the
        break-even of every measured speculative program (``_draft_break_even``; a depth it has not seen reads
        0.5**d);
        otherwise none, and every depth starts at S8's 0.5**d, whose optimism lets a request find out whether
        its own drafts pay. A copy, so later rounds of other requests leave this request's unobserved depths
        where they started (S8). The gate reads S9's bound on the population mean, not the mean: a population
        of a few rounds can read below the break-even by chance, and then no new request would ever try a
        draft (spec-low, seed 0: four rejected first drafts, then none for the rest of the run). With
        ``PolicyConfig.population_gate_by_evidence`` the bound is the Chernoff one at S9's confidence on the
        rounds alone (``AcceptancePopulation.evidence_bound``): 14 rejected drafts open it, not about 43."""
        if not self.policy.acceptance_from_population:
            return {}
        starts = {}
        for source in request.proposal_sources:
            population = self.acceptance_population.get(source)
            if population is None or not population.depths:
                continue
            break_even = self._draft_break_even(source)
            bound = (population.evidence_bound(1) if self.policy.population_gate_by_evidence
                     else population.optimistic(1))
            if break_even is not None and bound < break_even:
                starts[source] = population.start(bool(self.policy.population_bounds_probes),
                                                  bool(self.policy.population_gate_by_evidence))
        return starts

    def _draft_break_even(self, source: str) -> float | None:
        """The least first-draft survival at which a measured width-two-or-wider program of ``source`` commits
        more tokens per ms than the measured ordinary decode program of its batch: min T_spec / T_decode - 1
        (None while no such pair is measured). Below it no round of that source pays for its drafts for a
        request that accepts as the population does."""
        timings = self._timing.at(self.now_ns)
        decode = {g.batch_capacity: t.duration_ns for g, t in zip(self.graphs, timings)
                  if g.kind is GraphKind.DECODE and t.known}
        best = None
        for g, t in zip(self.graphs, timings):
            if (g.kind is GraphKind.SPECULATIVE and g.width >= 2 and g.proposal_depth >= 1 and t.known
                    and (g.proposal_source or "learned") == source and g.batch_capacity in decode):
                ratio = t.duration_ns / decode[g.batch_capacity] - 1.0
                best = ratio if best is None else min(best, ratio)
        return best

    def cancel(self, handle: RequestHandle) -> None:
        """Stop selecting the request now; its slot frees after its last submitted fence (A6)."""
        held = self._lookup(handle)
        if held is not None and held.ops.terminal_since_ns is not None:
            held.ops.terminal_since_ns = None  # the terminal capture is given up; the slot frees after its fences
            self._release_if_idle(held)
            return
        state = self._state(handle)
        state.cancelled = True
        self._release_if_idle(state)
        self._lapse_credit_if_idle()

    def seed_acceptance(self, handle: RequestHandle, source: str, rounds_seen: Sequence[tuple[int, int]]) -> None:
        """Fold (offered, accepted) rounds into the request's history for ``source`` (S6), no aging."""
        if source not in PROPOSAL_SOURCES:
            raise ValueError(f"unknown proposal source {source!r}; expected one of {PROPOSAL_SOURCES}")
        state = self._state(handle)
        for offered, accepted in rounds_seen:
            state.acceptance.observe_round(source, offered, accepted, terminated=False)
        self._refresh_survival(state)

    def holds(self, handle: RequestHandle) -> bool:
        """P6: ``handle`` finished generating and keeps its slot until its terminal snapshot completes."""
        state = self._lookup(handle)
        return state is not None and state.ops.terminal_since_ns is not None

    def is_active(self, handle: RequestHandle) -> bool:
        state = self._lookup(handle)
        return state is not None and state.live

    def acceptance_of(self, handle: RequestHandle) -> RequestAcceptance:
        """The request's acceptance estimates and forecast (read them; completions change them)."""
        return self._state(handle).acceptance

    def request_view(self, handle: RequestHandle) -> RequestView:
        return RequestView.of(self._state(handle))

    def requests(self) -> tuple[RequestView, ...]:
        """Every request holding a slot, in slot order, cancelled and finished ones included (A6)."""
        return tuple(RequestView.of(s) for s in self._slots if s is not None)

    def inflight(self, handle: RequestHandle) -> int:
        """Submitted, uncompleted frames with a lane for ``handle``; 0 once it left its slot."""
        state = self._lookup(handle)
        return 0 if state is None else state.inflight

    def queued_output(self, handle: RequestHandle) -> int:
        """A11: most output tokens ``handle``'s queued frames may still commit; 0 once it left its slot."""
        state = self._lookup(handle)
        return 0 if state is None else state.queued_output

    @property
    def queued_fences(self) -> tuple[Fence, ...]:
        return self._queue.fences

    def selection_inputs(self) -> tuple[list[GraphTiming], Population]:
        """What the next decision is made on: every graph's timing, and the population projected to the
        queue's end (A8, A10). Reading it changes nothing a decision depends on."""
        return self._snapshot()

    def _lookup(self, handle: RequestHandle) -> RequestState | None:
        if not 0 <= handle.slot < self.request_slots:
            return None
        state = self._slots[handle.slot]
        return state if state is not None and state.handle == handle else None

    def _state(self, handle: RequestHandle) -> RequestState:
        state = self._lookup(handle)
        if state is None or not state.live:
            raise ValueError(f"{handle} is not an active request (finished, cancelled or never admitted)")
        return state

    def _release_if_idle(self, state: RequestState) -> None:
        if (state.inflight == 0 and not state.live and state.ops.terminal_since_ns is None
                and self._slots[state.handle.slot] is state):
            self._slots[state.handle.slot] = None

    def _family_of(self, request: AdmitRequest) -> DeliveryFamily:
        for source in request.proposal_sources:
            family = DeliveryFamily(source)
            if any(family.serves(g) for g in self.graphs):
                return family
        return DeliveryFamily(None)

    def _draft_falls_behind(self, state: RequestState) -> None:
        """A frame that skips draft absorption was committed for ``state``: its draft cache no longer covers
        its committed positions, and nothing here catches it up, so it leaves every ranking and probe of
        learned proposals for good (its learned estimates are kept, unused; copy rounds read no draft)."""
        state.draft_current = False
        for cached in (state.survival, state.gains, state.estimates):
            cached.pop("learned", None)

    def draft_current(self, handle: RequestHandle) -> bool:
        """Whether ``handle``'s draft cache covers every committed position (learned rounds may run it)."""
        return self._state(handle).draft_current

    def _refresh_survival(self, state: RequestState) -> None:
        """Cache selection means per source, nonincreasing in depth (S5), and the estimates' means and weights.

        Called wherever a request's estimates change (admission, seeding, each
        completed round's aging and observations), so the cache is current at
        every decision; the acceptance probe search reads the means and weights
        from it instead of asking for each lane's estimates (D8).
        """
        for source in state.request.proposal_sources:
            if source == "learned" and not state.draft_current:
                continue  # no learned round may run it again (``_draft_falls_behind``)
            estimates = state.acceptance.source(source)
            raw, weights = estimates.means_and_weights(self._max_depth)
            if self.policy.extrapolate_unobserved_depths:
                raw = extrapolated_survival(raw, len(estimates.depths))
            means, envelope = [], 1.0
            for mean in raw:
                envelope = min(envelope, mean)
                means.append(envelope)
            state.survival[source] = tuple(means)
            state.gains[source] = cumulative_gains(state.survival[source], self.policy.adaptive_verification_alpha)
            state.estimates[source] = (raw, weights)

    @staticmethod
    def _age_survival(state: RequestState, factor: float) -> None:
        """``_refresh_survival`` after a round that only aged the estimates (no drafts offered, no
        confidence row): no mean moved, so the selection means and gains stand, and each kept weight
        follows the aging (``PrefixSurvival.aged_weights``: the same floats). Most rounds of a
        speculating server are plain decode rounds, and recomputing every source's means, envelope and
        gains for each of their lanes was most of what such a round cost adaptive over off."""
        by_source = state.acceptance.by_source
        for source, (raw, weights) in state.estimates.items():
            state.estimates[source] = (raw, by_source[source].aged_weights(weights, factor))

    # -- planning -----------------------------------------------------------

    def plan(self) -> ScheduledPlan | None:
        """The best plan if it may be committed now; None otherwise (A7-A9)."""
        if not self._queue.accepts_more(self.now_ns):
            return None
        if self._queue and not self._queue_ahead_pays():
            return None
        timings, population = self._snapshot()
        choice = self.selector.select(timings, population)
        ops = self._state_choice(timings, population)
        if ops is not None and (choice is None or ops.key() > (not choice.timing.known, choice.score)):
            return None if self._queue else self._state_plan(ops)  # state programs drain the window (A7)
        if choice is None:
            return None
        log_scale = choice.log_scale  # the decision's common scaling (U7), kept for a funded replacement
        decision = Decision(choice, timings, population, self.now_ns)
        reason, feedback = choice.reason, choice.requires_feedback
        if feedback and self._prefill_may_queue(choice):
            feedback = False
        if self._queue:
            # A8: behind queued work, a funded plan would wait for the empty window
            # like any plan needing feedback, so only whether one is due matters;
            # when none is, ``fund`` would fund nothing either, so it is not asked
            if feedback or self.selector.would_fund(decision, self.exploration, self._probe_subject):
                return None
            if not self._queue.follows_last(choice):
                return None  # a decision behind a queued prefill is made at its completion, unless a prefill
        else:
            funded = self.selector.fund(decision, self.exploration, self._probe_subject)
            if funded is not None:
                choice, reason, feedback = funded.choice, funded.reason, True
        plan = ScheduledPlan(
            graph=choice.graph,
            lanes=self._cut_lanes(choice.lanes),
            reason=reason,
            estimated_duration_ns=choice.timing.duration_ns,
            scaled_value_rate=choice.score * math.exp(log_scale),
            log_scale=log_scale,
            prefill_row=choice.prefill_row,
            requires_feedback=feedback,
            trace=self._plan_trace(choice.graph, choice.timing.duration_ns, reason),
        )
        self.selector.planned(plan, self.now_ns)
        return plan

    def _queue_ahead_pays(self) -> bool:
        """Whether a plan behind the running frame can hide anything (``PolicyConfig.queue_ahead_by_host_time``).

        A7's second slot keeps the device busy while the host completes one frame and plans the next.
        Where completed frames show no host time beyond the device's, it hides nothing, and a plan made
        now instead of at the completion shuts out every request that arrives meanwhile for one more
        frame (docs/scheduling-utility.md, "The second frame slot"). Before any frame has completed with
        an empty queue nothing is known, and the second slot is used as A7 allows.
        """
        if not self.policy.queue_ahead_by_host_time or self._exposed_host_ns is None:
            return True
        return self._exposed_host_ns > 0.0

    def _prefill_may_queue(self, choice) -> bool:
        """``PolicyConfig.prefill_fills_second_slot``: an ordinary prefill plan that needs no feedback but A7's.

        A7 drains the window around every prefill. Where completed frames show host time (the engine's
        completion, planning and binding between two programs), each prefill then exposes that time twice
        per chunk, before it and after it: 32 of 111 frames per 16-stream serve on the bundled catalog
        (docs/scheduling-utility.md, "Departures from the spec"). A prefill-only frame of a measured, fresh
        program changes no decoder, and its prompters are in no population until it completes (a queued
        prompt is neither prompter nor decoder), so a plan behind it, or it behind a decode frame, reads
        nothing the frame will change. Where no host time has been shown (the simulator), A7's rule stands.
        """
        if not self.policy.prefill_fills_second_slot or not self._exposed_host_ns:
            return False
        graph, timing = choice.graph, choice.timing
        return graph.kind is GraphKind.PREFILL and timing.known and timing.fresh  # prompt rows only, by kind

    def _observe_host_time(self, frame: fq.Frame, timing: ExecutionTiming) -> None:
        """Average the host time an unqueued frame exposed (a queued frame's wall time includes its wait)."""
        if frame.queued or timing.device_ns <= 0:
            return
        exposed = max(0, timing.wall_ns - timing.device_ns)
        if self._exposed_host_ns is None:
            self._exposed_host_ns = float(exposed)
        else:
            self._exposed_host_ns += (exposed - self._exposed_host_ns) * HOST_TIME_WEIGHT

    def _state_choice(self, timings, population: Population) -> state_ops.StateChoice | None:
        """The best pending state operation (P1-P4, P6), scored on the ordinary decision's snapshot."""
        pending = state_ops.pending(self._slots, self._queue.end_ns(self.now_ns), self.policy,
                                    self._queue.projected_token_rate)
        if pending is None:
            return None
        restores, snapshots, held = pending
        policy = self.policy
        inputs = state_ops.StateInputs(
            restores, snapshots, held, population, self._age_price(timings) * len(population.decoders),
            policy.terminal_value, policy.terminal_age_price, self._timing.prefill_times(timings))
        return state_ops.best_state_choice(self.graphs, timings, inputs)

    def _state_plan(self, ops: state_ops.StateChoice) -> ScheduledPlan:
        """P3: the prerequisite's own duration T; the lookahead's F is in no plan field."""
        reason = SelectionReason.ORDINARY if ops.known else SelectionReason.DISCOVERY
        log_scale = decision_log_scale(abs(ops.score))
        plan = ScheduledPlan(
            graph=ops.graph, lanes=ops.lanes, reason=reason, estimated_duration_ns=ops.timing.duration_ns,
            scaled_value_rate=ops.score * math.exp(log_scale), log_scale=log_scale, requires_feedback=True,
            trace=self._plan_trace(ops.graph, ops.timing.duration_ns, reason))
        self.selector.planned(plan, self.now_ns)
        return plan

    def _cut_lanes(self, lanes: tuple[PlannedLane, ...]) -> tuple[PlannedLane, ...]:
        """K2: a prompt lane that ends at an armed snapshot point before the prompt's end publishes nothing."""
        out = None
        for i, lane in enumerate(lanes):
            if lane.phase is LanePhase.PROMPT and lane.finishes_prompt:
                state = self._slots[lane.handle.slot]
                if lane.prompt_start + lane.prompt_tokens < state.request.prompt_tokens:
                    out = list(lanes) if out is None else out
                    out[i] = PlannedLane(lane.handle, LanePhase.PROMPT, lane.prompt_start, lane.prompt_tokens)
        return lanes if out is None else tuple(out)

    def _probe_subject(self, handle: RequestHandle) -> ProbeSubject:
        """A decode lane's request as probes see it; reading creates no estimates."""
        state = self._slots[handle.slot]
        acceptance = state.acceptance
        estimates = {
            source: acceptance.reading(source)
            for source in state.request.proposal_sources if source in state.survival
        }
        return ProbeSubject(state.room(), estimates)

    def _plan_trace(self, graph: GraphDescriptor, cost_ns: int, reason: SelectionReason) -> PlanTrace:
        """A12: the plan's physical shape, selected cost, observation age, reason and credit."""
        observed = self.cost.last_observation_ns(self._cost_keys[graph.id])
        accounts = self.exploration  # both balances as ``credit()`` reads them
        return PlanTrace(
            graph.batch_capacity, graph.proposal_depth, graph.width, graph.target_rows, cost_ns,
            None if observed is None else self.now_ns - observed, reason,
            accounts.timing.balance_ns, accounts.learning.balance_ns,
        )

    def _timings(self) -> list[GraphTiming]:
        """Duration knowledge per graph (kept current by ``CatalogTiming``)."""
        return self._timing.at(self.now_ns)

    def _observe_cost(self, key: CostKey, device_ns: int, readiness_ns: int) -> None:
        self.cost.observe(key, device_ns, readiness_ns, self.now_ns)
        self._timing.observed(key, self.now_ns)

    def _snapshot(self) -> tuple[list[GraphTiming], Population]:
        """The timings and the population a decision is made on, projected to the queue's end."""
        timings = self._timings()
        return timings, self._population(self._queue.end_ns(self.now_ns), timings)

    def _population(self, start_ns: int, timings: Sequence[GraphTiming]) -> Population:
        """Columnar snapshot with prices and ages projected to ``start_ns`` (A10).

        Every completion reprices every request, so this runs in full for each
        selecting plan. It is written out rather than calling ``RequestState.room``,
        the reference projection and prices of tests/helios/scheduler/reference.py
        per request (the calls were most of its cost), with the same operations in
        the same order, so the same floats; ``Frame.terms`` holds each queued frame's part of
        ``blend`` that does not depend on the rate.
        """
        live = sorted([s for s in self._slots if s is not None and not (s.cancelled or s.finished)], key=_RECENCY)
        states, rooms, prompting = [], [], []  # decoders and their rooms; prompters with theirs
        counts: dict[str | None, int] = {}  # decoders per delivery family (U5's k), by proposal source
        for s in live:
            if s.ops.blocked:
                continue  # waits for a restore or snapshot (state_ops): neither prompter nor decoder
            room = s.output_cap - s.produced - s.queued_output
            if room < 0:
                room = 0
            if s.prompt_done >= s.request.prompt_tokens:
                if room > 0:
                    source = s.family.proposal_source
                    counts[source] = counts.get(source, 0) + 1
                    states.append(s)
                    rooms.append(room)
            elif not s.queued_prompt:
                prompting.append((s, room))
        sigmas = self._reference_intervals(counts, timings)
        policy = self.policy
        c, beta, f, g = policy.decode_age_price, policy.output_token_value, policy.token_fairness, policy.delivery_fairness
        projected = self._queue.project(states)  # A10: rates and age references at the queue's end
        rates, deliveries, references = projected.token_rates, projected.delivery_rates, projected.reference_ns
        if self._by_cadence:
            c = self._age_price(timings)
        if len(counts) == 1:  # one delivery family: one sigma
            sigma = sigmas.get(next(iter(counts)))
            slope, first = (c * sigma, 1.0 / sigma) if sigma else (0.0, 1.0)
            slopes = [slope] * len(states)
            deliveries = [first if z is None else z for z in deliveries]
        else:
            family_sigmas = [sigmas.get(s.family.proposal_source) for s in states]
            slopes = [c * sigma if sigma else 0.0 for sigma in family_sigmas]
            deliveries = [(1.0 / sigma if sigma else 1.0) if z is None else z
                          for z, sigma in zip(deliveries, family_sigmas)]
        dec = Decoders(
            handle=[s.handle for s in states],
            token_price=[beta + f / x for x in rates],
            delivery_price=[g / (z if z > MIN_RATE_PER_MS else MIN_RATE_PER_MS) for z in deliveries],
            age_credit=[slope * (age if (age := (start_ns - reference) / 1e6) > 0.0 else 0.0)
                        for slope, reference in zip(slopes, references)],
            age_slope=slopes,
            room=rooms,
            survival=[s.survival for s in states],
            recency=[s.last_selected_ns for s in states],
            gains=[s.gains for s in states],
            estimates=[s.estimates for s in states],
        )
        times = self._timing.prefill_times(timings) if policy.prompt_chunk_share else None
        prm, scored = Prompters(times=times), None  # scored prompters: built only when there are some
        for s, room in prompting:
            handle, x = s.handle, self._queue.projected_token_rate(s)
            congestion = f / x
            position = s.prompt_done
            cut = self._snapshot_cut(s, position, timings)  # K2: an armed point ends this prompt's lanes
            if s.request.scored_prompt:  # scored prompts run only in scored programs (C1)
                if scored is None:
                    scored = Prompters(times=times)
                into = scored
            else:
                into = prm
            into.handle.append(handle)
            into.start.append(position)
            into.remaining.append((cut or s.request.prompt_tokens) - position)
            into.to_endpoint.append(s.next_endpoint_distance(position))
            into.price.append(1.0 + congestion)
            into.first_token.append(beta + congestion if room > 0 and not cut else 0.0)
            into.recency.append(s.last_selected_ns)
            if self._by_due:
                whole = times.ms(s.request.prompt_tokens) if times is not None else float(s.request.prompt_tokens)
                into.due.append(s.admitted_ns / 1e6 + whole)
        # vouched for (select.population.Population): both lists follow ``live``, least recently selected first;
        # one family shares one slope; with beta > 0 every token price is positive (the other
        # preferences are >= 0, PolicyConfig checks, so delivery prices and age credits are too)
        held = sum(1 for s in self._slots if s is not None and s.ops.terminal_since_ns is not None)
        # P6: every held terminal's age coefficient enters every candidate's waiting cost
        waiting = c * len(states) + policy.terminal_age_price * held if held else c * len(states)
        return Population(dec, prm, waiting, policy.adaptive_verification_alpha,
                              ordered=True, uniform_slope=len(counts) <= 1, positive=beta > 0.0,
                              defers_decode=bool(policy.prefill_defers_decode),
                              prompts_beside_decoders=bool(policy.prompts_beside_decoders) and self._shares_frames,
                              shortest_prompts_first=self._shortest_first,
                              prompts_by_due=self._by_due,
                              prompts_join_rounds=bool(policy.finishing_prompts_fill_rows), age_price=c,
                              adaptation_ms=policy.adaptation_ms,
                              scored=scored)

    def _apply_choices(self) -> None:
        """The price-flow choices that need a frame serving decoders beside a prompt (see __init__)."""
        self._by_value = bool(self.policy.token_rate_by_value) and self._shares_frames
        self._by_cadence = bool(self.policy.age_price_by_cadence) and self._shares_frames
        self._prompt_weight = self.policy.prompt_service_weight if self._by_value else 1.0
        # ``prompts_shortest_first`` where no mixed program carries a prompt row: prompts then have frames of
        # their own, and taking turns delays every first output (docs/scheduling-utility.md, "Prompts in
        # order"); beside mixed rows the simulator's report measured it worse (long-docs' ITL tail)
        self._shortest_first = bool(self.policy.prompts_shortest_first) and not self._shares_frames
        # ``prompts_by_due`` where a mixed program carries a prompt row (docs/scheduling-utility.md, "Departures
        # from the spec", 9): there prompt rows ride beside the decoders, and taking turns only delays them all
        self._by_due = bool(self.policy.prompts_by_due) and self._shares_frames
        self._feasible = None

    def _age_price(self, timings) -> float:
        """Every decoder's age price c (U6): the policy's, or with ``age_price_by_cadence`` (where it
        applies) at least beta / d^2. The ordinary decision and the state decisions (P1-P6) charge the
        same c."""
        policy = self.policy
        if self._by_cadence:
            return decode_age_price(policy.decode_age_price, policy.output_token_value, self._full_cadence_ms(timings))
        return policy.decode_age_price

    def _full_cadence_ms(self, timings) -> float | None:
        """sigma of a plain decoder when every request slot decodes (U5 with K = k = slots): the catalog's
        full-batch decode cadence, which ``PolicyConfig.age_price_by_cadence`` prices the age by."""
        cached = self._full_cadence
        if cached is not None and cached[0] is timings:
            return cached[1]
        slots = self.request_slots
        sigma = reference_interval_ms(slots, slots, self._timing.fastest_shapes(DeliveryFamily(None), timings))
        self._full_cadence = (timings, sigma)
        return sigma

    def _snapshot_cut(self, s: RequestState, position: int, timings) -> int | None:
        """K2: the next armed snapshot point before the prompt's end (arming once costs are known), or None."""
        if s.ops.points is None and s.request.snapshot_points:
            state_ops.arm_points(s.ops, s.request, position, self._timing.prefill_times(timings),
                                 state_ops.snapshot_ms(self.graphs, timings), self.policy.checkpoint_extra_work_fraction)
        point = s.ops.next_point(position)
        return point if point is not None and point < s.request.prompt_tokens else None

    def _reference_intervals(self, counts: dict[str | None, int], timings) -> dict[str | None, float]:
        """sigma per delivery family, keyed by its proposal source (U5).

        ``counts`` holds the decoders of each family (keyed by proposal source);
        K is their total, k each family's count.
        """
        cached = self._sigmas
        if cached is not None and cached[0] is timings and cached[1] == counts:
            return cached[2]
        total = sum(counts.values())
        out = {}
        for source, k in counts.items():
            sigma = reference_interval_ms(total, k, self._timing.fastest_shapes(DeliveryFamily(source), timings))
            if sigma is not None:
                out[source] = sigma
        self._sigmas = (timings, counts, out)  # the same timing list and counts give the same sigmas
        return out

    def _fair_rate(self, participants: int) -> float:
        """A new request's starting x: its fair share among ``participants`` (docs/scheduling-utility.md,
        "Starting points").

        One for one, the normalizer shared by all. Counted by value, the share a program can actually
        give: the best, over measured generation programs, of min(rows, participants) tokens per
        dispatch over its duration, shared by the participants (a 16-row batch does not serve two
        requests eight times faster than a 2-row one). By value a prompt at full prefill speed gets
        about one output-token equivalent per ms, so a newcomer started at a share of the full batch's
        rate would look better served than a prompt that is running, and would wait behind it.
        """
        if not self._by_value:
            return fair_token_rate(self._normalizer(), participants)
        timings = self._timings()
        cached = self._feasible
        if cached is None or cached[0] is not timings:
            cached = self._feasible = (timings, {})
        rates = cached[1]
        if participants not in rates:
            best = None
            for graph, timing in zip(self.graphs, timings):
                if graph.kind in GENERATION_KINDS and timing.duration_ns > 0:
                    rows = guaranteed_tokens(graph)
                    rate = (rows if rows < participants else participants) / (timing.duration_ns / 1e6)
                    best = rate if best is None or rate > best else best
            rates[participants] = best if best is not None else self._normalizer()
        return fair_token_rate(rates[participants], participants)

    def _normalizer(self) -> float | None:
        """Token normalizer: the best measured token rate of the pure generation programs.

        A request's lasting share of service is what decode and speculative
        programs sustain, one guaranteed token per row. Prompt capacity (prefill
        graphs, and the prompt row of mixed graphs) processes tokens tens of times
        faster; a starting x at a share of *that* rate would price a waiting prompt
        as if it had already been served generously, and its first output would
        wait behind streams that have theirs. The whole catalog is the fallback
        while no generation program is measured.
        """
        return self._timing.normalizer(self.now_ns)

    # -- commit -------------------------------------------------------------

    def commit(self, plan: ScheduledPlan, fence: Fence) -> None:
        """Check ownership, epochs, room and feedback dependencies; then submit (A6)."""
        self._check_commit(plan, fence)
        states = tuple(s for s in self._slots if s is not None and not (s.cancelled or s.finished))  # live
        normalizer = self._normalizer()
        self._start_unserved_histories(states)
        for lane in plan.lanes:
            state = self._lookup(lane.handle)  # a held terminal is finished but owns its slot (P6)
            fq.hold(state, lane, plan.graph)
            state.last_selected_ns = self.now_ns
            if self._tracks_draft and state.draft_current and skips_draft_absorption(plan.graph):
                self._draft_falls_behind(state)
        self.cost.mark_attempt(self._cost_keys[plan.graph.id], self.now_ns)
        if plan.reason in EXPLORATION_REASONS:
            self.exploration.begin(plan.reason)  # D7/D8: the episode opens at commit, never at plan
        self._queue.submit(fence, plan, states, normalizer, self.now_ns, self.policy.adaptation_ms,
                           self._prompt_weight)
        self._last_fence = fence

    def _start_unserved_histories(self, participants: Sequence[RequestState]) -> None:
        """A request with no measured interval yet starts at the fair share of this interval's participants.

        Its admission-time share depended on who happened to be resident then;
        requests arriving together must not be ranked by arrival order. The
        share is worked out only when some participant starts (at a steady
        batch none does: every commit would otherwise price it for nothing).
        """
        unserved = [state for state in participants if state.service.last_interval is None]
        if not unserved:
            return  # everyone has a measured interval, or only held terminals run (P6)
        rate = self._fair_rate(len(participants))
        for state in unserved:
            state.service = ServiceHistory.starting_at(rate)

    def _check_commit(self, plan: ScheduledPlan, fence: Fence) -> None:
        if self._last_fence is not None and fence <= self._last_fence:
            raise ValueError(f"fences must strictly increase: {fence} after {self._last_fence}")
        if plan.graph.id not in self._by_id or self._by_id[plan.graph.id] != plan.graph:
            raise ValueError(f"plan graph {plan.graph.id!r} is not in this scheduler's catalog")
        self._queue.check_slot()
        if plan.reason in EXPLORATION_REASONS and not self.exploration.can_begin(plan.reason):
            raise ValueError(f"a {plan.reason.value} plan needs full credit and no episode in flight; replan")
        queued = bool(self._queue)
        self._queue.check_feedback(plan, queued and self.cost.requires_feedback(self._cost_keys[plan.graph.id], self.now_ns))
        seen = set()
        for lane in plan.lanes:
            if lane.handle in seen:
                raise ValueError(f"plan names {lane.handle} twice")
            seen.add(lane.handle)
            self._check_lane_current(lane, plan)

    def _check_lane_current(self, lane: PlannedLane, plan: ScheduledPlan) -> None:
        if lane.phase in (LanePhase.RESTORE, LanePhase.SNAPSHOT):
            state_ops.check_state_lane(self._lookup(lane.handle), lane, plan.graph)
            return
        state = self._state(lane.handle)
        if state.ops.blocked:
            raise ValueError(f"stale plan: {lane.handle} waits for a restore or snapshot")
        if lane.phase is LanePhase.PROMPT:
            expected_start = state.prompt_done + state.queued_prompt
            if lane.prompt_start != expected_start or state.phase is not LanePhase.PROMPT:
                raise ValueError(
                    f"stale plan: {lane.handle} prompt lane starts at {lane.prompt_start}, request is at {expected_start}"
                )
        elif state.phase is not LanePhase.DECODE or state.room() < 1:
            raise ValueError(f"stale plan: {lane.handle} cannot decode now (phase {state.phase.value}, room {state.room()})")
        elif not state.draft_current and plan.graph.proposal_source == "learned" and plan.graph.draws_proposals:
            raise ValueError(f"stale plan: {lane.handle}'s draft cache is behind (an ordinary frame ran it); "
                             f"{plan.graph.id} would draft from it")

    # -- completion -----------------------------------------------------------

    def complete(
        self, fence: Fence, records: Sequence[CompletionRecord], timing: ExecutionTiming
    ) -> list[GeneratedToken]:
        frame = self._oldest(fence)
        if frame.plan.graph.is_prefix_limit:
            raise ValueError(f"{frame.plan.graph.id} allocates rows on the device: use complete_packed_round")
        return self._complete(frame, records, timing, None, None)

    def complete_with_survival(self, fence, records, timing, survival) -> list[GeneratedToken]:
        frame = self._oldest(fence)
        if frame.plan.graph.is_prefix_limit:
            raise ValueError(f"{frame.plan.graph.id} allocates rows on the device: use complete_packed_round_with_survival")
        return self._complete(frame, records, timing, None, survival)

    def complete_packed_round(self, fence, records, timing, confidence) -> list[GeneratedToken]:
        frame = self._oldest(fence)
        if not frame.plan.graph.is_prefix_limit:
            raise ValueError(f"{frame.plan.graph.id} is host-allocated: use complete")
        return self._complete(frame, records, timing, confidence, None)

    def complete_packed_round_with_survival(self, fence, records, timing, confidence, survival):
        frame = self._oldest(fence)
        if not frame.plan.graph.is_prefix_limit:
            raise ValueError(f"{frame.plan.graph.id} is host-allocated: use complete_with_survival")
        return self._complete(frame, records, timing, confidence, survival)

    def _oldest(self, fence: Fence) -> fq.Frame:
        return self._queue.oldest(fence)

    def _complete(self, frame, records, timing, confidence, survival) -> list[GeneratedToken]:
        by_handle = validate_completion(frame, records, timing, self._lookup)
        _validate_sidecar("confidence", confidence, records, frame.plan.graph)
        _validate_sidecar("survival", survival, records, frame.plan.graph)
        sidecars = _sidecars_by_handle(records, confidence, survival)
        # everything is valid: from here on, state changes
        self._queue.pop(self.now_ns)
        plan = frame.plan
        self._observe_cost(self._cost_keys[plan.graph.id], timing.device_ns, timing.readiness_delay_ns)
        self._observe_host_time(frame, timing)
        # D6-D9: every frame that completes pays or earns once, by its plan's reason (cancelled lanes too)
        self.exploration.record(plan.reason, timing, frame.queued)
        before = self._served_before(frame.participants)
        out, states = [], []
        for lane in plan.lanes:
            state = self._lookup(lane.handle)
            if state is None:
                continue
            states.append(state)
            record = by_handle.get(lane.handle)
            token = self._apply_lane(state, lane, plan, record, frame.fence, sidecars.get(lane.handle))
            if token is not None:
                out.append(token)
        self._record_service(frame, timing, before)
        self._record_draws(plan, by_handle.values())
        for state in states:  # nothing above frees a slot: each lane's lookup still finds the same request
            self._release_if_idle(state)
        self._lapse_credit_if_idle()
        return out

    def _record_draws(self, plan: ScheduledPlan, records) -> None:
        """S12: learned proposals drawn by this round (copy rounds draw none)."""
        graph = plan.graph
        if graph.draws_proposals and graph.proposal_depth > 0:
            lanes = sum(1 for r in records if not r.prompt_consumed)
            self.proposal_draws.record(graph.proposal_source or "learned", lanes, graph.proposal_depth)

    def _lapse_credit_if_idle(self) -> None:
        """D6: when the device has nothing queued and nothing runnable, positive credit lapses."""
        if self._queue or self.exploration.episode_open:
            return
        if not any(s is not None and ((s.live and (s.phase is LanePhase.PROMPT or s.room() > 0 or s.ops.blocked))
                                      or s.ops.terminal_since_ns is not None) for s in self._slots):
            self.exploration.idle()

    def _served_before(self, participants: Sequence[RequestHandle]) -> list[tuple[RequestState, float]]:
        """Each participant still resident and not cancelled, with its committed counters before a completion."""
        found = []
        for handle in participants:
            state = self._lookup(handle)
            if state is not None and not state.cancelled:
                found.append((state, self._served_units(state)))
        return found

    def _served_units(self, state: RequestState) -> float:
        """The committed counters as token-rate service: prompt tokens weighted (PolicyConfig.prompt_service_weight)."""
        return state.prompt_done * self._prompt_weight + state.produced

    def _apply_lane(self, state, lane, plan, record, fence, sidecar=None) -> GeneratedToken | None:
        fq.release(state, lane, plan.graph)
        if lane.phase in (LanePhase.RESTORE, LanePhase.SNAPSHOT):
            state_ops.completed(state.ops, lane)  # setup earns no token and no service (P3)
            return None
        if record is None or not state.live:
            return None  # cancelled or finished earlier: nothing is published
        if lane.phase is LanePhase.PROMPT:
            state.prompt_done += record.prompt_consumed
            if state.phase is LanePhase.DECODE:
                state.decoder_since_ns = self.now_ns
            if state.prompt_done in (state.ops.points or ()):
                state.ops.due = state.prompt_done  # K2: the snapshot runs before the prompt continues
        else:
            self._observe_acceptance(state, lane, plan.graph, record, sidecar or (None, None))
        tokens = record.tokens if state.output_cap else ()  # max_tokens 0: the prompt's first token is not output
        state.produced += len(tokens)
        reason = self._finish_reason(state, record)
        if reason is not None:
            state.finished = True
            if state.request.terminal_snapshot:
                state.ops.terminal_since_ns = self.now_ns  # P6: age from validated termination
        if not tokens and reason is None:
            return None
        return GeneratedToken(state.handle, fence, tuple(tokens), reason is not None, reason)

    def _observe_acceptance(self, state: RequestState, lane: PlannedLane, graph: GraphDescriptor,
                            record: CompletionRecord, sidecar) -> None:
        """S6-S10: age, fold the verified outcome (survival rows where given), feed the forecast.

        Only rounds that offered drafts teach acceptance; width-one rounds only age.
        """
        confidence, survival = sidecar
        if record.offered == 0 and confidence is None and survival is None and record.tokens:
            # a round that offered no drafts and wrote no row only ages: ``RequestAcceptance.complete`` of
            # such a round, with one aging factor for everything (most lanes of a speculating server)
            factor = aging_factor(len(record.tokens))
            state.acceptance.age_by(factor)
            self._age_survival(state, factor)
            return
        outcome = CompletedRound(
            source=(graph.proposal_source or "learned") if record.offered > 0 else None,
            generated_tokens=len(record.tokens),
            offered=record.offered,
            accepted=min(record.offered, len(record.tokens) - 1),
            terminated=record.terminated,
            survival=None if survival is None else tuple(survival),
            confidence=None if confidence is None else (tuple(confidence),),
            ceiling=lane.ceiling or lane.query_length,
        )
        state.acceptance.complete(outcome, self.acceptance_prior)
        if outcome.source is None and outcome.confidence is None:
            self._age_survival(state, aging_factor(outcome.generated_tokens))
            return
        if outcome.source in self.acceptance_population:
            # the verified per-depth outcome S6/S10 fold into the request, into the population too
            observed = survival_observations(outcome.offered, outcome.accepted, outcome.terminated, outcome.survival)
            if observed:
                self.acceptance_population[outcome.source].observe(observed)
        self._refresh_survival(state)

    def _finish_reason(self, state: RequestState, record: CompletionRecord) -> str | None:
        r = state.request
        if state.prompt_done < r.prompt_tokens:
            return None  # a prompt chunk: nothing is output yet (max_tokens 0 ends only with the prompt)
        if record.terminated and state.output_cap:
            return "stop"

        if state.produced >= r.max_tokens or r.prompt_tokens + state.produced >= r.context_limit:
            return "length"
        return None

    def _record_service(self, frame: fq.Frame, timing: ExecutionTiming, before) -> None:
        """A3: one measured interval; service from committed-counter differences."""
        if timing.device_ns <= 0:
            return
        interval_ns = timing.device_ns if frame.queued else max(timing.device_ns, timing.wall_ns)
        interval_ms = interval_ns / 1e6
        for state, start in before:
            if state.cancelled:
                continue
            served = self._served_units(state) - start
            state.service.record_interval(frame.fence, served, interval_ms, self.policy.adaptation_ms)

    # -- publication ------------------------------------------------------------

    def published_output(self, handle: RequestHandle, fence: Fence) -> None:
        """Visible output for ``handle`` from ``fence``: one delivery, and output age resets (A4, A5)."""
        state = self._lookup(handle)
        if state is None:
            if handle.generation > self._generation or handle.generation < 1:
                raise ValueError(f"{handle} was never admitted")
            return  # the request already left: nothing to credit
        state.service.amend_delivery(fence)
        state.last_output_ns = self.now_ns


# ---------------------------------------------------------------------------
# Validation (A2): everything is checked before anything changes
# ---------------------------------------------------------------------------


def _check_catalog(graphs: Sequence[GraphDescriptor], request_slots: int, speculation: str) -> None:
    if speculation not in SPECULATION_MODES:
        raise ValueError(f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {speculation!r}")
    if not 1 <= request_slots <= MAX_REQUEST_SLOTS:
        raise ValueError(f"request_slots must be in 1..{MAX_REQUEST_SLOTS} (U11), got {request_slots}")
    ids = [g.id for g in graphs]
    if len(set(ids)) != len(ids):
        raise ValueError("graph ids must be unique in one catalog")
    drafting = [g.id for g in graphs if g.draws_proposals]
    if speculation == "off" and drafting:
        raise ValueError(f"speculation off runs no speculative programs, but the catalog has {drafting[:4]}")


def _validate_admission(r: AdmitRequest) -> None:
    if r.prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be >= 1, got {r.prompt_tokens}")
    if r.max_tokens < (0 if r.scored_prompt else 1):
        raise ValueError(f"max_tokens must be >= 1 (>= 0 for a scored prompt), got {r.max_tokens}")
    if r.scored_prompt and (r.cached_tokens or r.restore_row >= 0):
        raise ValueError("a scored prompt scores every position: cached_tokens must be 0 and nothing restored")
    if r.context_limit <= r.prompt_tokens:
        raise ValueError(f"context_limit ({r.context_limit}) must exceed prompt_tokens ({r.prompt_tokens})")
    if not 0 <= r.cached_tokens <= r.prompt_tokens:
        raise ValueError(f"cached_tokens must be in 0..prompt_tokens, got {r.cached_tokens}")
    if r.restore_row >= 0 and not 0 < r.cached_tokens < r.prompt_tokens:
        raise ValueError(f"a restore needs 0 < cached_tokens < prompt_tokens ({r.prompt_tokens}), got {r.cached_tokens}")
    if r.restore_row < -1:
        raise ValueError(f"restore_row must be -1 (none) or a checkpoint row >= 0, got {r.restore_row}")
    if any(not r.cached_tokens < p <= r.prompt_tokens for p in r.snapshot_points):
        raise ValueError(f"snapshot_points must lie past the cached prefix, in {r.cached_tokens + 1}..{r.prompt_tokens},"
                         f" got {r.snapshot_points}")
    if any(not 0 < e <= r.prompt_tokens for e in r.endpoints):
        raise ValueError(f"endpoints must lie in 1..prompt_tokens ({r.prompt_tokens}), got {r.endpoints}")
    unknown = set(r.proposal_sources) - set(PROPOSAL_SOURCES)
    if unknown:
        raise ValueError(f"unknown proposal sources {sorted(unknown)}; expected any of {PROPOSAL_SOURCES}")


def validate_completion(frame: fq.Frame, records, timing: ExecutionTiming, lookup) -> dict[RequestHandle, CompletionRecord]:
    """Every record checked against its lane; raises on the first malformed one."""
    if timing.device_ns < 0 or timing.wall_ns < 0 or timing.readiness_delay_ns < 0:
        raise ValueError(f"execution timing must be nonnegative, got {timing}")
    lanes = {lane.handle: lane for lane in frame.plan.lanes}
    by_handle: dict[RequestHandle, CompletionRecord] = {}
    for record in records:
        if record.handle not in lanes:
            raise ValueError(f"fence {frame.fence}: record for {record.handle}, which has no lane in the plan")
        if record.handle in by_handle:
            raise ValueError(f"fence {frame.fence}: two records for {record.handle}")
        by_handle[record.handle] = record
        _validate_record(record, lanes[record.handle], frame.plan.graph)
    for handle in lanes:
        state = lookup(handle)
        if handle not in by_handle and state is not None and state.live:
            raise ValueError(f"fence {frame.fence}: no record for active lane {handle}")
    _validate_rows(frame.plan.graph, by_handle.values())
    return by_handle


def _validate_record(record: CompletionRecord, lane: PlannedLane, graph: GraphDescriptor) -> None:
    # the messages name the lane in place: formatting it for every valid record cost more than the checks
    if lane.phase in (LanePhase.RESTORE, LanePhase.SNAPSHOT):
        if record.prompt_consumed or record.tokens or record.offered:
            raise ValueError(f"{graph.id} lane {record.handle}: a {lane.phase.value} row consumes no prompt and commits no token")
        return
    if lane.phase is LanePhase.PROMPT:
        if record.prompt_consumed != lane.prompt_tokens:
            raise ValueError(f"{graph.id} lane {record.handle}: prompt row must consume its scheduled {lane.prompt_tokens} tokens, got {record.prompt_consumed}")
        if len(record.tokens) > (1 if lane.finishes_prompt else 0) or record.offered:
            raise ValueError(f"{graph.id} lane {record.handle}: a prompt row publishes at most one first token and offers no drafts")
        return
    if record.prompt_consumed:
        raise ValueError(f"{graph.id} lane {record.handle}: a decode row consumes no prompt, got {record.prompt_consumed}")
    bound = lane_output_bound(lane, graph)
    if not 1 <= len(record.tokens) <= bound:
        raise ValueError(f"{graph.id} lane {record.handle}: a decode row commits 1..{bound} tokens, got {len(record.tokens)}")
    if not 0 <= record.offered <= min(graph.proposal_depth, max(graph.width - 1, 0)):
        raise ValueError(f"{graph.id} lane {record.handle}: offered drafts must be in 0..min(D, W-1), got {record.offered}")
    if len(record.tokens) > record.offered + 1:
        raise ValueError(f"{graph.id} lane {record.handle}: {len(record.tokens)} tokens from {record.offered} offered drafts (at most offered + 1)")
    if lane.ceiling and record.offered + 1 > lane.ceiling:
        raise ValueError(f"{graph.id} lane {record.handle}: verified {record.offered + 1} rows beyond the lane's ceiling {lane.ceiling} (S2)")


def _validate_rows(graph: GraphDescriptor, records) -> None:
    if graph.kind in GENERATION_KINDS or graph.kind is GraphKind.MIXED:
        rows = sum(max(1, r.offered + 1) for r in records if not r.prompt_consumed)
        if rows > graph.target_rows:
            raise ValueError(f"{graph.id}: records use {rows} target rows, more than P = {graph.target_rows}")


def _sidecars_by_handle(records, confidence, survival) -> dict[RequestHandle, tuple]:
    """Per record's handle: (confidence row, survival row), either None when absent."""
    rows = {}
    for i, record in enumerate(records):
        rows[record.handle] = (None if confidence is None else confidence[i],
                               None if survival is None else survival[i])
    return rows


def _validate_sidecar(name: str, rows, records, graph: GraphDescriptor) -> None:
    if rows is None:
        return
    if len(rows) != len(records):
        raise ValueError(f"{name}: one row per record expected ({len(records)}), got {len(rows)}")
    for row in rows:
        if row is None:
            continue
        if len(row) > graph.proposal_depth:
            raise ValueError(f"{name}: at most D = {graph.proposal_depth} values per row, got {len(row)}")
        if any(not 0.0 <= p <= 1.0 for p in row):
            raise ValueError(f"{name}: values must be probabilities in [0, 1], got {tuple(row)}")
