"""One set of speculation modes for the scheduler, the engine, ``flare run`` and simulator traces.

The spec names three ways to run ("ordinary, fixed-width, and adaptive
speculative execution", section on runtime phase tests; D8 for fixed-width).
``helios.scheduler.config.SPECULATION_MODES`` is the one definition; the core
used to accept only ``adaptive`` and ``fixed`` while the engine accepted
``off`` too, and passed ``off`` on as ``fixed``.
"""

from __future__ import annotations

import pytest

from helios.launch import LaunchError, RunOptions
from helios.runtime.engine import EngineConfig
from helios.scheduler import Scheduler
from helios.scheduler.config import SPECULATION_MODES
from helios.sim.files import parse_catalog, parse_trace
from helios.sim.simulator import Simulation
from tests.helios.scheduler.sched_harness import decode, prefill, spec

ONE = {"id": "r", "arrival_ms": 0, "prompt_tokens": 8, "max_tokens": 2}


def test_the_three_modes_of_the_spec():
    assert set(SPECULATION_MODES) == {"off", "fixed", "adaptive"}


@pytest.mark.parametrize("mode", SPECULATION_MODES)
def test_every_layer_accepts_every_mode(mode):
    graphs = [prefill(64), decode(1)] + ([] if mode == "off" else [spec(1, 4)])
    assert Scheduler(graphs, request_slots=2, speculation=mode).speculation == mode
    assert EngineConfig(speculation=mode).speculation == mode
    assert RunOptions(speculation=mode).speculation == mode
    assert parse_trace({"speculation": mode, "requests": [ONE]}).speculation == mode


def test_every_layer_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="speculation must be one of off, fixed, adaptive"):
        Scheduler([decode(1)], request_slots=1, speculation="on")
    with pytest.raises(ValueError):
        EngineConfig(speculation="on")
    with pytest.raises(LaunchError):
        RunOptions(speculation="on")
    with pytest.raises(ValueError):
        parse_trace({"speculation": "on", "requests": [ONE]})


def test_off_refuses_a_program_that_draws_proposals():
    """Speculation off runs no speculative program: handed one, the scheduler says so."""
    with pytest.raises(ValueError, match="speculation off runs no speculative programs"):
        Scheduler([decode(1), spec(1, 4)], request_slots=1, speculation="off")


def test_a_simulated_trace_with_speculation_off_runs_no_speculative_program():
    catalog = parse_catalog({"request_slots": 2, "graphs": [
        {"id": "prefill", "kind": "prefill", "batch_capacity": 1, "prefill_capacity": 64, "duration_ms": 10},
        {"id": "decode", "kind": "decode", "batch_capacity": 2, "duration_ms": 3},
        {"id": "spec", "kind": "speculative", "batch_capacity": 2, "width": 4, "duration_ms": 4},
    ]})
    requests = [{"id": f"r{i}", "arrival_ms": 0, "prompt_tokens": 64, "max_tokens": 9} for i in range(2)]
    ran = {}
    for mode in ("off", "adaptive"):
        result = Simulation(catalog, parse_trace({"speculation": mode, "requests": requests})).run()
        ran[mode] = {plan.graph.id for plan in result.plans}
    assert "spec" in ran["adaptive"]  # the same trace speculates when allowed to
    assert ran["off"] == {"prefill", "decode"}
