"""Funded exploration plans: when a refresh or a probe replaces the ordinary winner (D7, D8).

The pure rules live elsewhere: ``refresh.py`` holds the ledgers and the
refresh order, ``learning.py`` the probe candidates and the precedence of
refresh over probes. This module joins them to one planning decision of the
core. Ordinary selection has picked its measured winner; if a ledger holds
full credit and no episode is in flight, ``Explorer.choose`` looks for

1. a stale feasible alternative (timing refresh). Alternatives are the
   catalog's other measured, stale programs that have a cohort to run now,
   valued by their own ordinary score. The winner itself is excluded: a stale
   winner refreshes through normal service, paid by nobody's credit;
2. otherwise an acceptance probe for one of the winner's decode lanes: a
   measured speculative program of the lane's proposal source that offers
   deeper drafts than the winner does for that lane.

The funded choice runs the chosen program's own best cohort when that cohort
gives the probed lane its full depth; otherwise the probe runs the lane alone.
Either way the plan needs an empty queue and feedback (A8), like discovery.

Cost: nothing beyond two balance checks unless a ledger is full, so ordinary
planning pays for exploration only while credit waits for a candidate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from flare_contract.graphs import GENERATION_KINDS, CostKey, GraphDescriptor
from helios.scheduler.select.catalog import GraphInfo
from helios.scheduler.select.choice import Choice
from helios.scheduler.select.evaluate import Evaluated, evaluate_scores
from helios.scheduler.select.population import Population
from helios.scheduler.select.timing import GraphTiming
from helios.scheduler.cost import CostModel
from helios.scheduler.learning import (
    NS_PER_MS,
    ProbeBasis,
    ProbeCandidate,
    ProbeLane,
    WidthProgram,
    best_priced_term,
    choose_exploration,
    probe_basis,
    term_candidate,
    term_rank_key,
)
from helios.scheduler.refresh import ExplorationAccounts, stale_alternatives
from helios.scheduler.speculation import PrefixSurvival
from helios.scheduler.types import LanePhase, PlannedLane, RequestHandle, SelectionReason


@dataclass(slots=True)
class Decision:
    """One planning decision as exploration sees it: the ordinary winner and what it was chosen from."""

    winner: Choice
    timings: Sequence[GraphTiming]
    population: Population
    now_ns: int


@dataclass(frozen=True, slots=True)
class ProbeSubject:
    """A decode lane's request: output room and acceptance estimates per proposal source."""

    room: int
    estimates: Mapping[str, PrefixSurvival]


@dataclass(frozen=True, slots=True)
class Funded:
    """The exploration that replaces the winner: why, and the program and cohort to run."""

    reason: SelectionReason
    choice: Choice


BOUND_MARGIN = 1e-9
"""Relative widening of the probe gain bound's terms: rounding differs by a few 1e-16."""

_UNSEEN = object()  # a probe basis not computed yet in this search


