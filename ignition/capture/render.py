"""Rich rendering for ``ignition capture`` and ``ignition inspect`` (kept out of cli.py)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flare_contract.graphs import GraphDescriptor
from ignition.capture.build import CaptureObserver, CaptureSummary
from ignition.capture.inspect import CatalogReport


class ProgressObserver(CaptureObserver):
    """Logs each named step on stderr and draws a progress bar over the programs."""

    def __init__(self, console: Console):
        self.console = console
        self.started = time.perf_counter()
        self.progress: Progress | None = None
        self.task = None

    def step(self, name: str) -> None:
        self._finish_bar()
        self.console.print(f"[{time.perf_counter() - self.started:6.1f} s] {name}", highlight=False)

    def programs_started(self, total: int) -> None:
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        self.progress = Progress(*columns, console=self.console, transient=False)
        self.progress.start()
        self.task = self.progress.add_task("export", total=total)

    def program_done(self, descriptor: GraphDescriptor) -> None:
        if self.progress is not None:
            self.progress.update(self.task, advance=1, description=f"export {descriptor.id}")

    def _finish_bar(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def close(self) -> None:
        self._finish_bar()


def human_bytes(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def print_capture_summary(console: Console, summary: CaptureSummary) -> None:
    kinds = ", ".join(f"{kind} {n}" for kind, n in summary.programs_by_kind.items())
    total = sum(summary.programs_by_kind.values())
    console.print(
        f"captured {total} programs ({kinds}) into {summary.path}: "
        f"{human_bytes(summary.total_bytes)} in {summary.seconds:.1f} s"
    )


def print_catalog_report(console: Console, report: CatalogReport) -> None:
    manifest = report.catalog.manifest
    about = Table(title=f"Catalog {report.catalog.path}", show_header=False)
    for key, value in (
        ("format version", manifest.format_version),
        ("flare / torch", f"{manifest.flare_version} / {manifest.torch_version}"),
        ("recipe", manifest.recipe.get("name", "?")),
        ("device", f"{manifest.device.get('kind')} {manifest.device.get('dtype')}"),
        ("compile", manifest.compile),
        *((f"envelope.{k}", v) for k, v in manifest.envelope.to_dict().items()),
        ("programs", ", ".join(f"{kind} {n}" for kind, n in report.counts_by_kind.items())),
        ("size", human_bytes(report.total_bytes)),
    ):
        about.add_row(key, str(list(value) if isinstance(value, tuple) else value))
    console.print(about)
    console.print(_programs_table(report))
    console.print(_files_table(report))


def _programs_table(report: CatalogReport) -> Table:
    """One row per descriptor; the id names the kind (kinds are counted above)."""
    table = Table(title="Programs")
    table.add_column("id", no_wrap=True)
    for column in ("B", "D", "W", "P", "prompt"):
        table.add_column(column, justify="right", min_width=len(column))
    table.add_column("source", no_wrap=True)  # value source: who allocates target rows
    table.add_column("flags", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)  # exported + compiled files
    for p in report.catalog.manifest.programs:
        g = p.descriptor
        flags = " ".join(w for on, w in ((g.ragged, "ragged"), (g.speculation_enabled, "spec")) if on)
        numbers = (g.batch_capacity, g.proposal_depth, g.width, g.target_rows, g.prefill_capacity)
        source = g.value_source.value if g.value_source else ""
        size = report.file_sizes[p.file] + (report.file_sizes[p.compiled_file] if p.compiled_file else 0)
        table.add_row(g.id, *map(str, numbers), source, flags, human_bytes(size))
    return table


def _files_table(report: CatalogReport) -> Table:
    table = Table(title="Files")
    table.add_column("file")
    table.add_column("size", justify="right")
    for name, size in report.file_sizes.items():
        if not name.startswith("programs/"):
            table.add_row(name, human_bytes(size))
    programs = [size for name, size in report.file_sizes.items() if name.startswith("programs/")]
    table.add_row(f"programs/ ({len(programs)} files)", human_bytes(sum(programs)))
    return table
