"""Regression guard for refactors and speed work on the scheduler: decisions must not move.

This is NOT a specification test. ``data/plan_regression.json`` holds what the
scheduler decided, plan by plan, on seeded simulator runs (the cases are in
``plan_regression_cases.py``: every graph kind, ragged and prefix-limit
speculation, two proposal sources, cold and measured catalogs, more requests
than slots, cancellations, cached prefixes and endpoints). It was recorded from
the scheduler itself, so it says nothing about whether those decisions are
right; the spec tests do. It says that a change meant to keep behaviour (a
faster snapshot, cached rankings, precomputed dominance) really kept it: the
same graphs, cohorts, lane numbers, value rates and bursts, bit for bit.

When a change is meant to alter scheduling, regenerate the file with
``scripts/record_plan_regression.py`` and say so in the commit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plan_regression_cases import CASES, record

RECORDED = Path(__file__).parent / "data" / "plan_regression.json"


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(RECORDED.read_text())


def _first_difference(expected: list, actual: list) -> str:
    for index, (want, got) in enumerate(zip(expected, actual)):
        if want != got:
            return f"plan {index}: recorded {want}\n           now      {got}"
    return f"recorded {len(expected)} plans, now {len(actual)}"


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_plan_sequence_unchanged(case, recorded):
    want = recorded[case.name]
    got = json.loads(json.dumps(record(case)))  # the same JSON round trip the file went through
    assert got["plans"] == want["plans"], _first_difference(want["plans"], got["plans"])
    assert got["bursts"] == want["bursts"]
    assert (got["end_ns"], got["stalled"]) == (want["end_ns"], want["stalled"])
