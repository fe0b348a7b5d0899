"""`ignition`: recipe -> capacity plan -> captured catalog (docs/cli.md).

Every command is thin: parse its arguments, call one library function inside
``user_errors`` (bad input becomes one ``error:`` line on stderr and exit code
2; ``ignition --debug ...`` shows the traceback instead), then render with rich.
The option types below are shared by the commands that take a capacity
envelope (``plan`` here, ``capture`` beside it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from flare_contract.cli import run_app
from ignition.capacity import CapacityOptions, CapacityPlan
from ignition.capacity.plan import plan_recipe
from ignition.recipes import Recipe, list_recipes

USER_ERRORS = (ValueError, OSError)  # RecipeError, CapacityError, CatalogError are ValueErrors
EXIT_BAD_INPUT = 2

app = typer.Typer(
    help="Ignition: turn a model recipe into a catalog of prepared fixed-shape programs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# -- options shared by the commands that plan a catalog -----------------------------------------
RecipeArg = Annotated[str, typer.Argument(help="Recipe name, alias, or path to a recipe .yaml file.")]
ModelOpt = Annotated[
    Optional[Path], typer.Option("--model", help="Local Hugging Face checkpoint folder (config.json, ...).")
]
ConcurrencyOpt = Annotated[
    Optional[int], typer.Option("--concurrency", help="Request slots; batch buckets are powers of two through it.")
]
PrefillChunkOpt = Annotated[
    Optional[int], typer.Option("--prefill-chunk", help="Largest prompt bucket (a multiple of 64).")
]
DraftsOpt = Annotated[Optional[int], typer.Option("--drafts", help="Draft depth D; 0 plans the ordinary catalog.")]
TokenCapacityOpt = Annotated[
    Optional[int],
    typer.Option("--speculative-token-capacity", help="R: rectangular B*W <= R, ragged P <= R."),
]
MixedOpt = Annotated[
    bool, typer.Option("--mixed-prefill", help="Also plan mixed prefill+decode programs (recipe must declare it).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]


@dataclass(frozen=True, slots=True)
class CliSettings:
    debug: bool = False


@app.callback()
def _root(
    ctx: typer.Context,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks instead of one-line errors.")] = False,
) -> None:
    ctx.obj = CliSettings(debug=debug)


@contextmanager
def user_errors(ctx: typer.Context) -> Iterator[None]:
    """Bad input: one ``error:`` line on stderr, exit 2 (a traceback with --debug)."""
    try:
        yield
    except USER_ERRORS as exc:
        settings = ctx.find_root().obj
        if settings is not None and settings.debug:
            raise
        typer.echo(f"error: {' '.join(str(exc).split())}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None


def capacity_options(
    concurrency: int | None, prefill_chunk: int | None, drafts: int | None, token_capacity: int | None, mixed: bool
) -> CapacityOptions:
    return CapacityOptions(
        concurrency=concurrency,
        prefill_chunk=prefill_chunk,
        drafts=drafts,
        speculative_token_capacity=token_capacity,
        mixed_prefill=mixed,
    )


# -- commands -------------------------------------------------------------------------------------


@app.command()
def recipes(ctx: typer.Context) -> None:
    """List the bundled recipes, their aliases and default capacities."""
    with user_errors(ctx):
        found = list_recipes()
    Console().print(_recipes_table(found))


@app.command()
def plan(
    ctx: typer.Context,
    recipe: RecipeArg,
    model: ModelOpt = None,
    concurrency: ConcurrencyOpt = None,
    prefill_chunk: PrefillChunkOpt = None,
    drafts: DraftsOpt = None,
    speculative_token_capacity: TokenCapacityOpt = None,
    mixed_prefill: MixedOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Show every program a capture would produce, without capturing."""
    options = capacity_options(concurrency, prefill_chunk, drafts, speculative_token_capacity, mixed_prefill)
    with user_errors(ctx):
        result = plan_recipe(recipe, options, model=model)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        _print_plan(result)


CompileOpt = Annotated[
    Optional[str], typer.Option("--compile", help="none: export programs only (fast); aoti: also AOTInductor-compile "
                                                  "programs, which then run without Python (slower capture) "
                                                  "[default: the recipe's compile.mode].")
]
CompileKindsOpt = Annotated[
    Optional[str], typer.Option("--compile-kinds", help="Comma-separated program kinds --compile aoti compiles "
                                                        "(prefill, scored_prefill, decode, speculative, mixed; 'all') "
                                                        "[default: the recipe's compile.kinds].")
]


@app.command()
def capture(
    ctx: typer.Context,
    recipe: RecipeArg,
    out: Annotated[Path, typer.Option("--out", help="Catalog folder to write (replaced atomically).")],
    model: ModelOpt = None,
    concurrency: ConcurrencyOpt = None,
    prefill_chunk: PrefillChunkOpt = None,
    drafts: DraftsOpt = None,
    speculative_token_capacity: TokenCapacityOpt = None,
    mixed_prefill: MixedOpt = False,
    compile: CompileOpt = None,
    compile_kinds: CompileKindsOpt = None,
    jobs: Annotated[
        Optional[int], typer.Option("--jobs", help="Worker processes exporting programs in parallel [default: CPU count].")
    ] = None,
) -> None:
    """Capture every planned program into a catalog folder (docs/catalog-format.md)."""
    from ignition.capture.pipeline import CaptureRequest, capture as run_capture
    from ignition.capture.render import ProgressObserver, print_capture_summary

    options = capacity_options(concurrency, prefill_chunk, drafts, speculative_token_capacity, mixed_prefill)
    observer = ProgressObserver(Console(stderr=True))
    with user_errors(ctx):
        try:
            request = CaptureRequest(recipe, out, model, options, compile, (os.cpu_count() or 1) if jobs is None else jobs,
                                     _kinds(compile_kinds))
            summary = run_capture(request, observer)
        finally:
            observer.close()
    print_capture_summary(Console(), summary)


