"""Where prompt rows go beside decoders (issue 20, 2026-12-04): ``PolicyConfig.prompts_beside_decoders``
and ``PolicyConfig.prompts_by_due`` (docs/scheduling-utility.md, "Departures from the spec")."""

from __future__ import annotations

from dataclasses import replace

from flare_contract.graphs import GraphKind
from helios.scheduler import PolicyConfig
from helios.sim.files import Trace, TraceRequest, load_catalog, parse_catalog
from helios.sim.simulator import simulate

MS = 1_000_000
EXAMPLE = "examples/simulation/catalog.yaml"
DEFAULTS = PolicyConfig.preset("balanced")


def _streams(count: int, output: int = 200) -> list[TraceRequest]:
    return [TraceRequest(f"s{i}", i * MS, 64, output) for i in range(count)]


def _prefill_only_beside_decoders(result) -> list[str]:
    """Prefill-only programs that ran while some stream had output left (a decoder was waiting)."""
    out = []
    for plan in result.plans:
        if plan.graph.kind is not GraphKind.PREFILL:
            continue
        waiting = [o for o in result.requests if o.id.startswith("s") and o.bursts
                   and o.bursts[0].time_ns <= plan.start_ns < o.finished_ns]
        if waiting:
            out.append(plan.graph.id)
    return out


def test_a_prompt_beside_decoders_rides_in_mixed_rows_instead_of_a_prefill_of_its_own():
    catalog = load_catalog(EXAMPLE)
    requests = (*_streams(4), TraceRequest("p", 30 * MS, 436, 8))  # no mixed program holds 436 prompt tokens
    rode = simulate(catalog, Trace(DEFAULTS, 0, requests))
    assert _prefill_only_beside_decoders(rode) == []
    assert [p.graph.kind for p in rode.plans if "p" in p.cohort][:2] == [GraphKind.MIXED, GraphKind.MIXED]
    # U6's rate alone: the whole prompt in prefill-b1-t512 while the four streams wait for it and their round
    alone = simulate(catalog, Trace(replace(DEFAULTS, prompts_beside_decoders=0), 0, requests))
    assert "prefill-b1-t512" in _prefill_only_beside_decoders(alone)


def test_a_long_prompt_still_prefills_alone_where_mixed_rows_are_small():
    graphs = [{"kind": "decode", "batch_capacity": b, "duration_ms": 2.5 + 0.08 * b} for b in (1, 2, 4)]
    graphs += [{"kind": "prefill", "batch_capacity": 1, "prefill_capacity": t, "duration_ms": 2 + 0.015 * t}
               for t in (64, 2048)]
    graphs += [{"kind": "mixed", "batch_capacity": 4, "prefill_capacity": 64, "duration_ms": 2.82 + 0.96}]
    catalog = parse_catalog({"request_slots": 4, "graphs": graphs})
    requests = (*_streams(2, output=400), TraceRequest("p", 20 * MS, 8192, 4))
    result = simulate(catalog, Trace(DEFAULTS, 0, requests))
    # a 64-token mixed row holds less than half of t2048's capacity: the prompt does not crawl in it
    assert "prefill-b1-t2048" in _prefill_only_beside_decoders(result)
    assert result.request("p").bursts and result.request("p").first_output_ms() < 400


def test_prompt_rows_go_first_come_first_served_among_prompts_of_like_length():
    catalog = load_catalog(EXAMPLE)
    requests = (*_streams(4), TraceRequest("a", 30 * MS, 500, 8), TraceRequest("b", 34 * MS, 500, 8))
    ordered = simulate(catalog, Trace(DEFAULTS, 0, requests))
    b_starts = min(p.start_ns for p in ordered.plans if "b" in p.cohort)
    assert ordered.request("a").bursts[0].time_ns <= b_starts  # a finishes its prompt before b gets a row
    turns = simulate(catalog, Trace(replace(DEFAULTS, prompts_by_due=0), 0, requests))
    b_turn = min(p.start_ns for p in turns.plans if "b" in p.cohort)
    assert b_turn < turns.request("a").bursts[0].time_ns  # the fairness price alone: they take turns
    assert ordered.request("a").first_output_ms() < turns.request("a").first_output_ms()


def test_a_short_prompt_admitted_just_after_a_long_one_goes_first():
    catalog = load_catalog(EXAMPLE)
    requests = (*_streams(4), TraceRequest("long", 30 * MS, 6000, 8), TraceRequest("short", 35 * MS, 64, 8))
    result = simulate(catalog, Trace(DEFAULTS, 0, requests))
    assert result.request("short").bursts[0].time_ns < result.request("long").bursts[0].time_ns
    assert result.request("short").first_output_ms() < 30
