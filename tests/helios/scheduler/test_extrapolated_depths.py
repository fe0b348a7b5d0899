"""``PolicyConfig.extrapolate_unobserved_depths`` (issue 20, 2026-12-04; docs/scheduling-utility.md,
"Departures from the spec"): a draft depth no round has observed continues the deepest observed one."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from helios.scheduler.speculation import PrefixSurvival, extrapolated_survival, prior_survival
from helios.sim.files import load_catalog
from helios.sim.simulator import simulate


def test_unobserved_depths_continue_the_deepest_observed_conditional_survival():
    estimates = PrefixSurvival()
    for _ in range(40):
        estimates.observe((1.0, 1.0))  # two depths observed, each accepted
    estimates.observe((1.0, 0.0))
    means, _ = estimates.means_and_weights(4)
    assert means[2:] == (prior_survival(3), prior_survival(4))  # stored nowhere: the prior
    out = extrapolated_survival(means, len(estimates.depths))
    ratio = means[1] / means[0]
    assert out[:2] == means[:2]  # observed depths are read as they are
    assert out[2] == pytest.approx(means[1] * ratio) and out[3] == pytest.approx(means[1] * ratio**2)
    assert out[2] > 4 * prior_survival(3)


def test_without_an_observed_depth_the_prior_stands():
    means = tuple(prior_survival(d) for d in range(1, 5))
    assert extrapolated_survival(means, 0) == means
    assert extrapolated_survival((0.0, 0.25, 0.125), 1) == (0.0, 0.0, 0.0)  # nothing accepted: nothing deeper


def test_a_high_acceptance_workload_learns_to_verify_deeper_and_finishes_sooner():
    from scripts.scheduling_sim.capacity import scaled
    from scripts.scheduling_sim.shapes import Shapes
    from scripts.scheduling_sim.workloads import build_workloads

    catalog = load_catalog("examples/simulation/catalog.yaml")
    workload = next(w for w in build_workloads(Shapes(catalog), 0) if w.name == "spec-high")  # alpha 0.85
    trace = scaled(workload.trace, 2.8 / workload.load)  # past the device's capacity: throughput decides
    runs = {0: simulate(catalog, replace(trace, policy=replace(trace.policy, extrapolate_unobserved_depths=0))),
            1: simulate(catalog, trace)}  # the default
    wide = {flag: sum(1 for p in run.plans if p.graph.width >= 3) for flag, run in runs.items()}
    assert wide[1] > 4 * wide[0]  # at the prior a third draft reads 12 % likely: width 2 nearly always
    assert runs[1].end_ns < 0.95 * runs[0].end_ns
    assert Counter(p.graph.width for p in runs[1].plans).most_common(1)[0][0] == 3
