"""A simulated run as Chrome/Perfetto trace events (``flare simulate --trace-out FILE``).

The JSON object format of the Trace Event Format: ``{"traceEvents": [...],
"displayTimeUnit": "ms"}``, timestamps in microseconds. Open the file in
ui.perfetto.dev or chrome://tracing.

Tracks (one process, "flare simulate"):
- tid 0, "device": one complete event ("X") per committed plan, named by its
  graph, with the A12 fields in ``args`` (B/D/W/P, reason, cohort, selected
  cost, observation age, exploration credit);
- tid 1.., one per request in trace order: a complete event for every frame
  that had a lane for it (its lane width in ``args``), and an instant event
  ("i") for every visible burst (its token count in ``args``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from helios.sim.simulator import PlanRecord, SimulationResult

PID = 1
DEVICE_TID = 0


def trace_events(result: SimulationResult) -> dict[str, Any]:
    """The trace-event document of one run."""
    tids = {outcome.id: index + 1 for index, outcome in enumerate(result.requests)}
    events = [_metadata("process_name", DEVICE_TID, "flare simulate"), _metadata("thread_name", DEVICE_TID, "device")]
    events += [_metadata("thread_name", tid, f"request {rid}") for rid, tid in tids.items()]
    for plan in result.plans:
        events.append(_complete_event(plan, DEVICE_TID, _device_args(plan)))
        for rid, width in zip(plan.cohort, plan.lane_widths or (1,) * len(plan.cohort)):
            events.append(_complete_event(plan, tids[rid], {"lane_width": width, "reason": plan.reason}))
    for outcome in result.requests:
        for burst in outcome.bursts:
            events.append({"name": "burst", "ph": "i", "s": "t", "ts": _us(burst.time_ns), "pid": PID,
                           "tid": tids[outcome.id], "args": {"tokens": burst.tokens}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace_events(result: SimulationResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(trace_events(result)) + "\n")


def _metadata(name: str, tid: int, label: str) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": PID, "tid": tid, "args": {"name": label}}


def _complete_event(plan: PlanRecord, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": plan.graph.id, "cat": plan.reason, "ph": "X", "ts": _us(plan.start_ns),
            "dur": _us(plan.end_ns - plan.start_ns), "pid": PID, "tid": tid, "args": args}


def _device_args(plan: PlanRecord) -> dict[str, Any]:
    g = plan.graph
    args: dict[str, Any] = {
        "fence": plan.fence, "B": g.batch_capacity, "D": g.proposal_depth, "W": g.width, "P": g.target_rows,
        "reason": plan.reason, "cohort": list(plan.cohort), "estimated_ms": plan.estimated_ns / 1e6,
    }
    trace = plan.trace
    if trace is not None:
        args["observation_age_ms"] = None if trace.observation_age_ns is None else trace.observation_age_ns / 1e6
        args["timing_refresh_credit_ms"] = trace.timing_refresh_credit_ns / 1e6
        args["acceptance_learning_credit_ms"] = trace.acceptance_learning_credit_ns / 1e6
    return args


def _us(ns: int) -> float:
    return ns / 1000.0
