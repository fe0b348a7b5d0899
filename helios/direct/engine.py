"""The direct engine: Helios's engine loop and executor with the direct scheduler in its place.

``HeliosEngine`` owns the control thread, the device worker, pages,
detokenization and publication; the only thing it asks of its scheduler is
the ``helios.scheduler.Scheduler`` interface, which ``DirectScheduler`` keeps.
So this engine swaps the scheduler right after construction instead of
running a second loop: the HTTP layer, executor and page handling are the
production ones, and only selection and cost estimates differ.
"""

from __future__ import annotations

from collections.abc import Callable

from helios.catalog.load import Catalog
from helios.direct.scheduler import Decision, DirectScheduler
from helios.runtime.engine import EngineConfig, HeliosEngine
from helios.runtime.executor import Program


class DirectEngine(HeliosEngine):
    """A ``helios.runtime.engine_api.Engine`` scheduled by ``DirectScheduler``."""

    def __init__(self, catalog: Catalog, config: EngineConfig = EngineConfig(),
                 program_for: Callable[[str], Program] | None = None,
                 on_decision: Callable[[Decision], None] | None = None) -> None:
        super().__init__(catalog, config, program_for)
        production = self.scheduler  # never planned with: replaced before the threads start
        self.scheduler = DirectScheduler(production.graphs, request_slots=production.request_slots,
                                         policy=config.policy, speculation=production.speculation,
                                         on_decision=on_decision)

    def debug_state(self) -> dict:
        """Programs (estimate and age), requests (phase and counters), the last decisions with scores."""
        with self._lock:  # the control thread holds it while it plans, commits and completes
            s = self.scheduler
            now = s.now_ns
            return {
                "now_ns": now,
                "queued_fences": list(s.queued_fences),
                "waiting_requests": len(self._waiting),
                "programs": s.programs_state(),
                "requests": s.requests_state(),
                "decisions": [_decision_json(d, now) for d in s.decisions],
            }


def _decision_json(d: Decision, now_ns: int) -> dict:
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
