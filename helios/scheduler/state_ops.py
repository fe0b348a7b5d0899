"""State operations in selection: restores, intermediate and terminal snapshots (P1-P4, P6, K2).

The core keeps, per request, whether it waits for a restore (admitted with
``restore_row >= 0``), for an intermediate snapshot at a prompt point it has
reached (K2), or for its terminal snapshot (P6). ``best_state_choice`` scores
every prepared RESTORE and SNAPSHOT program against the population the ordinary
decision saw:

- a prerequisite that enables inference is scored jointly with every prepared
  following shape (prefill, width-one mixed) by ``prerequisites.best_pair``
  (P1, P2), and by the continuation index (P4) over the rows' whole remaining
  prompt; the better score stands;
- a snapshot program with only terminal rows scores their terminal value
  (terminal_value + terminal_age_price * sigma * (A + T)) over T (P6);
- an unknown duration scores its useful value (U8), as any graph's.

The winner carries the prerequisite's own duration T (P3): the lookahead's F
never enters the plan, timing or cost learning, and only the first graph is
planned. State lanes commit no token and earn no service.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flare_contract.graphs import GraphDescriptor, GraphKind
from helios.scheduler.prerequisites import (
    Continuation,
    PairShape,
    Ready,
    Terminal,
    Waiting,
    best_pair,
    chain_rate,
    continuation_index,
)
from helios.scheduler.checkpoints import ExtraWorkAllowance
from helios.scheduler.select.population import Population
from helios.scheduler.select.timing import GraphTiming
from helios.scheduler.service import MIN_RATE_PER_MS, ShapeTiming, reference_interval_ms
from helios.scheduler.types import LanePhase, PlannedLane, RequestHandle
from helios.scheduler.utility import PrefillTimes, prompt_chunk_value

STATE_KINDS = (GraphKind.RESTORE, GraphKind.SNAPSHOT)


@dataclass(frozen=True, slots=True)
class Enabled:
    """A row a state program makes prompt-ready: a restore, or an intermediate snapshot (K2).

    ``start``/``remaining`` describe the prompt it continues with; ``price`` is 1 + f/x and
    ``first_token`` the value of its first output (as ``Prompters``); ``tokens`` the committed
    positions the copy covers; ``row`` the checkpoint row read (restore) or -1.
    """

    handle: RequestHandle
    start: int
    remaining: int
    price: float
    first_token: float
    tokens: int
    row: int = -1
    recency: int = 0
    decode_value: float | None = None  # set when it continues by decoding (a snapshot at its prompt end)

    @property
    def decodes(self) -> bool:
        return self.decode_value is not None


@dataclass(frozen=True, slots=True)
class Held:
    """A finished request holding its slot for the terminal snapshot (P6): age since validated termination."""

    handle: RequestHandle
    age_ms: float
    tokens: int
    recency: int = 0


@dataclass(frozen=True, slots=True)
class StateInputs:
    """Everything one state decision reads, built by the core from the same snapshot as the ordinary one."""

    restores: Sequence[Enabled]
    snapshots: Sequence[Enabled]
    held: Sequence[Held]
    population: Population  # the ready rows (decoders, prompters)
    decoder_age_price: float  # sum of c over active decoders
    terminal_value: float
    terminal_age_price: float
    prefill_times: PrefillTimes | None


@dataclass(frozen=True, slots=True)
class StateChoice:
    """The best state program and its first-graph lanes; ``score`` as a ``Choice``'s."""

    graph: GraphDescriptor
    timing: GraphTiming
    lanes: tuple[PlannedLane, ...]
    score: float
    known: bool

    def key(self) -> tuple:
        return (not self.known, self.score)


@dataclass(frozen=True, slots=True)
class _Following:
    """A prepared inference shape that can serve a newly ready prompt row."""

    graph: GraphDescriptor
    ms: float
    prompt_rows: int  # rows that may carry a prompt (prefill: B; mixed: one)
    decode_rows: int  # rows for decoders (mixed: B - 1)


