"""The direct scheduler: Helios's request bookkeeping with a small selection and cost model of its own.

``DirectScheduler`` keeps the Helios core's request life (admit, commit,
complete, publication, service histories, acceptance estimates: the same
prices feed the same scores) and replaces the two parts a diagnostic run must
be able to rule out:

- ``plan``: a waiting prompt gets its next chunk (``select.chunk_program``);
  otherwise the best decode round by Helios's score and cohort rules
  (``select.best_decode``). No mixed programs, no funded timing refresh, no
  acceptance probes (spec, first section);
- duration estimates: ``cost.MovingAverageCost`` (7/8 moving average,
  unmeasured again after 30 s) instead of the median of nine.

It takes time only through ``advance_to``, like the core. Every decision is
kept (the last 100) with its scores for ``/debug/state``, and handed to an
optional ``on_decision`` callback (``--verbose`` logs it).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flare_contract.graphs import GENERATION_KINDS, CostKey, GraphDescriptor
from helios.direct import select
from helios.direct.cost import MovingAverageCost
from helios.scheduler.config import PolicyConfig
from helios.scheduler.core import Scheduler
from helios.scheduler.select.choice import Choice
from helios.scheduler.select.timing import GraphTiming, needs_feedback
from helios.scheduler.service import token_normalizer
from helios.scheduler.types import ScheduledPlan, SelectionReason
from helios.scheduler.utility import decision_log_scale, optimistic_work_score, prompt_lane_value, value_rate

DECISIONS_KEPT = 100
RUNNERS_UP = 8  # losers kept per decision


@dataclass(frozen=True, slots=True)
class RunnerUp:
    """A program that lost a decode decision, and why it could not win."""

    program: str
    score: float
    measured: bool  # False: the score is the optimistic work score (U8), not a value rate
    padding: bool  # pruned by U12: a smaller program does the same work

    def label(self) -> str:
        flags = "".join(f"({w})" for on, w in ((not self.measured, "unmeasured"), (self.padding, "padding")) if on)
        return f"{self.program}={self.score:.4g}{flags}"


@dataclass(frozen=True, slots=True)
class Decision:
    """One plan as ``/debug/state`` and ``--verbose`` show it."""

    at_ns: int
    program: str
    reason: str
    score: float  # unscaled: value per ms, or the optimistic work score while unmeasured
    estimated_ns: int
    lanes: tuple[tuple[int, str, int], ...]  # (slot, phase, prompt tokens or query length)
    runners_up: tuple[RunnerUp, ...]  # the next best decode programs, best first

    def line(self) -> str:
        lanes = " ".join(f"{slot}:{phase[0]}{n}" for slot, phase, n in self.lanes)
        others = ", ".join(r.label() for r in self.runners_up[:3])
        return (f"t={self.at_ns / 1e9:.3f}s {self.program} {self.reason} score={self.score:.4g} "
                f"est={self.estimated_ns / 1e6:.3f}ms lanes=[{lanes}] next=[{others}]")


class DirectScheduler(Scheduler):
    """Same interface as ``helios.scheduler.Scheduler``; see the module docstring for what differs."""

    def __init__(self, graphs: Sequence[GraphDescriptor], *, request_slots: int, policy: PolicyConfig | None = None,
                 speculation: str = "adaptive", on_decision: Callable[[Decision], None] | None = None) -> None:
        super().__init__(graphs, request_slots=request_slots, policy=policy, speculation=speculation)
        self.cost = MovingAverageCost(self.policy.estimate_ttl_ns)
        self.decisions: deque[Decision] = deque(maxlen=DECISIONS_KEPT)
        self._on_decision = on_decision

    # -- the cost model ---------------------------------------------------------

    def _observe_cost(self, key: CostKey, device_ns: int, readiness_ns: int) -> None:
        self.cost.observe(key, device_ns, readiness_ns, self.now_ns)

    def _timings(self) -> list[GraphTiming]:
        # an estimate is either current or gone: nothing is ever stale-but-usable here
        return [GraphTiming(self.cost.estimate_ns(g.cost_key(), self.now_ns), True) for g in self.graphs]

    def _normalizer(self) -> float | None:
        estimates = list(zip(self.graphs, (t.duration_ns for t in self._timings())))
        measured = token_normalizer((g, ns) for g, ns in estimates if g.kind in GENERATION_KINDS)
        return measured if measured is not None else token_normalizer(estimates)

    # -- planning -----------------------------------------------------------------

    def plan(self) -> ScheduledPlan | None:
        if not self._queue_accepts_more():
            return None
        timings, population = self._snapshot()
        chunk = select.chunk_program(self.graphs, population.prompters.remaining[0]) if population.prompters else None
        if chunk is not None:
            if self._frames:
                return None  # a prompt chunk needs completion feedback (A7): wait for the empty window
            return self._prefill_plan(chunk, timings, population)
        best, scored = select.best_decode(self.graphs, timings, population)
        if best is None:
            return None
        plan = self._as_plan(select.as_choice(best))
        if self._frames and plan.requires_feedback:
            return None
        self._record(plan, scored)
        return plan

    def _prefill_plan(self, graph: GraphDescriptor, timings, population) -> ScheduledPlan:
        timing = timings[self.graphs.index(graph)]
        lane = select.prefill_lane(population, graph)
        value = prompt_lane_value(lane.prompt_tokens, population.prompters.price[0])
        score = (value_rate(value, timing.duration_ns / 1e6, population.active_age_price) if timing.known
                 else optimistic_work_score(value))
        plan = self._as_plan(Choice(graph, (lane,), timing, score, decision_log_scale(abs(score)), None))
        self._record(plan, ())
        return plan

    def _as_plan(self, choice: Choice) -> ScheduledPlan:
        reason = SelectionReason.ORDINARY if choice.timing.known else SelectionReason.DISCOVERY
        cost_ns = choice.timing.duration_ns
        return ScheduledPlan(
            graph=choice.graph, lanes=choice.lanes, reason=reason, estimated_duration_ns=cost_ns,
            scaled_value_rate=choice.score * math.exp(choice.log_scale), log_scale=choice.log_scale,
            requires_feedback=needs_feedback(choice.graph, choice.timing, choice.lanes),
            trace=self._plan_trace(choice.graph, cost_ns, reason),
        )

    def _record(self, plan: ScheduledPlan, scored: Sequence[select.Candidate]) -> None:
        others = sorted((c for c in scored if c.graph.id != plan.graph.id), key=select.Candidate.rank, reverse=True)
        decision = Decision(
            at_ns=self.now_ns, program=plan.graph.id, reason=plan.reason.value,
            score=plan.scaled_value_rate / math.exp(plan.log_scale), estimated_ns=plan.estimated_duration_ns,
            lanes=tuple((lane.handle.slot, lane.phase.value, lane.prompt_tokens or lane.query_length)
                        for lane in plan.lanes),
            runners_up=tuple(RunnerUp(c.graph.id, c.score, c.timing.known, select.is_padding(c, scored))
                             for c in others[:RUNNERS_UP]),
        )
        self.decisions.append(decision)
        if self._on_decision is not None:
            self._on_decision(decision)

    # -- what /debug/state shows -----------------------------------------------

    def programs_state(self) -> list[dict]:
        out = []
        for g in self.graphs:
            key = g.cost_key()
            out.append({"id": g.id, "kind": g.kind.value, "B": g.batch_capacity, "D": g.proposal_depth,
                        "W": g.width, "P": g.target_rows, "prefill_capacity": g.prefill_capacity,
                        "estimate_ns": self.cost.estimate_ns(key, self.now_ns),
                        "age_ns": self.cost.age_ns(key, self.now_ns)})
        return out

    def requests_state(self) -> list[dict]:
        out = []
        for s in self._slots:
            if s is None:
                continue
            out.append({"slot": s.handle.slot, "generation": s.handle.generation, "phase": s.phase.value,
                        "prompt_tokens": s.request.prompt_tokens, "prompt_done": s.prompt_done,
                        "produced": s.produced, "max_tokens": s.request.max_tokens, "inflight": s.inflight,
                        "token_rate": s.service.token_rate, "delivery_rate": s.service.delivery_rate,
                        "cancelled": s.cancelled, "finished": s.finished})
        return out