class Explorer:
    """Funded exploration choices for one catalog (see the module docstring)."""

    def __init__(self, graphs: Sequence[GraphDescriptor], infos: Sequence[GraphInfo], *,
                 max_depth: int, alpha: float, fixed_width: bool, probes_win_as_plans: bool = False) -> None:
        self.graphs = tuple(graphs)
        self.infos = tuple(infos)
        self.index = {g.id: i for i, g in enumerate(self.graphs)}
        self.keys = tuple(g.cost_key() for g in self.graphs)
        self.max_depth = max_depth
        self.alpha = alpha
        self.fixed_width = fixed_width
        self.probes_win_as_plans = probes_win_as_plans  # ``PolicyConfig.probes_win_as_plans``
        # every program a probe may run (``_measured_programs`` picks among them): catalog index, and the
        # most tokens it commits for a lane, 1 + min(W - 1, D)
        self._probe_programs = tuple((i, 1 + _draft_cap(g)) for i, g in enumerate(self.graphs)
                                     if g.kind in GENERATION_KINDS and self.infos[i].source is not None)
        self._programs_for: Decision | None = None  # the decision ``_by_source`` was built for
        self._stale_for: Sequence[GraphTiming] | None = None  # the timings ``_stale`` was read from
        self._stale: list[int] = []
        self._by_source: dict[str, _SourceView] = {}
        self._programs_timings: Sequence[GraphTiming] | None = None  # the timings ``_programs_of`` was read from
        self._programs_of: dict[str, list[WidthProgram]] = {}

    def choose(self, decision: Decision, accounts: ExplorationAccounts, cost: CostModel,
               subject: Callable[[RequestHandle], ProbeSubject]) -> Funded | None:
        if decision.winner.reason is not SelectionReason.ORDINARY:
            return None  # discovery (or nothing measured) comes first
        refresh = accounts.can_begin(SelectionReason.TIMING_REFRESH)
        learn = accounts.can_begin(SelectionReason.ACCEPTANCE_LEARNING) and not self.fixed_width
        if not (refresh or learn):
            return None
        alternatives = self._stale_choices(decision) if refresh else {}
        stale = stale_alternatives(cost, {k: c.score for k, c in alternatives.items()}, decision.now_ns)
        # a refresh takes precedence over any probe, so probes are only ranked without one
        probe = self._best_probe(decision, subject) if learn and not (refresh and stale) else None
        pick = choose_exploration(accounts, stale, [probe[0]] if probe else [])
        if pick is None:
            return None
        if pick.reason is SelectionReason.TIMING_REFRESH:
            return Funded(pick.reason, alternatives[pick.choice.key].choice())
        return Funded(pick.reason, self._probe_choice(decision, pick.choice, probe[1]))

    def would_fund(self, decision: Decision, accounts: ExplorationAccounts, cost: CostModel,
                   subject: Callable[[RequestHandle], ProbeSubject]) -> bool:
        """Whether ``choose`` would fund anything, stopping at the first qualifying candidate.

        With work queued the core cannot run a funded plan anyway (A8); it only
        needs to know that one is due, not which, so the probes of the remaining
        lanes are never built or ranked.
        """
        if decision.winner.reason is not SelectionReason.ORDINARY:
            return False
        if accounts.can_begin(SelectionReason.TIMING_REFRESH):
            alternatives = self._stale_choices(decision)
            if stale_alternatives(cost, {k: c.score for k, c in alternatives.items()}, decision.now_ns):
                return True
        learn = accounts.can_begin(SelectionReason.ACCEPTANCE_LEARNING) and not self.fixed_width
        if learn and self.probes_win_as_plans:
            return self._best_probe(decision, subject) is not None  # the whole search: the gate reads the best
        bases: dict[tuple, ProbeBasis | None] = {}
        return learn and any(self._bests(decision, lane, subject, bases) for lane in self._probe_lanes(decision))

    # -- timing refresh (D7) -------------------------------------------------

    def _stale_choices(self, decision: Decision) -> dict[CostKey, Evaluated]:
        """Best cohort of every measured stale program other than the winner, one per cost key.

        Only scores are needed to rank them; the lanes of the one a refresh runs are built then.
        """
        winner_key = decision.winner.graph.cost_key()
        indices = [i for i in self._stale_indices(decision.timings) if self.keys[i] != winner_key]
        if not indices:
            return {}
        found = evaluate_scores(self.graphs, decision.timings, decision.population, self.infos, indices,
                                    decision.winner.selection)
        best: dict[CostKey, Evaluated] = {}
        for index, choice in found.items():
            key = self.keys[index]
            if key not in best or choice.score > best[key].score:
                best[key] = choice
        return best

    def _stale_indices(self, timings: Sequence[GraphTiming]) -> list[int]:
        """Catalog positions of the measured, stale programs.

        Timing lists are never mutated (``CatalogTiming`` builds a new one on
        every change), so one scan per list is enough; most plans reuse it.
        """
        if self._stale_for is not timings:
            self._stale_for = timings
            self._stale = [i for i, t in enumerate(timings) if t.known and not t.fresh]
        return self._stale

    # -- acceptance learning (D8) --------------------------------------------

    def _best_probe(self, decision: Decision, subject) -> tuple[ProbeCandidate, RequestHandle] | None:
        """The probe that ranking every lane's candidates together would put first (D8).

        Lanes are evaluated in decreasing order of an upper bound on their
        gain per ms, and the search stops once no bound reaches the best gain
        found: none of those lanes' candidates could rank first. Equal rank
        keys go to the earlier lane, then the earlier candidate, as the stable
        sort over all lanes in lane order does. Lanes are compared by their
        terms' rank keys; only the winner becomes a ``ProbeCandidate``.
        """
        if self.probes_win_as_plans and not self._some_probe_may_win(decision):
            return None  # what the search finds would fail ``_wins_as_plan``: no lane is read
        lanes = self._probe_lanes(decision)
        bounds = [self._gain_bound(decision, lane) for lane in lanes]
        best = None  # (rank key, lane position, candidate position, lane best)
        bases: dict[tuple, ProbeBasis | None] = {}
        for position in sorted((i for i, b in enumerate(bounds) if b is not None), key=lambda i: -bounds[i]):
            if best is not None and bounds[position] < -best[0][0]:
                break
            lane = lanes[position]
            for at, found in enumerate(self._bests(decision, lane, subject, bases)):
                entry = (found.key, position, at, found)
                if best is None or entry[:3] < best[:3]:
                    best = entry
        if best is None:
            return None
        _, position, _, found = best
        candidate = found.candidate(lanes[position].room, lanes[position].price, self.alpha)
        if self.probes_win_as_plans and not _wins_as_plan(candidate, decision):
            return None
        return candidate, lanes[position].handle

    def _some_probe_may_win(self, decision: Decision) -> bool:
        """Whether any lane's probe could pass ``_wins_as_plan``; when none can, the search is skipped.

        A probe program of draft cap c = min(W - 1, D) offers a lane at most c
        drafts, each surviving with probability at most one, so it commits at
        most 1 + c tokens in its duration T: its optimistic rate is at most the
        highest decoder price (the probed lanes are priced decoders) times
        (1 + c) per ms of T, the same product the probe
        terms compute with every factor at least as large (rounding is monotone),
        widened by ``BOUND_MARGIN``. ``_wins_as_plan`` then subtracts the waiting
        cost, which depends on T alone. Every measured program of a proposal
        source is bounded (the search ranks only the fastest per draft cap), so
        the test reads the timings alone. On a busy batch whose speculative
        programs cost far more than the ordinary round (the bundled model on a
        CPU at 16 streams), no program passes and the per-lane search never runs.
        """
        price = max(decision.population.decoders.token_price, default=0.0)
        if not price > 0:
            return False  # no priced decoder: no lane to probe, so the search finds nothing either
        age, target, timings = decision.population.active_age_price, decision.winner.score, decision.timings
        scale = (1.0 + BOUND_MARGIN) * NS_PER_MS
        for index, tokens in self._probe_programs:  # a superset of what the search ranks: the bound only loosens
            timing = timings[index]
            if timing.known and price * tokens * scale / timing.duration_ns \
                    - 0.5 * (timing.duration_ns / NS_PER_MS) * age >= target:
                return True
        return False

    def _bests(self, decision: Decision, lane: "_PricedLane", subject,
               bases: dict[tuple, ProbeBasis | None]) -> list["_LaneBest"]:
        """``_lane_bests`` of one lane: from the means and weights the population keeps, when it
        keeps them, else from the request's estimates (``subject``; its room is the lane's)."""
        if lane.estimates is None:
            return self._lane_bests(decision, subject(lane.handle), lane.price, bases)
        return self._bests_of(decision, lane.estimates, lane.room, lane.price, bases)

    def _gain_bound(self, decision: Decision, lane: "_PricedLane") -> float | None:
        """At least the gain per ms of any probe of the lane; None when it has none.

        A probe's expected output is its ordinary depths' expected output
        plus, per added draft, at most the survival reached at the ordinary
        depth (the estimates stay nonincreasing, and optimism is capped by that
        envelope); the ordinary rate is that same ordinary expected output.
        Both come from the lane's selection means and gains (what the probe
        reads, summed in another order), so the bound widens each side by
        ``BOUND_MARGIN``, far beyond any rounding. Without them, the ordinary
        output is bounded by one token, and each draft by one.

        Per deeper program of duration T the gain per ms is
        ``price * ((high + added_drafts * added) * K/T - low * F) * K/T`` with
        K = (1 + margin) * ns per ms and F = (1 - margin) * ns per ms / the
        winner's duration; the view keeps K/T per program (``_deeper``).
        """
        room, price = lane.room, lane.price
        floor_scale = (1.0 - BOUND_MARGIN) * NS_PER_MS / decision.winner.timing.duration_ns
        best = None
        for source, selected in lane.gains.items():
            view = self._source_view(decision, source)
            if room > view.deepest + 1:
                ordinary_depth, deeper = view.full_coefficients
            else:
                ordinary_depth, deeper = _coefficients(*view.depths_with_room(room))
            if not deeper:
                continue
            means = lane.survival.get(source)
            if selected is not None and means is not None and ordinary_depth < len(selected) <= len(means) + 1:
                low = high = 1.0 + selected[ordinary_depth]
                added = means[ordinary_depth - 1] ** self.alpha if ordinary_depth else 1.0
            else:
                low, high, added = 1.0, 1.0 + ordinary_depth, 1.0
            floor = low * floor_scale
            for drafts, per_ms in deeper:
                gain = ((high + drafts * added) * per_ms - floor) * per_ms
                if best is None or gain > best:
                    best = gain
        return None if best is None else price * best

    def _probe_lanes(self, decision: Decision) -> list["_PricedLane"]:
        """The winner's priced decode lanes, in lane order, read from the decision's population.

        The room is the one ``subject`` reports (both read the request at
        this decision); a lane's proposal sources are the keys of its gains.
        """
        d = decision.population.decoders
        # by slot: within one population every slot holds one live request (a handle's
        # generated hash is a Python call, an int's is not); the handle itself is checked
        at = {h.slot: i for i, h in enumerate(d.handle)}
        kept = len(d.gains) == len(d)  # the core keeps them; otherwise bounds fall back to the loose form
        estimates = d.estimates if len(d.estimates) == len(d) else None  # likewise (else: ask ``subject``)
        out = []
        for lane in decision.winner.lanes:
            i = at.get(lane.handle.slot)
            if i is not None and d.handle[i] is not lane.handle and d.handle[i] != lane.handle:
                i = None  # another generation of the slot: not in this population
            if lane.phase is LanePhase.DECODE and i is not None and d.token_price[i] > 0:
                gains = d.gains[i] if kept else dict.fromkeys(d.survival[i])
                out.append(_PricedLane(lane.handle, d.token_price[i], d.room[i], gains, d.survival[i],
                                       None if estimates is None else estimates[i]))
        return out

    def _lane_bests(self, decision: Decision, request: ProbeSubject, price: float,
                    bases: dict[tuple, ProbeBasis | None] | None = None) -> list["_LaneBest"]:
        """One lane's best probe per source, in source order (an empty list: the lane has none)."""
        estimates = {source: e.means_and_weights(self.max_depth) for source, e in request.estimates.items()}
        return self._bests_of(decision, estimates, request.room, price, {} if bases is None else bases)

    def _bests_of(self, decision: Decision, estimates: Mapping[str, tuple[Sequence[float], Sequence[float]]],
                  room: int, price: float, bases: dict[tuple, ProbeBasis | None]) -> list["_LaneBest"]:
        """``_lane_bests`` from (means, weights) per source, sharing each ``probe_basis`` through ``bases``.

        Ranked together with the other lanes, only a source's best candidate
        can come first (the others rank after it), so only it is kept. The
        basis is what a lane's probe terms depend on apart from its price
        (``lane_probe_terms`` computes it first), so lanes with the same means
        and weights, and the same room wherever the room limits a depth, share
        it: a batch of requests admitted together, at the prior, has one for
        all. Only the priced step runs per lane.
        """
        found = []
        for source, (means, weights) in estimates.items():
            view = self._source_view(decision, source)
            if not view.programs:
                continue
            key = (source, means, weights, room if room <= view.deepest + 1 else None)
            basis = bases.get(key, _UNSEEN)  # None is a basis too: no output left
            if basis is _UNSEEN:
                basis = bases[key] = probe_basis(means, weights, room, view.ordinary, self.alpha, view.programs)
            depth, rate, term = best_priced_term(basis, view.ordinary, price)
            if term is not None:
                found.append(_LaneBest(term_rank_key(term), means, weights, view.ordinary, depth, rate, term))
        return found

    def _source_view(self, decision: Decision, source: str) -> "_SourceView":
        """``_programs`` and ``_ordinary`` of one decision and source, built once (the same for every lane)."""
        if self._programs_for is not decision:
            self._programs_for, self._by_source = decision, {}
        found = self._by_source.get(source)
        if found is None:
            found = self._by_source[source] = _SourceView.of(self._programs(source, decision.timings),
                                                             self._ordinary(decision.winner, source))
        return found

    def _programs(self, source: str, timings: Sequence[GraphTiming]) -> list[WidthProgram]:
        """Measured speculative programs of ``source``: per draft cap min(W - 1, D), only the best one.

        For one lane, programs with the same cap offer the same depth and add
        the same prefixes, so the one with the shortest duration has both the
        higher rate and the higher gain per ms; equal durations go to the
        smaller geometry (P, then B), as the probe ranking would. Keeping
        only it changes no outcome and spares ranking every batch size.
        Kept per timing list (the core's lists are replaced, never changed,
        when a timing changes), like the stale list.
        """
        if self._programs_timings is not timings:
            self._programs_timings, self._programs_of = timings, {}
        found = self._programs_of.get(source)
        if found is None:
            found = self._programs_of[source] = self._measured_programs(source, timings)
        return found

    def _measured_programs(self, source: str, timings: Sequence[GraphTiming]) -> list[WidthProgram]:
        best: dict[int, WidthProgram] = {}
        for i, g in enumerate(self.graphs):
            if g.kind not in GENERATION_KINDS or self.infos[i].source != source or not timings[i].known:
                continue
            program = WidthProgram.of(g, timings[i].duration_ns)
            cap = min(g.width - 1, g.proposal_depth)
            held = best.get(cap)
            if held is None or _order(program) < _order(held):
                best[cap] = program
        return list(best.values())

    def _ordinary(self, winner: Choice, source: str) -> WidthProgram:
        """The winner as one lane of ``source`` sees it: no drafts of that source if it draws none."""
        graph = winner.graph
        if self.infos[self.index[graph.id]].source == source:
            return WidthProgram.of(graph, winner.timing.duration_ns)
        return WidthProgram(graph.id, 1, 0, winner.timing.duration_ns, graph.target_rows, graph.batch_capacity)

    def _probe_choice(self, decision: Decision, probe: ProbeCandidate, handle: RequestHandle) -> Choice:
        """The probe program's own best cohort if it gives the lane its full depth; else the lane alone."""
        index = self.index[probe.program.key]
        evaluated = evaluate_scores(self.graphs, decision.timings, decision.population, self.infos, [index],
                                    decision.winner.selection).get(index)
        found = evaluated.choice() if evaluated is not None else None
        if found is not None and any(
            lane.handle.slot == handle.slot and lane.handle == handle  # the slot first: an int comparison
            and (lane.ceiling or lane.query_length) - 1 >= probe.offered_depth
            for lane in found.lanes
        ):
            return found
        graph, timing = self.graphs[index], decision.timings[index]
        rows = probe.offered_depth + 1
        lane = PlannedLane(handle, LanePhase.DECODE, query_length=rows,
                           ceiling=rows if self.infos[index].prefix_limit else 0,
                           expected_tokens=min(float(probe.lane.remaining_output), probe.optimistic_rate
                                               * probe.program.duration_ns / 1e6 / probe.lane.token_value))
        return Choice(graph, (lane,), timing, probe.optimistic_rate, 0.0, None)