def best_state_choice(graphs: Sequence[GraphDescriptor], timings: Sequence[GraphTiming],
                      inputs: StateInputs) -> StateChoice | None:
    """The best state program for this decision, or None when no state operation is pending."""
    if not (inputs.restores or inputs.snapshots or inputs.held):
        return None
    following = _following_shapes(graphs, timings)
    sigma = _terminal_sigma(graphs, timings, len(inputs.held))
    rows: dict = {}  # what each following shape's pairs read whichever state program goes first (_shape_rows)
    best = None
    for graph, timing in zip(graphs, timings):
        if graph.kind is GraphKind.RESTORE and inputs.restores:
            found = _score_program(graph, timing, inputs.restores, (), inputs, following, sigma, rows)
        elif graph.kind is GraphKind.SNAPSHOT and (inputs.snapshots or inputs.held):
            found = _score_program(graph, timing, inputs.snapshots, inputs.held, inputs, following, sigma, rows)
        else:
            continue
        if found is not None and (best is None or found.key() > best.key()):
            best = found
    return best


def _following_shapes(graphs, timings) -> list[_Following]:
    """Prefill, width-one decode (plain or draft-keeping; the speculative widths only where the catalog
    has no width-one decode) and width-one mixed programs; known ones only, plus, for prompt rows or
    decode rows that no known shape serves, the unknown shapes serving them (compared optimistically)."""
    shapes = []
    plain = any(g.kind is GraphKind.DECODE or (g.kind is GraphKind.SPECULATIVE and g.width == 1) for g in graphs)
    for g, t in zip(graphs, timings):
        if g.kind is GraphKind.PREFILL:
            shapes.append(_Following(g, t.duration_ns / 1e6, g.batch_capacity, 0))
        elif g.kind is GraphKind.DECODE or (g.kind is GraphKind.SPECULATIVE and (g.width == 1 or not plain)):
            # every decode shape the loaded mode has: with speculation loaded the draft-keeping width-one
            # programs replace plain decode, and ``fixed`` keeps one wider width only (load-time
            # selection, C6); a following round is valued at one token per row either way
            shapes.append(_Following(g, t.duration_ns / 1e6, 0, g.batch_capacity))
        elif g.kind is GraphKind.MIXED and g.width == 1 and g.prefill_capacity > 0:
            shapes.append(_Following(g, t.duration_ns / 1e6, 1, g.batch_capacity - 1))
    known = [s for s in shapes if s.ms > 0]
    # a role (prompt rows, decode rows) no measured shape serves is served by the unmeasured shapes
    # that have it, compared optimistically (U8): a decoder waiting for its prompt-end snapshot while
    # only prefills are measured would otherwise have no pair, no state choice, and wait for good
    for serves in (lambda s: s.prompt_rows > 0, lambda s: s.decode_rows > 0):
        if not any(serves(s) for s in known):
            known += [s for s in shapes if s.ms <= 0 and serves(s) and s not in known]
    return known


def _terminal_sigma(graphs, timings, held: int) -> float | None:
    """U5 for the snapshot family: K held terminal rows, the measured snapshot shape minimizing T/min(B, K)."""
    if held < 1:
        return None
    shapes = [ShapeTiming(t.duration_ns / 1e6, g.batch_capacity)
              for g, t in zip(graphs, timings) if g.kind is GraphKind.SNAPSHOT and t.known]
    return reference_interval_ms(held, held, shapes)


def _terminal_values(held: Sequence[Held], inputs: StateInputs, t_ms: float,
                     sigma: float | None) -> list[tuple[float, Held]]:
    """P6: terminal_value + terminal_age_price * sigma * (A + T), best first (no sigma: no age term)."""
    slope = inputs.terminal_age_price * sigma if sigma else 0.0
    valued = [(inputs.terminal_value + slope * (h.age_ms + t_ms), h) for h in held]
    return sorted(valued, key=lambda p: (-p[0], p[1].recency))


def _row_value(row: Enabled, capacity: int, times: PrefillTimes | None) -> float:
    tokens = min(capacity, row.remaining)
    return prompt_chunk_value(tokens, row.remaining, row.price, row.first_token, times)


