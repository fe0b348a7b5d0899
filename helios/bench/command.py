"""``flare bench`` behind the typer declaration: parse, run, render; returns the exit status."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from helios.bench.datasets import DatasetError
from helios.bench.options import BenchFlags, config_from, settings_json
from helios.bench.report import PlotUnavailable, plot, progress_bar, require_matplotlib, results_table, server_table
from helios.bench.runner import BenchError, BenchFailed, run_benchmark
from helios.bench.summary import to_json

BAD_INPUT = 2
FAILED = 1


def bench(flags: BenchFlags, json_out: Path | None, plot_out: Path | None, out: Console, err: Console) -> int:
    try:
        config = config_from(flags)
        if plot_out is not None:
            require_matplotlib()  # before the run, not after minutes of it
        with progress_bar(config.dataset.count, err) as advance:
            run = run_benchmark(config, advance)
    except (BenchError, DatasetError, PlotUnavailable) as exc:
        return _fail(err, f"error: {exc}", BAD_INPUT)
    except BenchFailed as exc:
        return _fail(err, f"error: {exc}", FAILED)
    out.print(results_table(run))
    if failed := [r.error for r in run.results if not r.ok]:
        err.print(f"warning: {len(failed)} of {len(run.results)} requests failed; first: {failed[0]}",
                  markup=False, highlight=False, soft_wrap=True)
    if (table := server_table(run.summary)) is not None:
        out.print(table)
    try:
        if json_out is not None:
            document = settings_json(config, run.model, run.started) | to_json(run.summary, run.results)
            json_out.write_text(json.dumps(document, indent=2) + "\n")
        if plot_out is not None:
            plot(run, plot_out)
    except OSError as exc:
        return _fail(err, f"error: cannot write {exc.filename}: {exc.strerror}", FAILED)
    return 0


def _fail(err: Console, message: str, status: int) -> int:
    err.print(message, markup=False, highlight=False, soft_wrap=True)
    return status
