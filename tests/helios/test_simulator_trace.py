"""Funded exploration seen through ``flare simulate``: A12 plan fields, trace events, mid-stream acceptance.

Covers issue 4's simulator half: every plan in ``--json`` carries its physical
B/D/W/P, selected cost, observation age, reason and credits (A12);
``--trace-out`` writes Chrome/Perfetto trace events; a trace's
``acceptance_schedule`` changes a request's real acceptance mid-stream, and
the scheduler's widths follow it after a probe (D8, S9); ``speculation:
fixed`` never probes; the aggregate bounds (D7, D8) hold over long runs.
"""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from typer.testing import CliRunner

from helios.cli import app
from helios.sim.files import (
    FixedAcceptance,
    SimulationFileError,
    dump_yaml,
    parse_catalog,
    parse_trace,
    trace_to_dict,
)
from helios.sim.trace import trace_events
from helios.sim.simulator import simulate

MS = 1_000_000
REASONS = {"ordinary", "discovery", "timing_refresh", "acceptance_learning"}

CATALOG = {
    "request_slots": 4,
    "graphs": [
        {"id": "prefill", "kind": "prefill", "batch_capacity": 1, "prefill_capacity": 64, "duration_ms": 5},
        {"id": "decode", "kind": "decode", "batch_capacity": 1, "duration_ms": 5},
        {"id": "decode2", "kind": "decode", "batch_capacity": 2, "duration_ms": 6},
        {"id": "spec4", "kind": "speculative", "batch_capacity": 1, "width": 4, "duration_ms": 8},
    ],
}


def _shifting_trace(speculation: str = "adaptive", shift_after: int = 600) -> dict:
    return {
        "seed": 3,
        "speculation": speculation,
        "policy": {"estimate_ttl_ns": 400 * MS},
        "requests": [{
            "id": "shifty", "prompt_tokens": 64, "max_tokens": 2000, "accepted_drafts": 0,
            "acceptance_schedule": [{"after_tokens": shift_after, "accepted_drafts": 3}],
        }],
    }


def _run(trace: dict, catalog: dict = CATALOG):
    return simulate(parse_catalog(catalog), parse_trace(trace))


def _tokens_before(result, rid: str, time_ns: int) -> int:
    return sum(b.tokens for b in result.request(rid).bursts if b.time_ns <= time_ns)


def test_D8_S9_width_follows_a_mid_stream_acceptance_rise_after_a_probe():
    result = _run(_shifting_trace())
    shift_ns = next(b.time_ns for b in _bursts_from(result, "shifty", 600))
    after = [p for p in result.plans if p.start_ns >= shift_ns]
    probe = next(i for i, p in enumerate(after) if p.reason == "acceptance_learning")
    following = [p for p in after[probe + 1:] if p.reason == "ordinary"][:3]
    assert all(p.lane_widths == (4,) for p in following), "ordinary rounds widen once the probe saw acceptance"
    before = [p for p in result.plans if p.end_ns <= shift_ns and p.reason == "ordinary" and p.graph.id != "prefill"]
    assert before[-1].lane_widths == (1,), "before the shift no draft was ever accepted: width one"
    # worst case: a probe (8 ms) just before the shift leaves 3 ms of debt, and the next
    # probe needs 5 ms more, earned at 1/99 of 5 ms width-one frames (one token each)
    tokens = _tokens_before(result, "shifty", after[probe].start_ns) - _tokens_before(result, "shifty", shift_ns)
    assert tokens <= 99 * (8 + 5) // 5 + 2


def _bursts_from(result, rid: str, tokens: int):
    """Bursts from the one at which the request's output reached ``tokens``."""
    total = 0
    for burst in result.request(rid).bursts:
        total += burst.tokens
        if total >= tokens:
            yield burst


def test_D8_fixed_width_trace_never_probes():
    adaptive, fixed = _run(_shifting_trace("adaptive")), _run(_shifting_trace("fixed"))
    assert adaptive.summary()["plans_by_reason"].get("acceptance_learning", 0) > 0
    assert "acceptance_learning" not in fixed.summary()["plans_by_reason"]


def test_D7_D8_aggregate_bounds_hold_over_a_long_simulated_run_with_stale_shapes_and_idle_gaps():
    """Bursts of requests (idle between them), shifting acceptance, estimates going stale every 300 ms."""
    requests = []
    for burst in range(12):
        for i in range(3):
            requests.append({
                "id": f"b{burst}-{i}", "arrival_ms": burst * 1500 + i * 7, "prompt_tokens": 64 + 32 * i,
                "max_tokens": 150 + 60 * i, "accepted_drafts": i,
                "acceptance_schedule": [{"after_tokens": 40 + 10 * i, "acceptance": [0.9, 0.7, 0.5][: i + 1]}],
            })
    trace = {"seed": 11, "policy": {"estimate_ttl_ns": 300 * MS}, "requests": requests}
    result = _run(trace)
    assert not result.stalled and all(o.finished_ns is not None for o in result.requests)
    ordinary = sum(p.actual_ns for p in result.plans if p.reason == "ordinary")
    for reason, share in (("timing_refresh", Fraction(2, 998)), ("acceptance_learning", Fraction(1, 99))):
        episodes = [p.actual_ns for p in result.plans if p.reason == reason]
        assert episodes, f"the run exercised {reason}"
        assert sum(episodes) <= share * ordinary + episodes[-1]


