"""``flare``: the runtime's command line (``simulate`` now; ``run`` and ``bench`` later).

Commands are thin: parse, call one library function, render. Bad input is one
line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from helios.simulation_files import SimulationFileError, load_catalog, load_trace
from helios.simulation_trace import write_trace_events
from helios.simulator import SimulationError, SimulationOptions, SimulationResult, simulate as run_simulation

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Flare runtime: serve, simulate and benchmark prepared catalogs.")
stderr = Console(stderr=True)

BAD_INPUT = 2


@app.callback()
def _flare() -> None:
    """Flare runtime commands."""


@app.command()
def run(
    catalog: Optional[Path] = typer.Argument(None, help="Catalog folder; none serves the bundled default (captured on first use)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (loopback unless told otherwise)."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    policy: str = typer.Option("balanced", "--scheduler-policy", help="balanced | throughput."),
    terminal_value: Optional[float] = typer.Option(None, "--scheduler-terminal-value", help="Finite, >= 0 (0 disables)."),
    terminal_age_price: Optional[float] = typer.Option(None, "--scheduler-terminal-age-price", help="Finite, >= 0."),
    alpha: Optional[float] = typer.Option(None, "--mtp-adaptive-verification-alpha", help="Finite, > 0."),
    speculation: str = typer.Option("adaptive", "--speculation", help="off | fixed | adaptive."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require this bearer token (or set FLARE_API_KEY)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch intra-op threads [default: every core]."),
) -> None:
    """Serve a catalog over an OpenAI-compatible HTTP API (docs/cli.md, docs/runtime.md)."""
    import logging

    from helios.catalog import CatalogError
    from helios.launch import LaunchError, RunOptions, run as serve_catalog

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        options = RunOptions(catalog, host, port, policy, terminal_value, terminal_age_price, alpha, speculation,
                             api_key, threads)
        serve_catalog(options)
    except (LaunchError, CatalogError) as exc:
        stderr.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(BAD_INPUT) from None


@app.command()
def simulate(
    catalog: Path = typer.Argument(..., help="Synthetic catalog YAML (docs/simulation.md)."),
    trace: Path = typer.Argument(..., help="Trace YAML: policy, seed and requests (docs/simulation.md)."),
    json_output: bool = typer.Option(False, "--json", help="Print only the JSON document on stdout."),
    cold: bool = typer.Option(False, "--cold", help="Feed no duration observations at time zero (every estimate starts unknown)."),
    until_ms: Optional[float] = typer.Option(None, "--until-ms", min=0.0, help="Stop the simulated clock at this time."),
    trace_out: Optional[Path] = typer.Option(
        None, "--trace-out", help="Also write the schedule as Chrome/Perfetto trace-event JSON to this file."
    ),
) -> None:
    """Run the production scheduler on a discrete-event clock over a synthetic catalog and a trace."""
    try:
        options = SimulationOptions(cold=cold, until_ns=None if until_ms is None else int(round(until_ms * 1e6)))
        result = run_simulation(load_catalog(catalog), load_trace(trace), options)
    except SimulationFileError as exc:
        stderr.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(BAD_INPUT) from None
    except SimulationError as exc:
        stderr.print(f"simulation failed: {exc}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    if trace_out is not None:
        try:
            write_trace_events(result, trace_out)
        except OSError as exc:
            stderr.print(f"error: cannot write --trace-out {trace_out}: {exc.strerror}", markup=False, highlight=False)
            raise typer.Exit(BAD_INPUT) from None
    if json_output:
        sys.stdout.write(json.dumps(result.to_json(), indent=2) + "\n")
    else:
        render_simulation(result, Console())
    if result.stalled:
        stderr.print("warning: the scheduler stopped planning with requests unfinished", highlight=False)


def render_simulation(result: SimulationResult, console: Console) -> None:
    console.print(_requests_table(result))
    console.print(_plans_table(result))
    console.print(_summary_table(result))


def _requests_table(result: SimulationResult) -> Table:
    table = Table(title="Requests (ms on the simulated clock; first output counts from arrival)")
    table.add_column("id", no_wrap=True)
    for column in ("arrive", "admit", "first out", "bursts", "tokens", "max gap", "finish"):
        table.add_column(column, justify="right")
    for outcome in result.requests:
        gaps = outcome.gaps_ms()
        table.add_row(
            outcome.id,
            _ms(outcome.arrival_ns / 1e6),
            _ms(None if outcome.admitted_ns is None else outcome.admitted_ns / 1e6),
            _ms(outcome.first_output_ms()),
            str(len(outcome.bursts)),
            str(outcome.tokens),
            _ms(max(gaps, default=None)),
            _ms(None if outcome.finished_ns is None else outcome.finished_ns / 1e6),
        )
    return table


def _plans_table(result: SimulationResult) -> Table:
    table = Table(title="Committed plans by graph kind and selection reason")
    for column in ("kind", "reason", "plans", "device ms"):
        table.add_column(column, justify="left" if column in ("kind", "reason") else "right")
    groups: dict[tuple[str, str], list[int]] = {}
    for plan in result.plans:
        groups.setdefault((plan.graph.kind.value, plan.reason), []).append(plan.actual_ns)
    for (kind, reason), durations in sorted(groups.items()):
        table.add_row(kind, reason, str(len(durations)), _ms(sum(durations) / 1e6))
    return table


def _summary_table(result: SimulationResult) -> Table:
    table = Table(title="Summary", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for key, value in result.summary().items():
        if isinstance(value, dict) and key == "device_ms_by_reason":
            for reason, ms in sorted(value.items()):
                table.add_row(f"device ms {reason}", _ms(ms))
        elif not isinstance(value, dict):
            table.add_row(key.replace("_", " "), _ms(value) if isinstance(value, float) else str(value))
    return table


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> None:
    """Console-script entry (``flare``)."""
    app()


if __name__ == "__main__":
    main()