def _ready_prompters(pop: Population, capacity: int, times: PrefillTimes | None) -> list[Ready]:
    p = pop.prompters
    return [Ready(prompt_chunk_value(min(capacity, left), left, price, first, times))
            for left, price, first in zip(p.remaining, p.price, p.first_token)]


def _ready_decoders(pop: Population) -> list[Ready]:
    d = pop.decoders
    return [Ready(tp + dp + credit, slope)
            for tp, dp, credit, slope, room in zip(d.token_price, d.delivery_price, d.age_credit, d.age_slope, d.room)
            if room > 0]


def _waiting(inputs: StateInputs) -> Waiting:
    return Waiting(inputs.decoder_age_price, inputs.terminal_age_price, len(inputs.held))


def _score_program(graph, timing, enabled: Sequence[Enabled], held: Sequence[Held], inputs: StateInputs,
                   following: Sequence[_Following], sigma: float | None, rows: dict) -> StateChoice | None:
    t_ms = timing.duration_ns / 1e6
    terminals = _terminal_values(held, inputs, t_ms, sigma)
    best = _terminal_only(graph, timing, terminals, inputs) if terminals else None
    pending = None  # the best pair so far, built only if nothing later beats it (the first best stands)
    for shape in following:
        found = _pair(graph, timing, enabled, terminals, inputs, shape, rows)
        if found is not None and (best is None or found[0] > best.key()) and (
                pending is None or found[0] > pending[0]):
            pending = found
    if pending is not None and (best is None or pending[0] > best.key()):
        best = _pair_choice(*pending[1])
    chain = _chain(graph, timing, enabled, terminals, inputs)
    if chain is not None and (best is None or chain.key() > best.key()):
        best = chain
    return best


def _terminal_only(graph, timing, terminals, inputs: StateInputs) -> StateChoice:
    """A snapshot program completing terminal rows alone: their value over T (P6)."""
    taken = terminals[:graph.batch_capacity]
    value = sum(v for v, _ in taken)
    lanes = tuple(_snapshot_lane(h.handle, h.tokens) for _, h in taken)
    if not timing.known:
        return StateChoice(graph, timing, lanes, value, False)
    t_ms = timing.duration_ns / 1e6
    held = inputs.decoder_age_price + inputs.terminal_age_price * len(inputs.held)
    return StateChoice(graph, timing, lanes, value / t_ms - 0.5 * t_ms * held, True)


@dataclass(frozen=True, slots=True)
class _ShapeRows:
    """What the pairs of one set of enabled rows with one following shape read, whichever state program
    goes first: the newly ready rows in value order, their values there, and the rows already ready
    (``best_state_choice`` builds it once per shape instead of once per state program and shape)."""

    prompting: list  # enabled rows without a decode: newly ready prompters, best first
    decoding: list  # enabled rows that decode once ready, best first
    newly: list  # prefill: each prompting row's value there; decode and mixed: each decoding row's
    ready: list  # the already ready rows the following shape's rows may serve instead (``Ready``)
    lead: float = 0.0  # mixed: the best newly ready prompter's value in the prompt row
    ready_prompt: float = 0.0  # mixed: the best already ready prompter's


def _shape_rows(enabled, inputs: StateInputs, shape: _Following) -> _ShapeRows:
    times, capacity, pop = inputs.prefill_times, shape.graph.prefill_capacity, inputs.population
    prompting = sorted((r for r in enabled if not r.decodes),
                       key=lambda r: (-_row_value(r, capacity, times), r.recency))
    decoding = sorted((r for r in enabled if r.decodes), key=lambda r: (-r.decode_value, r.recency))
    if shape.decode_rows == 0:  # prefill
        return _ShapeRows(prompting, decoding, [_row_value(r, capacity, times) for r in prompting],
                          _ready_prompters(pop, capacity, times))
    newly, ready = [r.decode_value for r in decoding], _ready_decoders(pop)
    if shape.prompt_rows == 0:  # decode
        return _ShapeRows(prompting, decoding, newly, ready)
    p = pop.prompters
    ready_prompt = max((prompt_chunk_value(min(capacity, left), left, price, first, times)
                        for left, price, first in zip(p.remaining, p.price, p.first_token)), default=0.0)
    lead = _row_value(prompting[0], capacity, times) if prompting else 0.0
    return _ShapeRows(prompting, decoding, newly, ready, lead, ready_prompt)


