"""Flare's own counters from ``GET /metrics``, before and after a run, as deltas.

Only what a run changes: executed programs and their device time by graph
kind and selection category, and speculative acceptance. A server without
these families (vLLM, or no /metrics at all) yields None and the report
leaves the section out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

EXECUTIONS = "flare_scheduler_executions_total"
NANOSECONDS = "flare_scheduler_execution_nanoseconds_total"
SPECULATIVE = ("rounds", "draft_tokens", "accepted_tokens", "emitted_tokens")

Snapshot = Mapping[tuple[str, tuple[tuple[str, str], ...]], float]  # (sample name, sorted labels) -> value


async def scrape(client: httpx.AsyncClient, url: str, headers: Mapping[str, str]) -> Snapshot | None:
    """Flare's counter samples, or None when the server has no readable /metrics."""
    try:
        response = await client.get(url.rstrip("/") + "/metrics", headers=dict(headers))
        if response.status_code != 200:
            return None
        return _flare_samples(response.text)
    except (httpx.HTTPError, ValueError):
        return None


def _flare_samples(text: str) -> Snapshot:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith(("flare_scheduler_", "flare_speculative_"))
    }


@dataclass(frozen=True, slots=True)
class GraphExecutions:
    graph_kind: str
    category: str
    executions: int
    device_ms: float


@dataclass(frozen=True, slots=True)
class ServerDeltas:
    executions: tuple[GraphExecutions, ...]  # rows with at least one execution in the run
    speculative: dict[str, float]  # counter deltas by short name, plus acceptance_rate when drafts ran

    def to_json(self) -> dict:
        rows = [{"graph_kind": r.graph_kind, "category": r.category, "executions": r.executions,
                 "device_ms": r.device_ms} for r in self.executions]
        return {"executions": rows, "speculative": self.speculative}


def deltas(before: Snapshot | None, after: Snapshot | None) -> ServerDeltas | None:
    if not before or not after:
        return None
    change = {key: value - before.get(key, 0.0) for key, value in after.items()}
    rows = []
    for (name, labels), count in sorted(change.items()):
        if name == EXECUTIONS and count > 0:
            label = dict(labels)
            nanos = change.get((NANOSECONDS, labels), 0.0)
            rows.append(GraphExecutions(label.get("graph_kind", "?"), label.get("category", "?"), int(count), nanos / 1e6))
    return ServerDeltas(tuple(rows), _speculative(change))


def _speculative(change: Mapping[tuple[str, tuple], float]) -> dict[str, float]:
    totals = {short: _summed(change, f"flare_speculative_{short}_total") for short in SPECULATIVE}
    if totals["draft_tokens"] > 0:
        totals["acceptance_rate"] = totals["accepted_tokens"] / totals["draft_tokens"]
    return totals


def _summed(change: Mapping[tuple[str, tuple], float], name: str) -> float:
    """A counter's change over all its label sets (the speculative ones are labelled by source)."""
    return sum(value for (sample, _), value in change.items() if sample == name)
