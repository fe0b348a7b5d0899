"""``flare simulate`` with scored prefill (spec C1): a trace's ``scored_prompt`` requests run their prompt only
in the synthetic catalog's ``scored_prefill`` graphs, and the others never do."""

from __future__ import annotations

from helios.sim.files import catalog_to_dict, parse_catalog, parse_trace, trace_to_dict
from helios.sim.simulator import simulate

CATALOG = {
    "request_slots": 4,
    "graphs": [
        {"id": "prefill", "kind": "prefill", "batch_capacity": 1, "prefill_capacity": 64, "duration_ms": 6},
        {"id": "scored", "kind": "scored_prefill", "batch_capacity": 1, "prefill_capacity": 64, "duration_ms": 8},
        {"id": "decode", "kind": "decode", "batch_capacity": 4, "duration_ms": 3},
    ],
}
TRACE = {"seed": 0, "speculation": "off", "requests": [
    {"id": "plain", "prompt_tokens": 100, "max_tokens": 5},
    {"id": "scored", "prompt_tokens": 150, "max_tokens": 1, "scored_prompt": True},
    {"id": "plain2", "arrival_ms": 5, "prompt_tokens": 40, "max_tokens": 3},
]}


def test_C1_scored_prompts_run_only_in_scored_prefill_graphs():
    result = simulate(parse_catalog(CATALOG), parse_trace(TRACE))
    by_kind: dict[str, set[str]] = {}
    for plan in result.plans:
        by_kind.setdefault(plan.graph.kind.value, set()).update(plan.cohort)
    assert by_kind["scored_prefill"] == {"scored"}
    assert by_kind["prefill"] == {"plain", "plain2"}
    assert sum(p.graph.id == "scored" for p in result.plans) == 3  # 150 tokens in chunks of 64
    assert all(r.finished_ns is not None for r in result.requests)


def test_the_flag_and_the_kind_round_trip_through_the_files():
    assert parse_trace(trace_to_dict(parse_trace(TRACE))) == parse_trace(TRACE)
    assert parse_catalog(catalog_to_dict(parse_catalog(CATALOG))).descriptors() == parse_catalog(CATALOG).descriptors()