@dataclass(slots=True)
class _PricedLane:
    """A decode lane of the winner as the probe search first reads it, before its request is consulted."""

    handle: RequestHandle
    price: float  # token price (> 0)
    room: int  # output tokens it may still commit
    gains: Mapping[str, Sequence[float] | None]  # per proposal source: its selection gains, None if not kept
    survival: Mapping[str, Sequence[float]]  # per proposal source: its selection means (nonincreasing)
    # per proposal source: its estimates' (means, weights), when the population keeps them
    estimates: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None


@dataclass(frozen=True, slots=True)
class _SourceView:
    """One decision's probe programs of one source, and the winner as a lane of that source sees it.

    ``full_depths`` is ``depths_with_room`` for a lane with room to spare
    (more than ``deepest`` + 1 tokens), where every program offers its whole
    draft cap: most lanes, so it is computed once per decision.
    """

    programs: list[WidthProgram]
    ordinary: WidthProgram
    deepest: int  # the largest draft cap min(W - 1, D) among the programs and the ordinary one
    full_depths: tuple[int, list[tuple[int, int]]]
    full_coefficients: tuple[int, list[tuple[int, float]]]  # ``_coefficients`` of ``full_depths``

    @classmethod
    def of(cls, programs: list[WidthProgram], ordinary: WidthProgram) -> "_SourceView":
        deepest = max(_draft_cap(p) for p in (ordinary, *programs))
        full = _depths_with_room(programs, ordinary, deepest + 2)
        return cls(programs, ordinary, deepest, full, _coefficients(*full))

    def depths_with_room(self, room: int) -> tuple[int, list[tuple[int, int]]]:
        return _depths_with_room(self.programs, self.ordinary, room)