def _pair(graph, timing, enabled, terminals, inputs: StateInputs, shape: _Following,
          rows: dict | None = None) -> tuple[tuple, tuple] | None:
    """P1/P2 for this program followed by ``shape``: the exact joint cohort's key (``StateChoice.key``) and
    the arguments of ``_pair_choice``, which builds the first graph's lanes (only the winner's are built).

    Prefill rows carry prompts (newly and already ready prompters compete for them); decode rows
    carry decoders. A mixed shape has one prompt row and B - 1 decode rows; its prompt row is a
    newly ready prompter, or a ready one, or absent (spec "Mixed execution contract"): each case
    leaves an exact pair problem for the decode rows, and the best case stands.
    """
    if not enabled:
        return None
    key = (id(enabled), shape.graph.id)
    found = None if rows is None else rows.get(key)
    if found is None:
        found = _shape_rows(enabled, inputs, shape)
        if rows is not None:
            rows[key] = found
    prompting, decoding = found.prompting, found.decoding
    first_ms, first_rows = timing.duration_ns / 1e6, graph.batch_capacity
    held, waiting = [Terminal(v) for v, _ in terminals], _waiting(inputs)
    cases = []  # (choice, rows the prerequisite serves first)
    if shape.decode_rows == 0:  # prefill
        pair = PairShape(first_ms, first_rows, shape.ms, shape.prompt_rows)
        choice = best_pair(pair, found.newly, found.ready, held, waiting)
        cases.append((choice, [], prompting))
    elif shape.prompt_rows == 0:  # decode
        pair = PairShape(first_ms, first_rows, shape.ms, shape.decode_rows)
        choice = best_pair(pair, found.newly, found.ready, held, waiting)
        cases.append((choice, [], decoding))
    else:
        cases += _mixed_cases(pair_ms=(first_ms, shape.ms), rows=(first_rows, shape.decode_rows),
                              prompting=prompting, decoding=decoding, held=held, waiting=waiting, found=found)
    best = None
    for choice, fixed, newly in cases:
        if choice is None:
            continue
        key = (not choice.known, choice.score)
        if best is None or key > best[0]:
            best = (key, (graph, timing, choice, fixed + newly[:choice.served], enabled, terminals))
    return best


def _mixed_cases(pair_ms, rows, prompting, decoding, held, waiting, found: _ShapeRows):
    """A mixed following graph: its prompt row newly ready (then k >= 0 newly ready decoders), or
    the best ready prompter's, or empty (then k >= 1)."""
    (first_ms, following_ms), (first_rows, decode_rows) = pair_ms, rows
    ready, newly = found.ready, found.newly
    cases = []
    if prompting:
        lead = prompting[0]
        pair = PairShape(first_ms, first_rows - 1, following_ms, decode_rows)
        choice = best_pair(pair, newly, ready, held, waiting, least=0, fixed=found.lead)
        cases.append((choice, [lead], decoding))
    pair = PairShape(first_ms, first_rows, following_ms, decode_rows)
    cases.append((best_pair(pair, newly, ready, held, waiting, fixed=found.ready_prompt), [], decoding))
    return cases


def _pair_choice(graph, timing, choice, served, enabled, terminals) -> StateChoice:
    """The first graph's lanes: the newly ready rows the following graph serves, the terminal rows,
    then other waiting rows in the spare rows (they advance at no extra physical cost, P2)."""
    lanes = [_enabled_lane(graph, r) for r in served]
    lanes += [_snapshot_lane(h.handle, h.tokens) for _, h in terminals[:choice.terminals]]
    chosen = {r.handle for r in served}
    spare = max(graph.batch_capacity - len(lanes), 0)
    lanes += [_enabled_lane(graph, r) for r in enabled if r.handle not in chosen][:spare]
    return StateChoice(graph, timing, tuple(lanes), choice.score, choice.known)


