"""Medians over repetitions, ratios to Flare, and the one table a run prints (Markdown, pasteable into docs)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


SERVER_CORES = "server_cpu_cores"  # added to each flare bench document by the harness (cli._measure)


@dataclass(frozen=True, slots=True)
class Column:
    cell: str  # a Cell.key
    metric: str  # a key of flare bench's --json document
    header: str


def columns(cell_keys: list[str]) -> list[Column]:
    """Throughput for every cell; TPOT where one stream shows it, TTFT where queues show it."""
    out = []
    for key in cell_keys:
        out.append(Column(key, "output_throughput", f"{key} tok/s"))
        if key == "c=1":
            out.append(Column(key, "median_tpot_ms", f"{key} TPOT ms"))
        if key == "c=16" or key.startswith("rate="):
            out.append(Column(key, "median_ttft_ms", f"{key} TTFT p50 ms"))
        if key.startswith("rate="):
            out.append(Column(key, "median_tpot_ms", f"{key} TPOT p50 ms"))
    return out


@dataclass(slots=True)
class Results:
    """flare bench documents by (system, cell key), in run order, and why a system has none."""

    expected_input: int
    expected_output: int
    runs: dict[tuple[str, str], list[dict]] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)

    def add(self, system: str, cell: str, document: dict) -> None:
        self.runs.setdefault((system, cell), []).append(document)

    def median(self, system: str, column: Column) -> float | None:
        values = [d[column.metric] for d in self.runs.get((system, column.cell), []) if d.get(column.metric) is not None]
        return statistics.median(values) if values else None

    def problems(self, system: str, cell: str) -> list[str]:
        """Runs that failed requests or did not send/receive the exact lengths (usage counts)."""
        found = []
        for rep, doc in enumerate(self.runs.get((system, cell), []), 1):
            completed = doc.get("completed") or 0
            if doc.get("failed"):
                found.append(f"rep {rep}: {doc['failed']} failed ({_first_error(doc)})")
            if doc.get("total_output_tokens") != self.expected_output * completed:
                found.append(f"rep {rep}: {doc.get('total_output_tokens')} output tokens for {completed} requests, "
                             f"expected {self.expected_output} each")
            if doc.get("total_input_tokens") != self.expected_input * completed:
                found.append(f"rep {rep}: {doc.get('total_input_tokens')} prompt tokens for {completed} requests, "
                             f"expected {self.expected_input} each")
        return found


def _first_error(doc: dict) -> str:
    return next((e for e in doc.get("errors", []) if e), "no message")


def ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or not reference:
        return None
    return value / reference


def format_cell(value: float | None, reference: float | None, flagged: bool) -> str:
    if value is None:
        return "-"
    text = f"{value:,.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"
    r = ratio(value, reference)
    mark = " *" if flagged else ""
    return f"{text} ({r:.2f}x){mark}" if r is not None else f"{text}{mark}"


def render(results: Results, systems: list[tuple[str, str]], cell_keys: list[str], reference: str) -> str:
    """Markdown: one row per system (name, label), medians with ratios to ``reference``; notes below."""
    cols = columns(cell_keys)
    lines = ["| system | " + " | ".join(c.header for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    notes = []
    for name, label in systems:
        if name in results.unavailable:
            lines.append(f"| {label} | " + " | ".join(["unavailable"] * len(cols)) + " |")
            notes.append(f"{label}: {results.unavailable[name]}")
            continue
        flagged = {key for key in cell_keys if results.problems(name, key)}
        cells = [format_cell(results.median(name, c), results.median(reference, c), c.cell in flagged) for c in cols]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        notes += [f"{label} {key} {p}" for key in cell_keys for p in results.problems(name, key)]
    text = "\n".join(lines)
    return text + ("\n\n" + "\n".join(f"- {n}" for n in notes) if notes else "")


def render_cores(results: Results, systems: list[tuple[str, str]], cell_keys: list[str]) -> str:
    """Markdown: per system and cell, the median number of cores its server kept busy (CPU s / wall s), so a
    server that runs more threads than its command line asks for shows here."""
    lines = ["| system | " + " | ".join(f"{key} cores" for key in cell_keys) + " |", "|---" * (len(cell_keys) + 1) + "|"]
    for name, label in systems:
        if name in results.unavailable:
            continue
        cells = [results.median(name, Column(key, SERVER_CORES, "")) for key in cell_keys]
        lines.append(f"| {label} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in cells) + " |")
    return "\n".join(lines)
