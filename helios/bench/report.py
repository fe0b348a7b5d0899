"""Rendering a run: a progress bar while it runs, a results table, and optional latency plots."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from helios.bench.client import RequestResult
from helios.bench.runner import BenchRun
from helios.bench.summary import LATENCIES, Summary, latency

PLOT_INSTALL_HINT = "--plot needs matplotlib: pip install 'flare[bench]' (or pip install matplotlib)"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


@contextlib.contextmanager
def progress_bar(total: int, console: Console) -> Iterator[Callable[[RequestResult], None]]:
    """Yields the per-result callback that advances the bar (completed and failed counted apart)."""
    columns = (TextColumn("benchmark"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[failed]} failed"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("requests", total=total, failed=0)
        failed = 0

        def advance(result: RequestResult) -> None:
            nonlocal failed
            failed += not result.ok
            progress.update(task, advance=1, failed=failed)

        yield advance


def results_table(run: BenchRun) -> Table:
    summary = run.summary
    table = Table(title=f"flare bench: {run.model}", show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("completed / failed", f"{summary.completed} / {summary.failed}"),
        ("duration (s)", f"{summary.duration_s:.2f}"),
        ("input / output tokens", f"{summary.total_input_tokens} / {summary.total_output_tokens}"),
        ("request throughput (req/s)", _num(summary.request_throughput)),
        ("output throughput (tok/s)", _num(summary.output_throughput)),
        ("total token throughput (tok/s)", _num(summary.total_token_throughput)),
    ]
    if summary.request_goodput is not None:
        rows.append(("request goodput (req/s)", _num(summary.request_goodput)))
    for name in LATENCIES:
        dist = summary.latencies_ms[name]
        rows.append((f"{name.upper()} ms mean / median / p90 / p99",
                     " / ".join(_num(v) for v in (dist.mean, dist.median, dist.p90, dist.p99))))
    rows.append(("Jain fairness index", _num(summary.jain_fairness_index, 3)))
    for label, value in rows:
        table.add_row(label, value)
    return table


def server_table(summary: Summary) -> Table | None:
    """Flare's counters over the run; None for servers without them."""
    if summary.server is None:
        return None
    table = Table(title="Server: executed programs during the run")
    for column in ("graph kind", "category", "executions", "device ms"):
        table.add_column(column, justify="right" if column in ("executions", "device ms") else "left")
    for row in summary.server.executions:
        table.add_row(row.graph_kind, row.category, str(row.executions), f"{row.device_ms:.1f}")
    if not summary.server.executions:
        table.add_row("(none)", "", "0", "0.0")
    spec = summary.server.speculative
    if "acceptance_rate" in spec:
        table.caption = (f"speculative: {spec['accepted_tokens']:.0f} of {spec['draft_tokens']:.0f} draft tokens "
                         f"accepted ({spec['acceptance_rate']:.1%})")
    return table


def _num(value: float, digits: int = 2) -> str:
    return "-" if value != value else f"{value:.{digits}f}"  # nan: nothing to measure


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable(PLOT_INSTALL_HINT) from None


def plot(run: BenchRun, path: Path) -> None:
    """Latency CDFs (TTFT, TPOT, ITL, E2EL) and a timeline: one bar per request from send to last chunk."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(13, 5))
    _cdfs(axes[0], run)
    _timeline(axes[1], run.results)
    figure.suptitle(f"flare bench: {run.model}, {run.summary.completed} completed, {run.summary.failed} failed")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _cdfs(axis, run: BenchRun) -> None:
    latencies = [latency(r) for r in run.results if r.ok]
    series = {
        "TTFT": [lat.ttft_ms for lat in latencies],
        "TPOT": [lat.tpot_ms for lat in latencies if lat.tpot_ms is not None],
        "ITL": [gap for lat in latencies for gap in lat.itl_ms],
        "E2EL": [lat.e2el_ms for lat in latencies],
    }
    for label, values in series.items():
        if values:
            ordered = sorted(values)
            axis.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post", label=label)
    axis.set_xscale("log")
    axis.set_xlabel("ms (log)")
    axis.set_ylabel("fraction of samples")
    axis.set_title("Latency CDFs")
    axis.legend()


def _timeline(axis, results: list[RequestResult]) -> None:
    start = min((r.sent for r in results), default=0.0)
    for row, result in enumerate(results):
        end = result.chunk_times[-1] if result.chunk_times else result.sent
        first = result.chunk_times[0] if result.chunk_times else end
        axis.plot([result.sent - start, first - start], [row, row], color="0.7", linewidth=2)  # waiting for output
        axis.plot([first - start, end - start], [row, row], color="tab:red" if not result.ok else "tab:blue", linewidth=2)
        axis.plot([t - start for t in result.chunk_times], [row] * len(result.chunk_times), "|", color="k", markersize=2, alpha=0.4)
    axis.set_xlabel("seconds since the first send")
    axis.set_ylabel("request")
    axis.set_title("Timeline: grey waiting, blue streaming (red failed), ticks are chunks")
