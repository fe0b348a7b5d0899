"""Synthetic catalog and trace files for ``flare simulate``: loading, validation, round trips."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from flare_contract.graphs import GraphKind, ValueSource
from helios.scheduler.config import PolicyConfig
from helios.sim.files import (
    FixedAcceptance,
    SampledAcceptance,
    SimulationFileError,
    catalog_to_dict,
    dump_yaml,
    load_catalog,
    load_trace,
    parse_catalog,
    parse_trace,
    trace_to_dict,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "simulation"

CATALOG = {
    "request_slots": 8,
    "graphs": [
        {"kind": "prefill", "batch_capacity": 1, "prefill_capacity": 512, "duration_ms": 20, "jitter_ms": 1.5},
        {"kind": "decode", "batch_capacity": 4, "duration_ms": 6},
        {"kind": "speculative", "batch_capacity": 4, "width": 4, "duration_ms": 12},
        {
            "kind": "speculative", "batch_capacity": 4, "width": 8, "ragged": True, "aggregate": 16,
            "value_source": "prefix_limit", "duration_ms": 14,
        },
        {"id": "mix", "kind": "mixed", "batch_capacity": 4, "prefill_capacity": 256, "duration_ms": 14},
    ],
}

TRACE = {
    "seed": 7,
    "policy": {"preset": "throughput", "token_fairness": 10},
    "requests": [
        {"id": "a", "arrival_ms": 0, "prompt_tokens": 64, "max_tokens": 32, "accepted_drafts": 3},
        {"id": "b", "arrival_ms": 2.5, "prompt_tokens": 640, "max_tokens": 8, "acceptance": [0.9, 0.6, 0.2]},
        {"id": "c", "arrival_ms": 5, "prompt_tokens": 64, "max_tokens": 8, "preseed_acceptance": True},
    ],
}


def test_catalog_loads_descriptors_durations_and_readable_ids():
    catalog = parse_catalog(CATALOG, "cat.yaml")
    ids = [g.descriptor.id for g in catalog.graphs]
    assert ids == ["prefill-b1-t512", "decode-b4", "speculative-b4-d3-w4", "speculative-b4-d7-w8-p16-limit", "mix"]
    prefill, decode, spec, limit, mixed = catalog.graphs
    assert prefill.duration_ns == 20_000_000 and prefill.jitter_ns == 1_500_000
    assert decode.descriptor.kind is GraphKind.DECODE and decode.descriptor.width == 1
    assert spec.descriptor.proposal_depth == 3  # D defaults to W - 1
    assert spec.descriptor.value_source is ValueSource.QUERY_LENGTH
    assert limit.descriptor.target_rows == 16 and limit.descriptor.value_source is ValueSource.PREFIX_LIMIT
    assert limit.descriptor.confidence_width == 7, "C12: device-allocated rounds declare confidence_width = D"
    assert mixed.descriptor.prefill_capacity == 256 and mixed.descriptor.kind is GraphKind.MIXED
    assert catalog.request_slots == 8


def test_request_slots_default_to_widest_batch():
    catalog = parse_catalog({"graphs": [{"kind": "decode", "batch_capacity": 16, "duration_ms": 5}]})
    assert catalog.request_slots == 16


def test_trace_loads_policy_acceptance_models_and_defaults():
    trace = parse_trace(TRACE, "trace.yaml")
    assert trace.seed == 7
    assert trace.policy == dataclasses.replace(PolicyConfig.preset("throughput"), token_fairness=10)
    a, b, c = trace.requests
    assert a.acceptance == FixedAcceptance(3) and a.arrival_ns == 0
    assert b.acceptance == SampledAcceptance((0.9, 0.6, 0.2)) and b.arrival_ns == 2_500_000
    assert c.acceptance == FixedAcceptance(0) and c.preseed_acceptance
    assert all(r.proposal_source == "learned" for r in trace.requests)


def test_round_trip_through_yaml_files(tmp_path):
    catalog, trace = parse_catalog(CATALOG), parse_trace(TRACE)
    dump_yaml(catalog_to_dict(catalog), tmp_path / "c.yaml")
    dump_yaml(trace_to_dict(trace), tmp_path / "t.yaml")
    assert load_catalog(tmp_path / "c.yaml") == catalog
    assert load_trace(tmp_path / "t.yaml") == trace


def _catalog_error(graph_changes: dict, drop: str | None = None) -> str:
    graph = {"kind": "decode", "batch_capacity": 4, "duration_ms": 6, **graph_changes}
    if drop:
        del graph[drop]
    with pytest.raises(SimulationFileError) as info:
        parse_catalog({"graphs": [graph]}, "cat.yaml")
    message = str(info.value)
    assert "\n" not in message and message.startswith("cat.yaml: graphs[0]")
    return message


@pytest.mark.parametrize(
    "changes, drop, expected",
    [
        ({"kind": "warp"}, None, "field 'kind': got 'warp'; allowed: prefill, decode, speculative, mixed"),
        ({"duration_ms": -3}, None, "field 'duration_ms': expected a finite number > 0, got -3"),
        ({"duration_ms": 0}, None, "field 'duration_ms': expected a finite number > 0, got 0"),
        ({}, "batch_capacity", "field 'batch_capacity': is required"),
        ({}, "duration_ms", "field 'duration_ms': is required"),
        ({"batch_capacity": "four"}, None, "field 'batch_capacity': expected an integer >= 1, got 'four'"),
        ({"batch_capacity": 2.5}, None, "field 'batch_capacity': expected an integer >= 1, got 2.5"),
        ({"colour": "red"}, None, "field 'colour': unknown field; allowed fields: id, kind"),
        ({"jitter_ms": 6}, None, "field 'jitter_ms': expected less than duration_ms (6)"),
        ({"prefill_capacity": 64}, None, "field 'prefill_capacity': got 64, but decode graphs take no prompt tokens"),
        ({"width": 4}, None, "field 'width': got 4, but decode graphs have width 1"),
        ({"ragged": "yes"}, None, "field 'ragged': expected true or false, got 'yes'"),
    ],
)
def test_bad_catalog_entries_name_file_entry_field_and_allowed(changes, drop, expected):
    assert expected in _catalog_error(changes, drop)


def test_bad_catalog_shape_reports_descriptor_rule():
    with pytest.raises(SimulationFileError, match=r"graphs\[0\].*rectangular programs need P = B \* W \(16\), got 12"):
        parse_catalog({"graphs": [{"kind": "speculative", "batch_capacity": 4, "width": 4, "aggregate": 12, "duration_ms": 9}]}, "c")


def test_catalog_rejects_duplicate_ids_and_empty_lists():
    twice = {"id": "x", "kind": "decode", "batch_capacity": 1, "duration_ms": 1}
    with pytest.raises(SimulationFileError, match="'x' is used twice"):
        parse_catalog({"graphs": [twice, twice]}, "c")
    with pytest.raises(SimulationFileError, match="field 'graphs': expected a non-empty list"):
        parse_catalog({"graphs": []}, "c")
    with pytest.raises(SimulationFileError, match="top level: expected a mapping"):
        parse_catalog(["nope"], "c")


def _trace_error(request_changes: dict, top_changes: dict | None = None) -> str:
    request = {"id": "a", "arrival_ms": 0, "prompt_tokens": 64, "max_tokens": 8, **request_changes}
    request = {k: v for k, v in request.items() if v is not ...}
    with pytest.raises(SimulationFileError) as info:
        parse_trace({"requests": [request], **(top_changes or {})}, "t.yaml")
    message = str(info.value)
    assert "\n" not in message and message.startswith("t.yaml: ")
    return message


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"prompt_tokens": ...}, "requests[0] (id 'a'): field 'prompt_tokens': is required"),
        ({"max_tokens": 0}, "field 'max_tokens': expected an integer >= 1, got 0"),
        ({"arrival_ms": -1}, "field 'arrival_ms': expected a finite number >= 0, got -1"),
        ({"accepted_drafts": 2, "acceptance": [0.5]}, "give either accepted_drafts or acceptance, not both"),
        ({"acceptance": [0.5, 1.5]}, "field 'acceptance': expected a list of probabilities in [0, 1]"),
        ({"acceptance": [0.2, 0.5]}, "survival probabilities must not increase with depth"),
        ({"proposal_source": "oracle"}, "field 'proposal_source': got 'oracle'; allowed: learned, copy"),
        ({"prompt": 5}, "field 'prompt': unknown field"),
    ],
)
def test_bad_trace_requests_name_the_request_and_field(changes, expected):
    assert expected in _trace_error(changes)


@pytest.mark.parametrize(
    "top, expected",
    [
        ({"policy": {"preset": "fast"}}, "policy: field 'preset': got 'fast'; allowed: balanced, throughput"),
        ({"policy": {"decode_age_price": -1}}, "policy: field 'decode_age_price': expected a finite number >= 0"),
        ({"policy": {"adaptive_verification_alpha": 0}}, "adaptive_verification_alpha must be > 0"),
        ({"policy": {"fairness": 1}}, "policy: field 'fairness': unknown field; allowed fields: preset, output_token_value"),
        ({"seed": "x"}, "top level: field 'seed': expected an integer >= 0"),
    ],
)
def test_bad_trace_policy_and_seed(top, expected):
    assert expected in _trace_error({}, top)


def test_unreadable_and_invalid_yaml_files(tmp_path):
    with pytest.raises(SimulationFileError, match="missing.yaml: cannot read the file"):
        load_catalog(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("graphs: [\n  - {kind: decode\n")
    with pytest.raises(SimulationFileError, match=r"broken.yaml: not valid YAML \(line \d+"):
        load_catalog(broken)


def test_example_files_load():
    """The worked example that docs/simulation.md runs stays valid."""
    catalog = load_catalog(EXAMPLES / "catalog.yaml")
    trace = load_trace(EXAMPLES / "trace.yaml")
    assert len(catalog.graphs) >= 10 and len(trace.requests) >= 3


@pytest.mark.parametrize("field", ["terminal_value", "terminal_age_price"])
def test_terminal_policy_fields_reach_the_scheduler(field):
    """Terminal snapshots run (spec P6, issue 21): a trace may price them."""
    trace = parse_trace({**TRACE, "policy": {"preset": "balanced", field: 3}}, "trace.yaml")
    assert getattr(trace.policy, field) == 3


def test_conversation_turns_name_an_earlier_turn_and_no_arrival():
    turns = [{"id": "a", "prompt_tokens": 10, "max_tokens": 2},
             {"id": "b", "follows": "a", "think_ms": 5, "prompt_tokens": 4, "max_tokens": 2}]
    trace = parse_trace({**TRACE, "requests": turns, "checkpoint_rows": 2}, "trace.yaml")
    assert trace.requests[1].follows == "a" and trace.requests[1].think_ms == 5 and trace.checkpoint_rows == 2
    with pytest.raises(SimulationFileError, match="not an earlier request"):
        parse_trace({**TRACE, "requests": turns[::-1]}, "trace.yaml")
    with pytest.raises(SimulationFileError, match="arrival_ms"):
        parse_trace({**TRACE, "requests": [turns[0], {**turns[1], "arrival_ms": 3}]}, "trace.yaml")