def _chain(graph, timing, enabled, terminals, inputs: StateInputs) -> StateChoice | None:
    """P4: each enabled row's whole remaining prompt, V in a further F ms, contributes V*T/(T+F)."""
    enabled = [r for r in enabled if not r.decodes]
    if not enabled:
        return None
    times = inputs.prefill_times
    t_ms = timing.duration_ns / 1e6
    continuing = [(Continuation(r.remaining * r.price + r.first_token, times.ms(r.remaining) if times else 0.0), r)
                  for r in enabled]
    continuing.sort(key=lambda p: (-continuation_index(p[0], t_ms), p[1].recency))
    choice = chain_rate(t_ms, graph.batch_capacity, [c for c, _ in continuing],
                        [Terminal(v) for v, _ in terminals], _waiting(inputs))
    if choice is None:
        return None
    lanes = [_enabled_lane(graph, r) for _, r in continuing[:choice.rows]]
    lanes += [_snapshot_lane(h.handle, h.tokens) for _, h in terminals[:choice.terminals]]
    return StateChoice(graph, timing, tuple(lanes), choice.score, choice.known)


def _enabled_lane(graph: GraphDescriptor, row: Enabled) -> PlannedLane:
    if graph.kind is GraphKind.RESTORE:
        return PlannedLane(row.handle, LanePhase.RESTORE, query_length=0, checkpoint_row=row.row,
                           checkpoint_tokens=row.tokens)
    return _snapshot_lane(row.handle, row.tokens)


def _snapshot_lane(handle: RequestHandle, tokens: int) -> PlannedLane:
    return PlannedLane(handle, LanePhase.SNAPSHOT, query_length=0, checkpoint_tokens=tokens)


# ---------------------------------------------------------------------------
# Per-request state-operation bookkeeping (the core holds one per request)
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class RequestOps:
    """What a request waits for, beyond prompt and output (the core's ``RequestState.ops``).

    restore_pending  admitted with ``restore_row >= 0``: not prompt-ready until its RESTORE completes
    points           K2: armed snapshot points (prompt lengths) ahead, ascending; each cuts prefill
    due              a point the prompt has reached: no prompt or decode until its SNAPSHOT completes
    terminal_since_ns  P6: validated termination of a request that asked for a terminal snapshot;
                     the slot is held (``Scheduler.holds``) until the capture completes
    allowance        K2's extra-work budget, set once both prefill and snapshot costs are known
    """

    restore_pending: bool = False
    points: list[int] | None = None  # None: not yet armed (costs unknown so far)
    due: int = 0
    terminal_since_ns: int | None = None
    allowance: ExtraWorkAllowance | None = None

    @property
    def blocked(self) -> bool:
        """Waiting for a prerequisite: neither a prompter nor a decoder now."""
        return self.restore_pending or self.due > 0

    def next_point(self, position: int) -> int | None:
        for point in self.points or ():
            if point > position:
                return point
        return None


def arm_points(ops: RequestOps, request, position: int, times: PrefillTimes | None,
               snapshot_ms: float | None, fraction: float) -> None:
    """K2: arm the engine's snapshot points, best first, while their extra work fits the allowance.

    An extra cut costs the prefill time a split adds (none where a chunk ends anyway: a message
    endpoint or the prompt end) plus one snapshot copy; the budget is ``fraction`` of the
    least known time to prefill the uncached prompt. While either cost is unknown nothing is
    armed (extras are disabled) and the points stay eligible for a later decision.
    """
    if ops.points is not None:
        return
    if not request.snapshot_points:
        ops.points = []
        return
    if times is None or snapshot_ms is None:
        return
    prompt = request.prompt_tokens
    allowance = ExtraWorkAllowance.for_prefill(times.ms(prompt - position), fraction)
    armed = []
    for point in request.snapshot_points:
        if not position < point <= prompt or point in armed:
            continue
        free_cut = point == prompt or point in request.endpoints
        split = 0.0 if free_cut else max(times.ms(point - position) + times.ms(prompt - point)
                                         - times.ms(prompt - position), 0.0)
        if allowance.admits(split + snapshot_ms):
            allowance.spend(split + snapshot_ms)
            armed.append(point)
    ops.points = sorted(armed)
    ops.allowance = allowance