def test_A12_json_plans_carry_shape_cost_age_reason_and_credit():
    result = _run(_shifting_trace())
    plans = result.to_json()["plans"]
    assert {p["reason"] for p in plans} <= REASONS
    for plan in plans:
        for key in ("batch_capacity", "proposal_depth", "width", "aggregate", "selected_cost_ms",
                    "observation_age_ms", "exploration_credit_ms", "lane_widths"):
            assert key in plan
        assert set(plan["exploration_credit_ms"]) == {"timing_refresh", "acceptance_learning"}
    probes = [p for p in plans if p["reason"] == "acceptance_learning"]
    assert probes and all(p["exploration_credit_ms"]["acceptance_learning"] == 5.0 for p in probes)
    ages = [p["observation_age_ms"] for p in plans if p["reason"] == "timing_refresh"]
    assert ages and min(ages) >= 400, "refreshes run estimates older than the freshness interval"


def test_trace_out_writes_device_and_request_tracks(tmp_path):
    catalog, trace = tmp_path / "catalog.yaml", tmp_path / "trace.yaml"
    dump_yaml(CATALOG, catalog)
    doc = _shifting_trace()
    doc["requests"].append({"id": "other", "arrival_ms": 30, "prompt_tokens": 64, "max_tokens": 40})
    dump_yaml(doc, trace)
    out = tmp_path / "schedule.json"
    run = CliRunner().invoke(app, ["simulate", str(catalog), str(trace), "--json", "--trace-out", str(out)])
    assert run.exit_code == 0, run.output
    plans = json.loads(run.stdout)["plans"]
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(names.values()) == ["device", "request other", "request shifty"]
    device = [e for e in events if e["ph"] == "X" and names[e["tid"]] == "device"]
    assert len(device) == len(plans)
    for event, plan in zip(device, plans):
        assert event["ts"] == pytest.approx(plan["start_ms"] * 1000) and event["name"] == plan["graph"]
        assert (event["args"]["B"], event["args"]["D"], event["args"]["W"], event["args"]["P"]) == (
            plan["batch_capacity"], plan["proposal_depth"], plan["width"], plan["aggregate"])
        assert event["args"]["reason"] == plan["reason"] and event["args"]["cohort"] == plan["cohort"]
    bursts = json.loads(run.stdout)["requests"]
    for rid in ("shifty", "other"):
        tid = next(t for t, n in names.items() if n == f"request {rid}")
        instants = [e for e in events if e["ph"] == "i" and e["tid"] == tid]
        assert [e["args"]["tokens"] for e in instants] == [n for _, n in bursts[rid]["bursts"]]
        assert [e["ts"] / 1000 for e in instants] == pytest.approx([t for t, _ in bursts[rid]["bursts"]])
        lanes = [e for e in events if e["ph"] == "X" and e["tid"] == tid]
        assert len(lanes) == sum(rid in p["cohort"] for p in plans)


def test_trace_events_of_a_result_are_plain_json():
    result = _run(_shifting_trace(shift_after=100))
    assert json.loads(json.dumps(trace_events(result)))["displayTimeUnit"] == "ms"


def test_acceptance_schedule_round_trips_and_rejects_bad_input():
    trace = parse_trace(_shifting_trace())
    change = trace.requests[0].acceptance_schedule[0]
    assert (change.after_tokens, change.model) == (600, FixedAcceptance(3))
    assert trace.requests[0].acceptance_after(599) == FixedAcceptance(0)
    assert trace.requests[0].acceptance_after(600) == FixedAcceptance(3)
    assert parse_trace(trace_to_dict(trace)) == trace
    bad = _shifting_trace()
    bad["requests"][0]["acceptance_schedule"] = [{"after_tokens": 50, "accepted_drafts": 1},
                                                 {"after_tokens": 50, "accepted_drafts": 2}]
    with pytest.raises(SimulationFileError, match="after_tokens must strictly increase"):
        parse_trace(bad)
    bad["requests"][0]["acceptance_schedule"] = [{"after_tokens": 50, "acceptance": [0.5, 0.9]}]
    with pytest.raises(SimulationFileError, match="must not increase"):
        parse_trace(bad)
    bad["speculation"] = "sometimes"
    with pytest.raises(SimulationFileError, match="allowed: off, fixed, adaptive"):
        parse_trace(bad)