def _kinds(text: str | None) -> tuple[str, ...] | None:
    """``--compile-kinds`` as a tuple; ``all`` (or nothing listed) is every kind."""
    if text is None:
        return None
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    return () if kinds in ((), ("all",)) else kinds


@app.command()
def inspect(
    ctx: typer.Context,
    catalog: Annotated[Path, typer.Argument(help="A catalog folder written by `ignition capture`.")],
    as_json: JsonOpt = False,
) -> None:
    """Show a catalog: version, recipe, envelope, programs by kind, every descriptor, file sizes."""
    from ignition.capture.inspect import inspect_catalog
    from ignition.capture.render import print_catalog_report

    with user_errors(ctx):
        report = inspect_catalog(catalog)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        print_catalog_report(Console(), report)


@app.command("debug-serve")
def debug_serve(
    ctx: typer.Context,
    catalog: Annotated[Path, typer.Argument(help="A catalog folder written by `ignition capture`.")],
    direct: Annotated[bool, typer.Option("--direct", help="Schedule with ignition's own small scheduler (required).")] = False,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: a free one, logged when ready).")] = 8000,
    verbose: Annotated[bool, typer.Option("--verbose", help="Log every scheduling decision on one line.")] = False,
    threads: Annotated[
        Optional[int], typer.Option("--threads", help="Torch intra-op threads [default: every core].")
    ] = None,
    trust_catalog: Annotated[bool, typer.Option(
        "--trust-catalog", help="Load programs that could run code (pickled entries, AOTInductor); only for catalogs you trust."
    )] = False,
) -> None:
    """Serve a catalog with a diagnostic scheduler, to tell a capture bug from a scheduling bug (docs/debug-serve.md)."""
    import logging
    import sys

    from helios.direct.serve import DebugServeOptions, prepare, run  # the one command that runs the runtime

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    with user_errors(ctx):
        if not direct:
            raise ValueError("debug-serve has one mode: pass --direct (ignition debug-serve --direct CATALOG)")
        options = DebugServeOptions(catalog, host, port, verbose, threads, trust_catalog)
        listener, engine = prepare(options)
    run(options, engine, listener)


def main() -> None:
    """Console-script entry point (``ignition``)."""
    run_app(app, "ignition")  # usage errors too are one line and exit 2 (flare_contract/cli.py)


# -- rendering ------------------------------------------------------------------------------------


def _recipes_table(found: list[Recipe]) -> Table:
    """One column per recipe, so the table stays narrow as fields are added."""
    table = Table(title="Recipes")
    table.add_column("", style="bold", no_wrap=True)
    for r in found:
        table.add_column(r.name, overflow="fold")
    rows = {
        "aliases": lambda r: ", ".join(r.aliases) or "-",
        "architecture": lambda r: r.architecture,
        "checkpoint": lambda r: "bundled" if r.target.checkpoint else "--model PATH",
        "dtype": lambda r: r.dtype,
        "concurrency": lambda r: str(r.capacity.concurrency),
        "prompt buckets": lambda r: " ".join(map(str, r.capacity.prompt_buckets)),
        "drafts": lambda r: str(r.capacity.drafts),
        "proposals": lambda r: ", ".join(r.capacity.proposal_sources) or "-",
        "mixed capture": lambda r: "yes" if r.capacity.mixed_capture else "no",
    }
    for label, cell in rows.items():
        table.add_row(label, *(cell(r) for r in found))
    return table


def _print_plan(result: CapacityPlan) -> None:
    console = Console()
    envelope = Table(title=f"Capacity envelope: {result.recipe}", show_header=False)
    for key, value in result.envelope.to_dict().items():
        envelope.add_row(key, str(list(value) if isinstance(value, tuple) else value))
    console.print(envelope)
    console.print(_shapes_table(result))
    counts = ", ".join(f"{kind} {n}" for kind, n in result.counts_by_kind().items())
    console.print(f"{len(result.graphs)} programs: {counts}")
    console.print(f"max packed tokens: {result.max_packed_tokens}")


def _shapes_table(result: CapacityPlan) -> Table:
    """One row per program; the id already names its kind (see docs/cli.md)."""
    table = Table(title="Programs")
    table.add_column("id", no_wrap=True)
    for column in ("B", "D", "W", "P", "prompt", "packed"):
        table.add_column(column, justify="right", min_width=len(column))
    table.add_column("value source", overflow="fold")
    table.add_column("flags", overflow="fold")
    for g in result.graphs:
        flags = " ".join(word for on, word in ((g.ragged, "ragged"), (g.speculation_enabled, "spec")) if on)
        numbers = (g.batch_capacity, g.proposal_depth, g.width, g.aggregate, g.prefill_capacity, g.max_packed_tokens)
        table.add_row(g.id, *map(str, numbers), g.value_source.value if g.value_source else "", flags)
    return table


if __name__ == "__main__":
    main()