def snapshot_ms(graphs: Sequence[GraphDescriptor], timings: Sequence[GraphTiming]) -> float | None:
    """The least known duration of a snapshot program (one copy's cost), or None while none is measured."""
    known = [t.duration_ns / 1e6 for g, t in zip(graphs, timings) if g.kind is GraphKind.SNAPSHOT and t.known]
    return min(known, default=None)


def pending(slots, start_ns: int, policy, rate_of) -> tuple[list[Enabled], list[Enabled], list[Held]] | None:
    """The requests waiting for a state operation with nothing in flight: (restores, snapshots, held), or None.

    ``slots`` are the core's request states; ``rate_of(state)`` its token rate projected to the queue's
    end (A10), which prices the prompt a restore or intermediate snapshot enables (1 + f/x, U3).
    """
    restores, snapshots, held = [], [], []
    for s in slots:
        if s is None or s.inflight:
            continue
        ops = s.ops
        if ops.terminal_since_ns is not None:
            held.append(Held(s.handle, max(start_ns - ops.terminal_since_ns, 0) / 1e6,
                             s.request.prompt_tokens + s.produced - 1, s.last_selected_ns))
        elif s.live and ops.blocked:
            row = _enabled(s, policy, rate_of(s))
            (restores if ops.restore_pending else snapshots).append(row)
    return (restores, snapshots, held) if restores or snapshots or held else None


def _enabled(s, policy, x: float) -> Enabled:
    """A waiting request as the prompter it becomes: its prompt up to its next armed point, at its prices."""
    ops, prompt = s.ops, s.request.prompt_tokens
    congestion = policy.token_fairness / x
    point = ops.next_point(s.prompt_done)
    cut = point is not None and point < prompt
    first = policy.output_token_value + congestion if s.room() > 0 and not cut else 0.0
    tokens = s.prompt_done if ops.due else s.request.cached_tokens
    row = s.request.restore_row if ops.restore_pending else -1
    decode_value = None
    if s.prompt_done >= prompt:  # a snapshot at the prompt end: it continues by decoding
        z = s.service.delivery_rate
        delivery = policy.delivery_fairness / max(z, MIN_RATE_PER_MS) if z is not None else 0.0
        decode_value = policy.output_token_value + congestion + delivery if s.room() > 0 else 0.0
    return Enabled(s.handle, s.prompt_done, (point if cut else prompt) - s.prompt_done, 1.0 + congestion, first,
                   tokens, row, s.last_selected_ns, decode_value)


def check_state_lane(state, lane: PlannedLane, graph: GraphDescriptor) -> None:
    """Commit-time check of a state lane (A6): its request still waits for exactly this operation."""
    if state is None:
        raise ValueError(f"stale plan: {lane.handle} holds no slot")
    ops = state.ops
    expected = GraphKind.RESTORE if lane.phase is LanePhase.RESTORE else GraphKind.SNAPSHOT
    if graph.kind is not expected:
        raise ValueError(f"{graph.id}: a {lane.phase.value} lane needs a {expected.value} program")
    if state.inflight:
        raise ValueError(f"stale plan: {lane.handle} has a frame in flight")
    if lane.phase is LanePhase.RESTORE:
        ok = ops.restore_pending and state.live
    else:
        ok = ops.terminal_since_ns is not None or (state.live and ops.due > 0)
    if not ok:
        raise ValueError(f"stale plan: {lane.handle} needs no {lane.phase.value} now")


def completed(ops: RequestOps, lane: PlannedLane) -> None:
    """A state lane's frame completed: its request no longer waits for it (a held terminal may leave)."""
    if lane.phase is LanePhase.RESTORE:
        ops.restore_pending = False
    elif ops.terminal_since_ns is not None:
        ops.terminal_since_ns = None
    else:
        ops.due = 0
