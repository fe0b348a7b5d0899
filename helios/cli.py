"""``flare``: the runtime's command line (``run``, ``simulate``, ``bench``).

Commands are thin: parse, call one library function, render. Bad input is one
line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from flare_contract.cli import run_app
from helios.sim.files import SimulationFileError, load_catalog, load_trace
from helios.sim.trace import write_trace_events
from helios.sim.simulator import SimulationError, SimulationOptions, SimulationResult, simulate as run_simulation
from helios.runtime.waiting import DEFAULT_MAX_WAITING

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
    choices: Optional[List[str]] = typer.Option(
        None, "--scheduler-choice", help="FIELD=0|1, a price-flow choice of the policy (repeatable; docs/scheduling-utility.md)."),
    alpha: Optional[float] = typer.Option(None, "--mtp-adaptive-verification-alpha", help="Finite, > 0."),
    terminal_value: Optional[float] = typer.Option(
        None, "--scheduler-terminal-value", help="Value of a terminal snapshot (P6), default 256; finite, >= 0."),
    terminal_age_price: Optional[float] = typer.Option(
        None, "--scheduler-terminal-age-price", help="Cost of a finished request's wait for its snapshot, value/ms^2, default 1; finite, >= 0."),
    speculation: str = typer.Option("adaptive", "--speculation", help="off | fixed | adaptive."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require this bearer token (or set FLARE_API_KEY)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch intra-op threads [default: every core]."),
    speculative_width: Optional[int] = typer.Option(
        None, "--speculative-width", help="Load only programs verifying at most W positions per row (a width the catalog has)."),
    adaptive_floor: Optional[str] = typer.Option(
        None, "--adaptive-floor", help="adaptive only: plain (ordinary decode beside the draft-keeping width-one programs; default) | draft (the draft-keeping ones only)."),
    dump_estimates: Optional[Path] = typer.Option(
        None, "--dump-estimates", help="On exit, write the learned durations as a synthetic catalog for flare simulate."),
    trust_catalog: bool = typer.Option(
        False, "--trust-catalog", help="Load programs that could run code (pickled entries, AOTInductor); only for catalogs you trust."),
    max_waiting: int = typer.Option(
        DEFAULT_MAX_WAITING, "--max-waiting", help=f"Requests that may wait for a slot (default {DEFAULT_MAX_WAITING}); beyond them new requests get 503 with Retry-After."),
    queue_timeout: Optional[float] = typer.Option(
        None, "--queue-timeout", help="Seconds a request may wait for a slot before it gets 503 (default: no limit)."),
    disable_log_requests: bool = typer.Option(
        False, "--disable-log-requests", help="No access-log line on stdout per finished request."),
    log_stats_interval: float = typer.Option(
        10.0, "--log-stats-interval", help="Seconds between stats lines on stdout (running, waiting, pages, tokens/s); 0: none."),
    prefix_reuse: Optional[bool] = typer.Option(
        None, "--prefix-reuse/--no-prefix-reuse", show_default=False,
        help="Restore retained checkpoints for prompts that extend them, and capture new ones (default: on where the catalog keeps a checkpoint store; --prefix-reuse on a catalog without one is refused)."),
) -> None:
    """Serve a catalog over an OpenAI-compatible HTTP API (docs/cli.md, docs/runtime.md)."""
    import logging

    from helios.catalog.load import CatalogError
    from helios.launch import LaunchError, RunOptions, run as serve_catalog

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        options = RunOptions(catalog, host, port, policy, alpha, speculation,
                             api_key, threads, speculative_width, dump_estimates, trust_catalog=trust_catalog,
                             max_waiting=max_waiting, queue_timeout=queue_timeout,
                             log_requests=not disable_log_requests, log_stats_interval=log_stats_interval,
                             choices=tuple(choices or ()), prefix_reuse=prefix_reuse,
                             terminal_value=terminal_value, terminal_age_price=terminal_age_price,
                             adaptive_floor=adaptive_floor)
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



@app.command(context_settings={"allow_extra_args": True})
def bench(
    ctx: typer.Context,
    url: str = typer.Option(..., "--url", help="Server base URL, e.g. http://127.0.0.1:8000."),
    model: str = typer.Option("", "--model", help="Model name (default: the server's first in /v1/models)."),
    endpoint: str = typer.Option("completions", "--endpoint", help="completions | chat."),
    num_prompts: int = typer.Option(100, "--num-prompts", help="Requests to send."),
    request_rate: str = typer.Option("inf", "--request-rate", help="Requests per second, or inf (all at once)."),
    burstiness: float = typer.Option(1.0, "--burstiness", help="Gamma shape of the gaps; 1 is Poisson."),
    max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", help="Most requests in flight."),
    dataset: str = typer.Option("random", "--dataset", help="random | python-files | FILE.jsonl."),
    input_len: str = typer.Option("128:512", "--input-len", help="Prompt tokens, N or A:B (estimated)."),
    output_len: str = typer.Option("64:256", "--output-len", help="max_tokens per request, N or A:B."),
    seed: int = typer.Option(0, "--seed", help="Seeds the dataset and the arrival gaps."),
    goodput: list[str] = typer.Option([], "--goodput", help="SLOs ttft:MS tpot:MS e2el:MS (vLLM's form)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Bearer token for the server."),
    fairness_window_ms: float = typer.Option(100.0, "--fairness-window-ms", help="Window of Jain's index (the simulator's too)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the results (vLLM's keys) to this file."),
    plot_out: Optional[Path] = typer.Option(None, "--plot", help="Draw latency CDFs and a timeline to this PNG."),
) -> None:
    """Benchmark any OpenAI-compatible server with vLLM's metric definitions (docs/cli.md)."""
    from helios.bench.command import bench as run_bench
    from helios.bench.options import BenchFlags

    if ctx.args and not goodput:  # after --goodput, bare NAME:MS words continue it, as in vLLM
        stderr.print(f"error: unexpected argument {ctx.args[0]!r}", markup=False, highlight=False)
        raise typer.Exit(BAD_INPUT)
    flags = BenchFlags(url=url, model=model, endpoint=endpoint, num_prompts=num_prompts, request_rate=request_rate,
                       burstiness=burstiness, max_concurrency=max_concurrency, dataset=dataset, input_len=input_len,
                       output_len=output_len, seed=seed, goodput=(*goodput, *ctx.args), api_key=api_key,
                       fairness_window_ms=fairness_window_ms)
    status = run_bench(flags, json_out, plot_out, Console(), stderr)
    if status:
        raise typer.Exit(status)

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
    run_app(app, "flare")  # usage errors too are one line and exit 2 (flare_contract/cli.py)


if __name__ == "__main__":
    main()
