"""``PolicyConfig.probes_win_as_plans`` (issue 20, 2026-12-04; docs/scheduling-utility.md, "Departures from
the spec"): an acceptance probe (D8) must beat the ordinary winner as a plan under its optimistic estimate."""

from __future__ import annotations

from dataclasses import replace

from helios.scheduler import PolicyConfig
from helios.sim.files import Trace, TraceRequest, load_catalog
from helios.sim.simulator import simulate

MS = 1_000_000
DEFAULTS = PolicyConfig.preset("balanced")


def _probes(result) -> int:
    return sum(1 for plan in result.plans if plan.reason == "acceptance_learning")


def test_no_one_row_probe_while_a_full_batch_of_decoders_would_wait_for_it():
    from scripts.scheduling_sim.shapes import Shapes
    from scripts.scheduling_sim.workloads import build_workloads

    catalog = load_catalog("examples/simulation/catalog.yaml")
    steady = next(w for w in build_workloads(Shapes(catalog), 0) if w.name == "steady-100")  # accepts nothing
    gated = simulate(catalog, steady.trace)
    lane_only = simulate(catalog, replace(steady.trace, policy=replace(DEFAULTS, probes_win_as_plans=0)))
    assert _probes(lane_only) >= 10  # every fresh request looks promising to its own lane (S9's optimism)
    assert _probes(gated) <= 2
    assert gated.end_ns < lane_only.end_ns  # the probes' device time, and the streams' waits, are saved


def test_a_probe_that_would_win_as_a_plan_still_runs():
    catalog = load_catalog("examples/simulation/catalog.yaml")
    solo = (TraceRequest("solo", 0, 64, 2000),)  # nobody else waits for a one-row probe
    gated = simulate(catalog, Trace(DEFAULTS, 0, solo))
    assert _probes(gated) >= 5
    assert _probes(gated) == _probes(simulate(catalog, Trace(replace(DEFAULTS, probes_win_as_plans=0), 0, solo)))
