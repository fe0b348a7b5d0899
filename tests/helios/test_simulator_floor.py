"""``flare simulate`` with the adaptive floor (trace field ``adaptive_floor``, as ``flare run --adaptive-floor``).

"plain": ordinary decode stays beside the learned rounds and the scheduler
tracks whose draft fell behind; "draft": ordinary decode is dropped where
learned rounds are loaded; absent: the catalog as given, every program taken
as draft-keeping (what traces without the field always did).
"""

from __future__ import annotations

import pytest

from helios.sim.files import SimulationFileError, parse_catalog, parse_trace, trace_to_dict
from helios.sim.simulator import Simulation, SimulationOptions

CATALOG = {"request_slots": 4, "graphs": [
    {"id": "prefill", "kind": "prefill", "batch_capacity": 1, "prefill_capacity": 64, "duration_ms": 2},
    {"id": "decode", "kind": "decode", "batch_capacity": 4, "duration_ms": 3},
    {"id": "twin", "kind": "speculative", "batch_capacity": 4, "width": 1, "proposal_depth": 0,
     "speculation_enabled": True, "duration_ms": 3.3},
    {"id": "learned", "kind": "speculative", "batch_capacity": 4, "width": 4, "duration_ms": 5.8},
]}


def trace(floor: str | None, speculation: str = "adaptive") -> dict:
    # r0 and r1 accept nothing until 24 tokens in, then every draft: plain decode wins at first
    change = [{"after_tokens": 24, "accepted_drafts": 3}]
    requests = [{"id": "sure", "arrival_ms": 0, "prompt_tokens": 32, "max_tokens": 16, "accepted_drafts": 3,
                 "preseed_acceptance": True}]  # alone, its draft current: learned rounds pay
    requests += [{"id": f"r{i}", "arrival_ms": 60 + i, "prompt_tokens": 32, "max_tokens": 64, "accepted_drafts": 0,
                  "acceptance_schedule": change} for i in range(2)]
    requests += [{"id": f"sure{i}", "arrival_ms": 100 + i, "prompt_tokens": 32, "max_tokens": 48,
                  "accepted_drafts": 3, "preseed_acceptance": True} for i in range(2)]
    out = {"seed": 0, "speculation": speculation, "requests": requests}
    return out if floor is None else {**out, "adaptive_floor": floor}


def run(floor: str | None):
    return Simulation(parse_catalog(CATALOG), parse_trace(trace(floor)), SimulationOptions()).run()


def learned_after_plain(result) -> list[str]:
    """Requests a learned round ran after an ordinary decode frame ran them."""
    behind, found = set(), []
    for plan in result.plans:
        if plan.graph.id == "decode":
            behind |= set(plan.cohort)
        elif plan.graph.id == "learned" and behind & set(plan.cohort):
            found.append(f"fence {plan.fence}: {sorted(behind & set(plan.cohort))}")
    return found


@pytest.mark.parametrize("floor", [None, "plain", "draft"])
def test_every_floor_serves_every_request_in_full(floor):
    result = run(floor)
    assert {r.id: r.tokens for r in result.requests} == {"sure": 16, "r0": 64, "r1": 64, "sure0": 48, "sure1": 48}
    ran = {p.graph.id for p in result.plans}
    assert "learned" in ran
    if floor == "draft":
        assert "decode" not in ran  # dropped where learned rounds are loaded
    else:
        assert "decode" in ran


def test_with_the_plain_floor_no_learned_round_runs_a_request_after_an_ordinary_frame():
    plain = run("plain")
    assert not learned_after_plain(plain)
    # as given, every program is taken as draft-keeping: the same trace runs learned rounds after decode
    assert learned_after_plain(run(None))


def test_the_floor_is_a_trace_field_for_adaptive_only():
    assert parse_trace(trace("plain")).adaptive_floor == "plain"
    assert trace_to_dict(parse_trace(trace("draft")))["adaptive_floor"] == "draft"
    assert "adaptive_floor" not in trace_to_dict(parse_trace(trace(None)))
    with pytest.raises(SimulationFileError, match="adaptive_floor.*allowed: plain, draft"):
        parse_trace(trace("lazy"))
    with pytest.raises(SimulationFileError, match="applies to speculation adaptive only"):
        parse_trace(trace("plain", speculation="fixed"))
