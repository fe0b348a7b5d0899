"""The direct scheduler: the Helios core composed with a small selection and cost model of its own.

``DirectScheduler`` builds a ``helios.scheduler.Scheduler`` (request life:
admit, commit, complete, publication, service histories, acceptance
estimates, the two-frame queue: the same prices feed the same scores) and
hands it, through its constructor, the two parts a diagnostic run must be
able to rule out:

- ``selector=DirectSelector``: a waiting prompt gets its next chunk
  (``select.chunk_program``); otherwise the best decode round by Helios's
  score and cohort rules (``select.best_decode``). No mixed programs, no
  funded timing refresh, no acceptance probes (spec, first section);
- ``cost=MovingAverageCost`` (7/8 moving average, unmeasured again after
  30 s) instead of the median of nine; the core's timing table runs over it.

It uses only the core's public methods. Time comes only through
``advance_to``, like the core. Every decision is kept (the last 100) with its
scores for ``/debug/state``, and handed to an optional ``on_decision``
callback (``--verbose`` logs it).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flare_contract.graphs import GraphDescriptor, GraphKind
from helios.direct import select
from helios.direct.cost import MovingAverageCost
from helios.scheduler.config import PolicyConfig
from helios.scheduler.core import RequestView, Scheduler
from helios.scheduler.explore import Decision
from helios.scheduler.select.choice import Choice
from helios.scheduler.select.population import Population
from helios.scheduler.select.timing import GraphTiming
from helios.scheduler.types import ScheduledPlan
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
class LoggedDecision:
    """One plan as ``/debug/state`` and ``--verbose`` show it (not ``explore.Decision``, the core's
    planning decision as funded exploration sees it)."""

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


class DirectSelector:
    """``helios.scheduler.selector.Selector`` of the direct path: a prefill chunk or the best decode round."""

    def __init__(self, graphs: Sequence[GraphDescriptor],
                 on_decision: Callable[[LoggedDecision], None] | None = None) -> None:
        self.graphs = tuple(graphs)
        self.decisions: deque[LoggedDecision] = deque(maxlen=DECISIONS_KEPT)
        self._on_decision = on_decision
        self._scored: Sequence[select.Candidate] = ()  # the last selection's decode candidates

    def select(self, timings: Sequence[GraphTiming], population: Population) -> Choice | None:
        for kind, prompters in ((GraphKind.PREFILL, population.prompters),
                                (GraphKind.SCORED_PREFILL, population.scored)):
            chunk = select.chunk_program(self.graphs, prompters.remaining[0], kind) if prompters else None
            if chunk is not None:
                self._scored = ()
                return self._prefill_choice(chunk, timings[self.graphs.index(chunk)],
                                            dataclasses.replace(population, prompters=prompters))
        best, self._scored = select.best_decode(self.graphs, timings, population)
        return None if best is None else select.as_choice(best)

    def _prefill_choice(self, graph: GraphDescriptor, timing: GraphTiming, population: Population) -> Choice:
        """A prefill program needs completion feedback, so the core runs it only with the queue empty (A7)."""
        lane = select.prefill_lane(population, graph)
        value = prompt_lane_value(lane.prompt_tokens, population.prompters.price[0])
        score = (value_rate(value, timing.duration_ns / 1e6, population.active_age_price) if timing.known
                 else optimistic_work_score(value))
        return Choice(graph, (lane,), timing, score, decision_log_scale(abs(score)), None)

    def fund(self, decision: Decision, accounts, subject) -> None:
        return None  # no funded timing refresh and no acceptance probes on the direct path

    def would_fund(self, decision: Decision, accounts, subject) -> bool:
        return False

    def configure(self, policy: PolicyConfig) -> None:
        pass  # the population carries the one preference selection reads here (alpha)

    def planned(self, plan: ScheduledPlan, now_ns: int) -> None:
        """Log the plan the core hands out, with the runners-up of its decision."""
        scored = self._scored
        others = sorted((c for c in scored if c.graph.id != plan.graph.id), key=select.Candidate.rank, reverse=True)
        decision = LoggedDecision(
            at_ns=now_ns, program=plan.graph.id, reason=plan.reason.value,
            score=plan.scaled_value_rate / math.exp(plan.log_scale), estimated_ns=plan.estimated_duration_ns,
            lanes=tuple((lane.handle.slot, lane.phase.value, lane.prompt_tokens or lane.query_length)
                        for lane in plan.lanes),
            runners_up=tuple(RunnerUp(c.graph.id, c.score, c.timing.known, select.is_padding(c, scored))
                             for c in others[:RUNNERS_UP]),
        )
        self.decisions.append(decision)
        if self._on_decision is not None:
            self._on_decision(decision)


class DirectScheduler:
    """A Helios ``Scheduler`` built with the direct cost model and selector (see the module docstring).

    ``scheduler`` is what an engine drives; ``programs_state``, ``requests_state`` and ``decisions``
    are what ``/debug/state`` shows (read them where the driver is not running, e.g. under
    ``HeliosEngine.state_snapshot``).
    """

    def __init__(self, graphs: Sequence[GraphDescriptor], *, request_slots: int, policy: PolicyConfig | None = None,
                 speculation: str = "adaptive", on_decision: Callable[[LoggedDecision], None] | None = None) -> None:
        policy = policy or PolicyConfig()
        self.cost = MovingAverageCost(policy.estimate_ttl_ns)
        self.selector = DirectSelector(graphs, on_decision)
        self.scheduler = Scheduler(graphs, request_slots=request_slots, policy=policy, speculation=speculation,
                                   cost=self.cost, selector=self.selector)

    @property
    def decisions(self) -> deque[LoggedDecision]:
        return self.selector.decisions

    def programs_state(self) -> list[dict]:
        now = self.scheduler.now_ns
        out = []
        for g in self.scheduler.graphs:
            key = g.cost_key()
            out.append({"id": g.id, "kind": g.kind.value, "B": g.batch_capacity, "D": g.proposal_depth,
                        "W": g.width, "P": g.target_rows, "prefill_capacity": g.prefill_capacity,
                        "estimate_ns": self.cost.estimate_ns(key, now), "age_ns": self.cost.age_ns(key, now)})
        return out

    def requests_state(self, requests: Sequence[RequestView] | None = None) -> list[dict]:
        """``requests`` (default: the scheduler's now) as ``/debug/state`` lists them."""
        views = self.scheduler.requests() if requests is None else requests
        return [{"slot": r.handle.slot, "generation": r.handle.generation, "phase": r.phase.value,
                 "prompt_tokens": r.prompt_tokens, "prompt_done": r.prompt_done, "produced": r.produced,
                 "max_tokens": r.max_tokens, "inflight": r.inflight, "token_rate": r.token_rate,
                 "delivery_rate": r.delivery_rate, "cancelled": r.cancelled, "finished": r.finished}
                for r in views]
