"""``flare run --dump-estimates FILE``: the learned durations as a synthetic catalog.

On exit the server writes what its scheduler learned about each program's
device interval in the format ``flare simulate`` reads (docs/simulation.md,
parsed by ``helios.sim.files``), so a real deployment's timings can be
replayed on the simulator. A program is written only if the scheduler has
measured it; the others are named in a comment, as are programs of a kind the
simulator does not model (e.g. scored prefill). Nothing is written when no
program was measured, since a synthetic catalog needs at least one graph.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from flare_contract.graphs import GraphDescriptor, GraphKind
from helios.sim.files import SIMULATED_KINDS


def synthetic_entry(graph: GraphDescriptor, duration_ns: int) -> dict[str, Any]:
    """One ``graphs:`` entry: the descriptor's capacities and the estimate in milliseconds."""
    entry: dict[str, Any] = {"id": graph.id, "kind": graph.kind.value, "batch_capacity": graph.batch_capacity}
    if graph.kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL, GraphKind.MIXED):
        entry["prefill_capacity"] = graph.prefill_capacity
    if graph.kind in (GraphKind.SPECULATIVE, GraphKind.MIXED):
        entry["width"] = graph.width
    entry |= {"proposal_depth": graph.proposal_depth, "aggregate": graph.target_rows, "ragged": graph.ragged}
    if graph.value_source is not None:
        entry["value_source"] = graph.value_source.value
    if graph.proposal_source is not None:
        entry["proposal_source"] = graph.proposal_source
    if graph.speculation_enabled:
        entry["speculation_enabled"] = True
    entry["duration_ms"] = round(duration_ns / 1e6, 6)
    return entry


def estimates_document(graphs: Sequence[GraphDescriptor], durations: Mapping[str, int], request_slots: int,
                       source: str) -> str | None:
    """The YAML text (comments first), or None when no simulated program was measured."""
    simulated = [g for g in graphs if g.kind in SIMULATED_KINDS]
    measured = [synthetic_entry(g, durations[g.id]) for g in simulated if durations.get(g.id, 0) > 0]
    if not measured:
        return None
    unmeasured = [g.id for g in simulated if durations.get(g.id, 0) <= 0]
    other = [g.id for g in graphs if g.kind not in SIMULATED_KINDS]
    lines = [f"# Learned device durations of {source}, written by flare run --dump-estimates.",
             "# Each duration_ms is the scheduler's estimate when the server stopped."]
    if unmeasured:
        lines.append(f"# Never measured, so omitted: {', '.join(unmeasured)}")
    if other:
        lines.append(f"# Omitted, a kind flare simulate does not model: {', '.join(other)}")
    body = yaml.safe_dump({"request_slots": request_slots, "graphs": measured}, sort_keys=False)
    return "\n".join(lines) + "\n" + body


def write_estimates(path: Path, text: str) -> None:
    """Write atomically: a reader never sees half a file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)
