"""The direct engine: Helios's engine loop and executor, driving the direct scheduler.

``HeliosEngine`` owns the control thread, the device worker, pages,
detokenization and publication, and builds its scheduler through the factory
it is given; this engine hands it one that builds a ``DirectScheduler`` and
returns its core. So the HTTP layer, executor and page handling are the
production ones, and only selection and cost estimates differ. ``/debug/state``
reads the engine's public ``state_snapshot``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from flare_contract.graphs import GraphDescriptor
from helios.catalog.load import Catalog
from helios.direct.scheduler import DirectScheduler, LoggedDecision
from helios.runtime.engine import EngineConfig, HeliosEngine
from helios.runtime.executor import Program
from helios.scheduler import Scheduler


class DirectEngine(HeliosEngine):
    """A ``helios.runtime.engine_api.Engine`` scheduled by ``DirectScheduler``."""

    def __init__(self, catalog: Catalog, config: EngineConfig = EngineConfig(),
                 program_for: Callable[[str], Program] | None = None,
                 on_decision: Callable[[LoggedDecision], None] | None = None) -> None:
        built: list[DirectScheduler] = []

        def make_scheduler(graphs: Sequence[GraphDescriptor], **options) -> Scheduler:
            built.append(DirectScheduler(graphs, on_decision=on_decision, **options))
            return built[-1].scheduler

        # its small scheduler runs inference only: no restores or snapshots (docs/debug-serve.md)
        super().__init__(catalog, replace(config, prefix_reuse=False), program_for, make_scheduler)
        self.direct = built[0]

    def debug_state(self) -> dict:
        """Programs (estimate and age), requests (phase and counters), the last decisions with scores."""
        state = self.state_snapshot(self._direct_state)
        programs, decisions = state.detail
        return {
            "now_ns": state.now_ns,
            "queued_fences": list(state.queued_fences),
            "waiting_requests": state.waiting_requests,
            "programs": programs,
            "requests": self.direct.requests_state(state.requests),
            "decisions": [_decision_json(d, state.now_ns) for d in decisions],
        }

    def _direct_state(self) -> tuple[list[dict], list[LoggedDecision]]:
        return self.direct.programs_state(), list(self.direct.decisions)


def _decision_json(d: LoggedDecision, now_ns: int) -> dict:
    return {
        "ago_ms": (now_ns - d.at_ns) / 1e6,
        "program": d.program,
        "reason": d.reason,
        "score": d.score,
        "estimated_ns": d.estimated_ns,
        "lanes": [{"slot": slot, "phase": phase, "rows": n} for slot, phase, n in d.lanes],
        "runners_up": [{"program": r.program, "score": r.score, "measured": r.measured, "padding": r.padding}
                       for r in d.runners_up],
    }

