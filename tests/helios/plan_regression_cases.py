"""Seeded simulator runs whose every committed plan is recorded, for the plan regression guard.

``record(case)`` runs one case through the real scheduler on the simulator and
returns, per committed plan, everything the scheduler decided: the graph, the
reason, the estimate, the value rate and scale, and every lane's numbers; and,
per request, its visible bursts. ``tests/helios/test_plan_regression.py``
compares these against ``tests/helios/data/plan_regression.json``; regenerate
that file with ``scripts/record_plan_regression.py`` only when a change is meant
to alter scheduling.

The cases reach every selection path: decode, speculative (rectangular,
host-allocated ragged with a binding P, device-allocated prefix-limit, two
proposal sources), prefill, mixed with and without wide rows; cold and measured
catalogs; preseeded and untrained acceptance; more requests than slots; and
cancellations, cached prefixes and prompt endpoints (``_ChurnSimulation``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

from helios.scheduler.types import AdmitRequest, ScheduledPlan
from helios.sim.files import parse_catalog, parse_trace
from helios.sim.simulator import Simulation, SimulationOptions

MS = 1_000_000


@dataclass(frozen=True)
class Case:
    name: str
    catalog: dict
    trace: dict
    until_ms: float | None = None
    cold: bool = False
    churn: bool = False  # cancellations, cached prefixes and endpoints


# ---------------------------------------------------------------------------
# Catalogs and traces
# ---------------------------------------------------------------------------


def example_catalog() -> dict:
    """A small catalog like examples/simulation/catalog.yaml, kept here so edits there do not move the guard."""
    graphs = [{"kind": "decode", "batch_capacity": b, "duration_ms": 2.5 + 0.08 * b} for b in (1, 2, 4, 8, 16)]
    graphs += [{"kind": "speculative", "batch_capacity": b, "width": w, "duration_ms": 2.6 + 0.5 * w + 0.03 * b * w}
               for b in (1, 2, 4, 8) for w in (2, 4, 8)]
    graphs += [{"kind": "prefill", "batch_capacity": 1, "prefill_capacity": t, "duration_ms": 2 + 0.015 * t}
               for t in (64, 256, 1024, 4096)]
    graphs += [{"kind": "mixed", "batch_capacity": 2, "prefill_capacity": t, "duration_ms": 3 + 0.015 * t}
               for t in (64, 256, 1024)]
    graphs += [{"kind": "mixed", "batch_capacity": 4, "prefill_capacity": 256, "width": w,
                "duration_ms": 7 + 0.5 * w} for w in (2, 4)]
    return {"request_slots": 16, "graphs": graphs}


def varied_catalog() -> dict:
    """Every speculative flavour: ragged with a binding P, prefix-limit, copy source, jitter."""
    catalog = example_catalog()
    graphs = catalog["graphs"]
    graphs += [{"kind": "speculative", "batch_capacity": b, "width": 6, "ragged": True, "aggregate": p,
                "duration_ms": 3 + 0.04 * p} for b, p in ((4, 12), (8, 20), (16, 40))]
    graphs += [{"kind": "speculative", "batch_capacity": b, "width": 5, "value_source": "prefix_limit", "ragged": True,
                "aggregate": p, "duration_ms": 3.2 + 0.04 * p, "jitter_ms": 0.3} for b, p in ((4, 10), (8, 24))]
    graphs += [{"id": f"copy-b{b}", "kind": "speculative", "batch_capacity": b, "width": 4, "proposal_source": "copy",
                "duration_ms": 3 + 0.05 * b} for b in (2, 8)]
    catalog["request_slots"] = 24
    return catalog


def bench_catalog(slots: int) -> dict:
    """The shape mix of benchmarks/plan_bench.py (128 shapes)."""
    graphs = [{"kind": "decode", "batch_capacity": b, "duration_ms": 2.5 + 0.08 * b} for b in (1, 2, 4, 8, 16, 32, 64)]
    for b in (1, 2, 4, 8, 16, 32, 64):
        graphs += [{"kind": "speculative", "batch_capacity": b, "width": w,
                    "duration_ms": 2.5 + 0.5 * (w - 1) + 0.03 * b * w} for w in range(1, 9) if b * w <= 256]
    graphs += [{"kind": "prefill", "batch_capacity": 1, "prefill_capacity": t, "duration_ms": 2 + 0.015 * t}
               for t in (64, 128, 256, 512, 1024, 2048, 4096)]
    for b in (2, 4, 8, 16, 32, 64):
        graphs += [{"kind": "mixed", "batch_capacity": b, "prefill_capacity": t, "duration_ms": 3 + 0.015 * t + 0.08 * b}
                   for t in (64, 256, 1024, 4096)]
        graphs += [{"kind": "mixed", "batch_capacity": b, "prefill_capacity": 1024, "width": w,
                    "duration_ms": 18 + 0.5 * (w - 1) + 0.03 * b * w} for w in range(2, 9) if b * w <= 256]
    return {"request_slots": slots, "graphs": graphs}


def random_trace(seed: int, count: int, spread_ms: float, *, copy_share: float = 0.0, policy: dict | None = None) -> dict:
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        request: dict[str, Any] = {
            "id": f"q{i}",
            "arrival_ms": round(rng.uniform(0, spread_ms), 3),
            "prompt_tokens": rng.choice((16, 64, 200, 700, 3000, 9000)),
            "max_tokens": rng.choice((8, 40, 120, 400)),
            "preseed_acceptance": rng.random() < 0.3,
        }
        if rng.random() < 0.5:
            request["accepted_drafts"] = rng.randrange(8)
        else:
            request["acceptance"] = sorted((round(rng.random(), 2) for _ in range(rng.randrange(1, 8))), reverse=True)
        if rng.random() < copy_share:
            request["proposal_source"] = "copy"
        requests.append(request)
    trace: dict[str, Any] = {"seed": seed, "requests": requests}
    if policy:
        trace["policy"] = policy
    return trace


def bench_trace(size: int) -> dict:
    """The request mix of benchmarks/plan_bench.py, copied on purpose: editing the benchmark must not change recorded plans."""
    requests = []
    for i in range(size):
        request: dict[str, Any] = {"id": f"r{i}", "prompt_tokens": 32_768 if i % 4 == 0 else 64 + 64 * (i % 7),
                                   "max_tokens": 8_000}
        if i % 3 == 2:
            request["acceptance"] = [0.9, 0.75, 0.6, 0.45, 0.3, 0.2, 0.1]
        else:
            request["accepted_drafts"] = i % 8
        requests.append(request)
    return {"seed": 1, "requests": requests}


CASES = (
    Case("example_measured", example_catalog(), random_trace(1, 12, 100.0)),
    Case("example_cold", example_catalog(), random_trace(2, 10, 50.0), cold=True),
    Case("example_throughput", example_catalog(), random_trace(3, 20, 300.0, policy={"preset": "throughput"})),
    Case("varied", varied_catalog(), random_trace(4, 40, 400.0, copy_share=0.3), until_ms=1_500.0),
    Case("varied_churn", varied_catalog(), random_trace(5, 40, 300.0, copy_share=0.3), until_ms=1_200.0, churn=True),
    Case("bench_64", bench_catalog(64), bench_trace(64), until_ms=6_000.0),
    Case("bench_80_staggered", bench_catalog(64), random_trace(6, 80, 200.0), until_ms=6_000.0),
)


# ---------------------------------------------------------------------------
# Running and recording
# ---------------------------------------------------------------------------


class _ChurnSimulation(Simulation):
    """The simulator plus what it never does by itself: cancel requests, admit cached prefixes and endpoints."""

    def __init__(self, *args, seed: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.churn = random.Random(seed)

    def _admit(self, request) -> bool:
        spec, rng = request.spec, self.churn
        cached = rng.randrange(spec.prompt_tokens) if rng.random() < 0.3 else 0
        endpoints = tuple(sorted({rng.randrange(1, spec.prompt_tokens + 1) for _ in range(rng.randrange(3))}))
        admit = AdmitRequest(prompt_tokens=spec.prompt_tokens, max_tokens=spec.max_tokens,
                             context_limit=spec.prompt_tokens + spec.max_tokens, cached_tokens=cached,
                             endpoints=endpoints, proposal_sources=(spec.proposal_source,))
        try:
            request.handle = self.scheduler.admit(admit)
        except ValueError:
            return False
        request.outcome.admitted_ns = self.now
        self.owners[request.handle] = request
        self.active += 1
        return True

    def _complete(self, frame) -> None:
        super()._complete(frame)
        if self.churn.random() < 0.04:
            live = [r for r in self.owners.values() if r.outcome.finished_ns is None and self.scheduler.is_active(r.handle)]
            if live:
                victim = self.churn.choice(live)
                self.scheduler.cancel(victim.handle)
                victim.outcome.finished_ns = self.now
                self.active -= 1


def _lane_json(lane, owners) -> list:
    return [owners[lane.handle].spec.id, lane.phase.value, lane.prompt_start, lane.prompt_tokens,
            lane.query_length, lane.ceiling, repr(lane.expected_tokens), lane.finishes_prompt]


def _plan_json(plan: ScheduledPlan, owners) -> dict:
    return {
        "graph": plan.graph.id,
        "reason": plan.reason.value,
        "estimated_ns": plan.estimated_duration_ns,
        "value_rate": repr(plan.scaled_value_rate),
        "log_scale": repr(plan.log_scale),
        "prefill_row": plan.prefill_row,
        "requires_feedback": plan.requires_feedback,
        "lanes": [_lane_json(lane, owners) for lane in plan.lanes],
        "trace": repr(getattr(plan, "trace", None)),  # A12, where the scheduler writes one
    }


def record(case: Case) -> dict:
    """Every committed plan and every request's bursts of one case (JSON-ready)."""
    catalog, trace = parse_catalog(case.catalog, case.name), parse_trace(case.trace, case.name)
    until = None if case.until_ms is None else int(case.until_ms * MS)
    options = SimulationOptions(cold=case.cold, until_ns=until)
    simulation = (_ChurnSimulation(catalog, trace, options, seed=trace.seed) if case.churn
                  else Simulation(catalog, trace, options))
    committed: list[dict] = []
    commit: Callable = simulation.scheduler.commit

    def recording_commit(plan, fence):
        committed.append({"fence": fence, "now_ns": simulation.now, **_plan_json(plan, simulation.owners)})
        commit(plan, fence)

    simulation.scheduler.commit = recording_commit
    result = simulation.run()
    bursts = {o.id: [[b.time_ns, b.tokens] for b in o.bursts] for o in result.requests}
    return {"plans": committed, "bursts": bursts, "end_ns": result.end_ns, "stalled": result.stalled}


def record_all() -> dict:
    return {case.name: record(case) for case in CASES}