def _coefficients(ordinary_depth: int, deeper: list[tuple[int, int]]) -> tuple[int, list[tuple[int, float]]]:
    """``_gain_bound``'s per-program numbers: (drafts added over the ordinary depth, K / duration)."""
    scale = (1.0 + BOUND_MARGIN) * NS_PER_MS
    return ordinary_depth, [(depth - ordinary_depth, scale / duration_ns) for depth, duration_ns in deeper]


def _draft_cap(program: WidthProgram | GraphDescriptor) -> int:
    """Drafts the program verifies for a lane whose room never binds: min(W - 1, D)."""
    return max(0, min(program.width - 1, program.proposal_depth))


def _depths_with_room(programs: Sequence[WidthProgram], ordinary: WidthProgram,
                      room: int) -> tuple[int, list[tuple[int, int]]]:
    """For a lane of ``room`` output tokens: the ordinary depth, and (depth, duration) of each
    program that adds depth and leaves output to learn for (``lane_probe_terms``'s filter)."""
    ordinary_depth = ordinary.offered_depth(room)
    deeper = []
    for program in programs:
        depth = program.offered_depth(room)
        if depth > ordinary_depth and depth + 1 < room:
            deeper.append((depth, program.duration_ns))
    return ordinary_depth, deeper


@dataclass(frozen=True, slots=True)
class _LaneBest:
    """A lane's best probe term for one source, and the numbers that build its ``ProbeCandidate``."""

    key: tuple  # the candidate's rank key
    means: tuple[float, ...]
    weights: tuple[float, ...]
    ordinary: WidthProgram
    ordinary_depth: int
    ordinary_rate: float
    term: tuple

    def candidate(self, room: int, price: float, alpha: float) -> ProbeCandidate:
        lane = ProbeLane(self.means, self.weights, room, self.ordinary, token_value=price, alpha=alpha)
        return term_candidate(lane, self.ordinary_depth, self.ordinary_rate, self.term)


def _wins_as_plan(candidate: ProbeCandidate, decision: Decision) -> bool:
    """``PolicyConfig.probes_win_as_plans``: D8's "can win under the optimistic estimate" read for the plan.

    The probe replaces the ordinary winner for its whole duration, so it must beat the winner's U6 score
    as a plan would: the probed lane's priced tokens under optimism per ms of the probe, less U6's
    waiting cost of every active decoder over the probe's duration (the lanes it leaves out wait).
    The lane's delivery and age credits are left out, so the test errs toward not probing
    (docs/scheduling-utility.md, "Departures from the spec").
    """
    t_ms = candidate.program.duration_ns / NS_PER_MS
    rate = candidate.optimistic_rate - 0.5 * t_ms * decision.population.active_age_price
    return rate >= decision.winner.score


def _order(program: WidthProgram) -> tuple[int, int, int]:
    return (program.duration_ns, program.target_rows, program.batch_capacity)
