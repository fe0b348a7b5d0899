"""Speculation figures: `flare run` per speculation configuration, driven by `flare bench`'s client.

    .venv/bin/python benchmarks/speculation_figures.py --catalog DIR [--streams 1,4,16]
        [--num-prompts 2] [--input-len 64:128] [--output-len 64] [--dataset python-files] [--threads 2]

For each configuration (``off``; ``fixed`` at every verification width the
catalog captured; ``adaptive``) the script starts ``flare run DIR`` in its own
process, waits for ``/health``, runs one untimed warm-up pass (durations are
learned online, and the first executions of each program discover them),
then for each stream count sends ``--num-prompts`` x streams greedy
completions at most ``streams`` at a time. It prints one table row per
(configuration, streams): output tokens per second as the client measured
them, and per proposal source the acceptance rate (accepted / offered draft
tokens) and the mean accepted length per round, both from ``/metrics``
deltas over the timed pass (``flare_speculative_*_total{source}``, counted
over complete speculative programs only).

A full catalog comes from ``ignition capture default --out DIR``. The grid
(5 configurations x 3 stream counts on the bundled model) takes about ten
minutes on two cores with the defaults; ``--configs off,adaptive`` trims it.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from helios.bench.client import Target
from helios.bench.datasets import DatasetSpec, LengthRange
from helios.bench.runner import BenchConfig, run_benchmark
from helios.catalog.load import CatalogError, load
from helios.runtime.engine import fixed_widths

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helios"))
from server_process import wait_ready  # noqa: E402  (the tests' wait for /health, shared)

SPECULATIVE_COUNTERS = ("rounds", "draft_tokens", "accepted_tokens")
READY_TIMEOUT_S = 900.0


@dataclass(frozen=True, slots=True)
class Configuration:
    """One ``flare run`` setting: a speculation mode and, for fixed, its width."""

    mode: str
    width: int | None = None

    @property
    def name(self) -> str:
        return self.mode if self.width is None else f"{self.mode} W={self.width}"

    def flags(self) -> list[str]:
        width = [] if self.width is None else ["--speculative-width", str(self.width)]
        return ["--speculation", self.mode, *width]


@dataclass(frozen=True, slots=True)
class Figures:
    configuration: str
    streams: int
    output_tok_s: float
    completed: int
    failed: int
    by_source: dict[str, dict[str, float]]  # source -> counter deltas


def configurations(catalog: Path) -> list[Configuration]:
    """off, fixed at each verification width fixed can run, adaptive."""
    widths = fixed_widths(load(catalog, verify_hashes=False).descriptors)
    return [Configuration("off"), *(Configuration("fixed", w) for w in widths), Configuration("adaptive")]


def config_names(config: Configuration) -> set[str]:
    """What ``--configs`` may call a configuration: its mode, or its name without spaces (fixedW=2)."""
    return {config.mode, config.name.replace(" ", "")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def speculative_counters(base: str) -> dict[str, dict[str, float]]:
    """source -> {rounds, draft_tokens, accepted_tokens} from one /metrics scrape."""
    text = httpx.get(f"{base}/metrics", timeout=10.0).text
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            short = sample.name.removeprefix("flare_speculative_").removesuffix("_total")
            if sample.name.startswith("flare_speculative_") and short in SPECULATIVE_COUNTERS:
                out.setdefault(sample.labels.get("source", "?"), {})[short] = sample.value
    return out


def _difference(after: dict, before: dict) -> dict[str, dict[str, float]]:
    return {source: {k: v - before.get(source, {}).get(k, 0.0) for k, v in counters.items()}
            for source, counters in after.items()}


def _bench(base: str, args: argparse.Namespace, streams: int, seed: int) -> tuple[float, int, int]:
    dataset = DatasetSpec(args.dataset, args.num_prompts * streams, LengthRange.parse(args.input_len, "--input-len"),
                          LengthRange.parse(args.output_len, "--output-len"), seed)
    run = run_benchmark(BenchConfig(Target(base, "completions", ""), dataset, max_concurrency=streams))
    return run.summary.output_throughput, run.summary.completed, run.summary.failed


def measure(catalog: Path, config: Configuration, args: argparse.Namespace, logs: Path) -> list[Figures]:
    """Start one server, warm it up, and measure every stream count against it."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = logs / f"{config.name.replace(' ', '_').replace('=', '')}.log"
    command = [sys.executable, "-m", "helios.cli", "run", str(catalog), "--port", str(port),
               "--threads", str(args.threads), *config.flags()]
    with open(log, "w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_ready(base, process, log, name="flare run", timeout_s=READY_TIMEOUT_S)
        _bench(base, args, max(args.streams), seed=10_000)  # warm-up: discovery runs here, untimed
        return [_measure_streams(base, config, args, streams) for streams in args.streams]
    finally:
        process.terminate()
        process.wait(timeout=60)


def _measure_streams(base: str, config: Configuration, args: argparse.Namespace, streams: int) -> Figures:
    before = speculative_counters(base)
    tok_s, completed, failed = _bench(base, args, streams, seed=streams)
    deltas = _difference(speculative_counters(base), before)
    return Figures(config.name, streams, tok_s, completed, failed, deltas)


def _rate(counters: dict[str, float], numerator: str, denominator: str) -> str:
    d = counters.get(denominator, 0.0)
    return "-" if d <= 0 else f"{counters.get(numerator, 0.0) / d:.2f}"


def table(figures: list[Figures], sources: list[str]) -> Table:
    out = Table(title="Speculation figures (acceptance = accepted / offered drafts; length = accepted per round)")
    for column in ("configuration", "streams", "output tok/s", "ok/failed"):
        out.add_column(column, justify="left" if column == "configuration" else "right")
    for source in sources:
        out.add_column(f"{source} acceptance", justify="right")
        out.add_column(f"{source} accepted/round", justify="right")
    for f in figures:
        cells = [f.configuration, str(f.streams), f"{f.output_tok_s:.1f}", f"{f.completed}/{f.failed}"]
        for source in sources:
            counters = f.by_source.get(source, {})
            cells += [_rate(counters, "accepted_tokens", "draft_tokens"), _rate(counters, "accepted_tokens", "rounds")]
        out.add_row(*cells)
    return out


def _streams(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--streams {text!r}: expected positive integers like 1,4,16")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--catalog", type=Path, required=True, help="a captured catalog folder")
    parser.add_argument("--streams", type=_streams, default=[1, 4, 16], help="concurrent streams, e.g. 1,4,16")
    parser.add_argument("--num-prompts", type=int, default=2, help="prompts per stream at each stream count")
    parser.add_argument("--input-len", default="64:128", help="prompt tokens, N or LOW:HIGH (estimated)")
    parser.add_argument("--output-len", default="64", help="output tokens, N or LOW:HIGH")
    parser.add_argument("--dataset", default="python-files", help="random, python-files or FILE.jsonl")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="flare run --threads")
    parser.add_argument("--configs", default=None, help="comma-separated subset: off, fixed, fixedW=2, adaptive")
    args = parser.parse_args()
    if not (args.catalog / "catalog.yaml").is_file():
        parser.error(f"--catalog {args.catalog}: no catalog.yaml there; capture one with `ignition capture`")
    if args.num_prompts < 1:
        parser.error(f"--num-prompts {args.num_prompts}: expected at least 1")
    only = None if args.configs is None else {c.strip() for c in args.configs.split(",")}
    console = Console(width=max(Console().width, 150))  # the table stays readable when piped
    figures: list[Figures] = []
    began = time.monotonic()
    try:
        grid = configurations(args.catalog)
    except CatalogError as error:
        parser.error(f"--catalog: {error}")
    names = set().union(*map(config_names, grid))
    if only is not None and only - names:
        parser.error(f"--configs: {', '.join(sorted(only - names))} not in this catalog's grid; "
                     f"choose from {', '.join(sorted(names))}")
    with tempfile.TemporaryDirectory(prefix="speculation-figures-") as logs:
        for config in (c for c in grid if only is None or config_names(c) & only):
            console.log(f"{config.name}: starting flare run")
            figures += measure(args.catalog, config, args, Path(logs))
    sources = sorted({s for f in figures for s in f.by_source})
    console.print(table(figures, sources))
    console.print(f"{len(figures)} measurements in {math.ceil(time.monotonic() - began)} s; "
                  f"{args.num_prompts} prompt(s) per stream, output {args.output_len} tokens, dataset {args.dataset}")


if __name__ == "__main__":
    main()
