"""The simulator's own mechanics, and ``flare simulate`` end to end.

The first half drives the event loop with ``FakeScheduler`` (tests/helios/
simulator_fakes.py), a trivial policy that follows the public API, so each
mechanic is checked on its own: frame order and timing, publication, slots,
measured vs cold catalogs, the clock limit, acceptance models and the device
allocation rule. The second half runs the real scheduler through the CLI.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml
from simulator_fakes import FakeScheduler
from typer.testing import CliRunner

from helios.cli import app
from helios.scheduler.types import ExecutionTiming
from helios.sim.files import FixedAcceptance, SampledAcceptance, parse_catalog, parse_trace
from helios.sim.simulator import (
    Simulation,
    SimulationOptions,
    accepted_drafts,
    allocate_prefixes,
    prefix_confidence,
)

MS = 1_000_000

FAKE_CATALOG = {
    "request_slots": 4,
    "graphs": [
        {"id": "prefill", "kind": "prefill", "batch_capacity": 1, "prefill_capacity": 64, "duration_ms": 10},
        {"id": "spec", "kind": "speculative", "batch_capacity": 2, "width": 4, "duration_ms": 4},
    ],
}


def _trace(*requests: dict, seed: int = 0) -> dict:
    return {"seed": seed, "requests": list(requests)}


def _request(rid: str, arrival_ms: float = 0, prompt: int = 64, max_tokens: int = 9, **extra) -> dict:
    return {"id": rid, "arrival_ms": arrival_ms, "prompt_tokens": prompt, "max_tokens": max_tokens, **extra}


def _run_fake(trace: dict, catalog: dict = FAKE_CATALOG, **options):
    catalog_, trace_ = parse_catalog(catalog), parse_trace(trace)
    fake = FakeScheduler(catalog_.descriptors(), catalog_.request_slots)
    result = Simulation(catalog_, trace_, SimulationOptions(**options), scheduler=fake).run()
    return result, fake


def test_frames_execute_back_to_back_in_commit_order():
    result, _ = _run_fake(_trace(*(_request(f"r{i}", accepted_drafts=3) for i in range(4))))
    plans = result.plans
    assert [p.fence for p in plans] == list(range(1, len(plans) + 1))
    for earlier, later in zip(plans, plans[1:]):
        assert later.start_ns >= earlier.end_ns, "the device runs one frame at a time"
    queued = [(a, b) for a, b in zip(plans, plans[1:]) if b.start_ns == a.end_ns and b.graph.id == "spec"]
    assert queued, "a frame committed while the device is busy starts when the previous one ends"
    assert all(p.actual_ns == (10 if p.graph.id == "prefill" else 4) * MS for p in plans)


def test_bursts_are_published_at_completion_time_with_their_fence():
    result, fake = _run_fake(_trace(_request("a", accepted_drafts=3), _request("b", accepted_drafts=1)))
    completions = {details[0]: now for now, details in fake.called("complete")}
    published = fake.called("published_output")
    assert published, "every visible burst is reported to the scheduler"
    for now, (handle, fence) in published:
        assert now == completions[fence], "published at the completion time of its own frame"
    times = {b.time_ns for o in result.requests for b in o.bursts}
    assert times <= set(completions.values())
    # every burst is reported, the one that finishes its request included
    assert len(published) == sum(len(o.bursts) for o in result.requests)


def test_prompt_then_speculative_bursts_follow_fixed_acceptance():
    result, _ = _run_fake(_trace(_request("a", max_tokens=12, accepted_drafts=2)))
    outcome = result.request("a")
    # prompt: one token; width-4 rounds: 2 accepted drafts + bonus = 3; the limit trims the last burst
    assert [b.tokens for b in outcome.bursts] == [1, 3, 3, 3, 2]
    assert outcome.tokens == 12 and outcome.finished_ns == outcome.bursts[-1].time_ns


def test_completion_timing_reports_the_frame_interval():
    _, fake = _run_fake(_trace(_request("a", max_tokens=3)))
    timings = [details[2] for _, details in fake.called("complete")]
    assert timings[0] == ExecutionTiming(device_ns=10 * MS, wall_ns=10 * MS)
    assert timings[1] == ExecutionTiming(device_ns=4 * MS, wall_ns=4 * MS)


def test_requests_wait_for_a_free_slot():
    catalog = {**FAKE_CATALOG, "request_slots": 1}
    result, _ = _run_fake(_trace(_request("a", max_tokens=2), _request("b", arrival_ms=1, max_tokens=2)), catalog)
    a, b = result.request("a"), result.request("b")
    assert a.admitted_ns == 0
    assert b.admitted_ns == a.finished_ns, "admitted when the only slot frees"
    assert b.finished_ns is not None


def test_arrival_admits_at_its_own_time():
    result, fake = _run_fake(_trace(_request("a", max_tokens=40), _request("b", arrival_ms=7.5, max_tokens=2)))
    assert result.request("b").admitted_ns == 7_500_000
    assert [now for now, _ in fake.called("admit")] == [0, 7_500_000]


def test_measured_catalog_observes_every_graph_once_at_time_zero():
    _, fake = _run_fake(_trace(_request("a", max_tokens=2)))
    assert fake.called("observe_duration") == [(0, ("prefill", 10 * MS)), (0, ("spec", 4 * MS))]
    _, cold = _run_fake(_trace(_request("a", max_tokens=2)), cold=True)
    assert cold.called("observe_duration") == []


def test_until_ms_stops_the_clock():
    result, _ = _run_fake(_trace(_request("a", max_tokens=500, accepted_drafts=3)), until_ns=50 * MS)
    assert result.end_ns == 50 * MS
    assert all(p.start_ns <= 50 * MS for p in result.plans)
    assert all(b.time_ns <= 50 * MS for b in result.request("a").bursts)
    assert result.request("a").finished_ns is None and not result.stalled


def test_a_scheduler_that_never_plans_is_reported_as_stalled():
    catalog_, trace_ = parse_catalog(FAKE_CATALOG), parse_trace(_trace(_request("a")))
    fake = FakeScheduler(catalog_.descriptors(), catalog_.request_slots, never_plan=True)
    result = Simulation(catalog_, trace_, scheduler=fake).run()
    assert result.stalled and result.summary()["stalled"] and result.plans == ()


def test_json_document_shape():
    result, _ = _run_fake(_trace(_request("a", max_tokens=4, accepted_drafts=3)))
    doc = json.loads(json.dumps(result.to_json()))
    assert set(doc) == {"requests", "plans", "summary"}
    assert doc["requests"]["a"]["bursts"] == [[10.0, 1], [14.0, 3]]
    assert doc["requests"]["a"]["admitted_ms"] == 0.0 and doc["requests"]["a"]["finished_ms"] == 14.0
    first = doc["plans"][0]
    for key in ("start_ms", "end_ms", "kind", "batch_capacity", "proposal_depth", "width", "aggregate",
                "prefill_capacity", "cohort", "reason", "estimated_ms", "actual_ms"):
        assert key in first
    assert first["kind"] == "prefill" and first["cohort"] == ["a"] and first["reason"] == "ordinary"
    assert doc["plans"][1]["aggregate"] == 8 and doc["plans"][1]["estimated_ms"] == 1.0
    assert doc["summary"]["plans_by_kind"] == {"prefill": 1, "speculative": 1}


def test_jitter_is_seeded_and_bounded():
    catalog = {"graphs": [dict(g, jitter_ms=2) if g["id"] == "spec" else g for g in FAKE_CATALOG["graphs"]]}
    trace = _trace(_request("a", max_tokens=30, accepted_drafts=0), seed=3)
    durations = [p.actual_ns for p in _run_fake(trace, catalog)[0].plans if p.graph.id == "spec"]
    again = [p.actual_ns for p in _run_fake(trace, catalog)[0].plans if p.graph.id == "spec"]
    assert durations == again, "the same seed reproduces the run"
    assert all(2 * MS <= d <= 6 * MS for d in durations) and len(set(durations)) > 1


# ---------------------------------------------------------------------------
# Acceptance models and the device allocation rule (spec S2)
# ---------------------------------------------------------------------------


def test_fixed_acceptance_is_capped_by_what_was_offered():
    rng = random.Random(0)
    assert accepted_drafts(FixedAcceptance(7), 3, rng) == 3
    assert accepted_drafts(FixedAcceptance(2), 7, rng) == 2
    assert accepted_drafts(FixedAcceptance(5), 0, rng) == 0


def test_sampled_acceptance_matches_survival_probabilities():
    rng = random.Random(42)
    model = SampledAcceptance((0.8, 0.5, 0.2))
    draws = [accepted_drafts(model, 5, rng) for _ in range(20_000)]
    survived = [sum(d >= depth for d in draws) / len(draws) for depth in (1, 2, 3, 4)]
    assert survived[:3] == pytest.approx([0.8, 0.5, 0.2], abs=0.015)
    assert survived[3] == 0.0, "positions past the list never survive"
    assert all(d <= 2 for d in (accepted_drafts(model, 2, rng) for _ in range(100)))


def test_prefix_confidence_reports_the_acceptance_model():
    assert prefix_confidence(FixedAcceptance(2), 4) == (1.0, 1.0, 0.0, 0.0)
    assert prefix_confidence(SampledAcceptance((0.9, 0.4)), 3) == (0.9, 0.4, 0.0)


def test_S2_device_allocation_takes_the_best_causal_frontier_within_P():
    confidence = [(0.9, 0.8, 0.1), (0.95, 0.3, 0.2), (0.5, 0.4, 0.3)]
    # 3 pending rows + 4 spare: 0.95 (lane 1), 0.9 (lane 0), 0.8 (lane 0), 0.5 (lane 2)
    assert allocate_prefixes([4, 4, 4], confidence, [0, 1, 2], rows=7) == [3, 2, 2]
    # ceilings bound each lane even when rows remain
    assert allocate_prefixes([2, 1, 4], confidence, [0, 1, 2], rows=12) == [2, 1, 4]


def test_S2_device_allocation_ties_prefer_shorter_prefix_then_lower_slot():
    confidence = [(0.5, 0.5), (0.5, 0.5)]
    # equal probabilities: the shorter prefix first, so both lanes grow before either grows twice
    assert allocate_prefixes([3, 3], confidence, [0, 1], rows=4) == [2, 2]
    # same depth and probability: the lower original slot wins
    assert allocate_prefixes([3, 3], confidence, [5, 2], rows=3) == [1, 2]


# ---------------------------------------------------------------------------
# flare simulate end to end (the real scheduler)
# ---------------------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "simulation"


def _invoke(*args: str):
    return CliRunner().invoke(app, ["simulate", *map(str, args)])


def _write(path: Path, document) -> Path:
    path.write_text(yaml.safe_dump(document))
    return path


def test_cli_json_stdout_is_only_the_document():
    result = _invoke(EXAMPLES / "catalog.yaml", EXAMPLES / "trace.yaml", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    trace = yaml.safe_load((EXAMPLES / "trace.yaml").read_text())
    assert set(doc["requests"]) == {r["id"] for r in trace["requests"]}
    assert doc["summary"]["finished"] == len(trace["requests"]) and not doc["summary"]["stalled"]
    for rid, outcome in doc["requests"].items():
        request = next(r for r in trace["requests"] if r["id"] == rid)
        assert sum(tokens for _, tokens in outcome["bursts"]) == request["max_tokens"], rid
        assert outcome["finished_ms"] == outcome["bursts"][-1][0]
    starts = [p["start_ms"] for p in doc["plans"]]
    assert starts == sorted(starts) and doc["summary"]["plans"] == len(doc["plans"])


def test_cli_tables_name_every_request():
    result = _invoke(EXAMPLES / "catalog.yaml", EXAMPLES / "trace.yaml")
    assert result.exit_code == 0, result.output
    assert "Requests" in result.stdout and "Summary" in result.stdout
    assert "chat-1" in result.stdout and "speculative" in result.stdout


def test_cli_cold_catalog_discovers_durations():
    result = _invoke(EXAMPLES / "catalog.yaml", EXAMPLES / "trace.yaml", "--json", "--cold")
    doc = json.loads(result.stdout)
    assert doc["summary"]["catalog"] == "cold"
    assert doc["plans"][0]["reason"] == "discovery" and doc["plans"][0]["estimated_ms"] == 0.0
    measured = json.loads(_invoke(EXAMPLES / "catalog.yaml", EXAMPLES / "trace.yaml", "--json").stdout)
    assert "discovery" not in measured["summary"]["plans_by_reason"]


def test_cli_until_ms_stops_the_clock():
    doc = json.loads(_invoke(EXAMPLES / "catalog.yaml", EXAMPLES / "trace.yaml", "--json", "--until-ms", "100").stdout)
    assert doc["summary"]["end_ms"] == 100.0
    assert all(b[0] <= 100.0 for r in doc["requests"].values() for b in r["bursts"])
    assert doc["summary"]["finished"] < len(doc["requests"])


@pytest.mark.parametrize(
    "catalog_graph, expected",
    [
        ({"kind": "warp", "batch_capacity": 1, "duration_ms": 5}, "field 'kind': got 'warp'; allowed:"),
        ({"kind": "decode", "batch_capacity": 1, "duration_ms": -5}, "field 'duration_ms': expected a finite number > 0, got -5"),
        ({"kind": "decode", "duration_ms": 5}, "field 'batch_capacity': is required"),
    ],
)
def test_cli_bad_catalog_is_one_line_exit_2(tmp_path, catalog_graph, expected):
    catalog = _write(tmp_path / "cat.yaml", {"graphs": [catalog_graph]})
    result = _invoke(catalog, EXAMPLES / "trace.yaml")
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "cat.yaml: graphs[0]" in lines[0]
    assert expected in lines[0]
    assert "Traceback" not in result.output


def test_cli_bad_trace_and_missing_file_are_one_line_exit_2(tmp_path):
    trace = _write(tmp_path / "trace.yaml", {"requests": [{"id": "a", "prompt_tokens": 64}]})
    result = _invoke(EXAMPLES / "catalog.yaml", trace)
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {trace}: requests[0] (id 'a'): field 'max_tokens': is required"
    missing = _invoke(tmp_path / "nope.yaml", trace)
    assert missing.exit_code == 2 and "nope.yaml: cannot read the file" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


def test_S2_prefix_limit_rounds_complete_as_packed_rounds_with_the_real_scheduler():
    """Device-allocated rounds go through complete_packed_round and commit what the device allocated."""
    catalog = parse_catalog({
        "graphs": [
            {"kind": "prefill", "batch_capacity": 1, "prefill_capacity": 64, "duration_ms": 3},
            {"kind": "speculative", "batch_capacity": 4, "width": 8, "ragged": True, "aggregate": 12,
             "value_source": "prefix_limit", "duration_ms": 6},
        ],
    })
    trace = parse_trace(_trace(
        _request("sure", max_tokens=40, accepted_drafts=7),
        _request("never", max_tokens=40, accepted_drafts=0),
        _request("unsure", max_tokens=40, acceptance=[0.9, 0.7, 0.5, 0.3]),
    ))
    result = Simulation(catalog, trace).run()
    assert not result.stalled and all(o.finished_ns is not None for o in result.requests)
    assert all(o.tokens == 40 for o in result.requests)
    rounds = [p for p in result.plans if p.graph.kind.value == "speculative"]
    assert rounds, "the prefix-limit program ran"
    # never-accepting drafts: every round commits exactly the pending token
    assert all(b.tokens == 1 for b in result.request("never").bursts)
    # the sure request gets more rows than the one whose drafts never survive
    assert len(result.request("sure").bursts) < len(result.request("never").bursts)


def test_S8_preseeded_history_starts_speculation_at_the_width_it_supports():
    """preseed_acceptance: 64 observed rounds of 7 accepted drafts make the first round the widest.

    Untrained, the request starts at the prior 0.5^d, so its first speculative
    round is narrow; preseeded with its own acceptance, the first round already
    uses the full width.
    """
    catalog = parse_catalog({
        "graphs": [
            {"kind": "prefill", "batch_capacity": 1, "prefill_capacity": 64, "duration_ms": 3},
            *({"kind": "speculative", "batch_capacity": 1, "width": w, "duration_ms": 2.5 + 0.5 * w} for w in (2, 4, 8)),
        ],
    })

    def first_round_width(preseed: bool) -> int:
        trace = parse_trace(_trace(_request("a", max_tokens=30, accepted_drafts=7, preseed_acceptance=preseed)))
        result = Simulation(catalog, trace, SimulationOptions()).run()
        return next(p.graph.width for p in result.plans if p.graph.kind.value == "speculative")

    assert first_round_width(preseed=True) == 8
    assert first_round_width(preseed=False) < 8


def test_conversation_turns_restore_the_previous_turns_checkpoint():
    """Issue 21: follow-up turns restore the terminal checkpoint of the turn they extend and prefill
    only the new part; without reuse every turn prefills its whole prompt. Nothing stalls."""
    import dataclasses
    from pathlib import Path

    from flare_contract.graphs import GraphKind
    from helios.sim.files import load_catalog, load_trace
    from helios.sim.simulator import simulate

    here = Path(__file__).resolve().parents[2] / "examples" / "simulation" / "conversations"
    catalog, trace = load_catalog(here / "catalog.yaml"), load_trace(here / "trace.yaml")
    on = simulate(catalog, dataclasses.replace(trace, reuse=True))
    off = simulate(catalog, dataclasses.replace(trace, reuse=False))
    assert not on.stalled and not off.stalled
    for outcome in on.requests:
        first_turn = outcome.id.endswith("t1")
        assert (outcome.cached_tokens == 0) == first_turn
        if not first_turn:  # the previous prompt and answer, less the pending last token
            assert outcome.prompt_tokens - outcome.cached_tokens == 120 + 1
        assert outcome.tokens == 64
    assert all(o.cached_tokens == 0 for o in off.requests)
    kinds = {p.graph.kind for p in on.plans}
    assert {GraphKind.RESTORE, GraphKind.SNAPSHOT} <= kinds
    assert not {GraphKind.RESTORE, GraphKind.SNAPSHOT} & {p.graph.kind for p in off.plans}
    # the same turn's prompt is the same length either way: reuse changes the work, not the tokens
    assert [o.prompt_tokens for o in on.requests] == [o.prompt_tokens for o in off.requests]
