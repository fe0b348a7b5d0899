"""Helios against every baseline on the fixed workload set: a markdown table and PNG plots.

    python -m scripts.scheduling_sim.report --catalog examples/simulation/catalog.yaml --out reports/sim/

Helios runs through ``helios.sim.simulator.simulate`` itself (the code behind
``flare simulate``); the baselines run through ``driver.run``, which has the
same device model. Every workload runs with each seed; the tables show the
mean over seeds and each figure as a ratio Helios / baseline. ``--quick``
(one seed, short workloads) is for tests.

The goal figures of issue 20 close the report: the Pareto check, capacity
under two SLO pairs and goodput at overload (``capacity.py``: a bisection on
the arrival rate per workload, for Helios and for the best of the baselines
searched as one group, ``--capacity-seeds`` seeds,
default 1, 0 skips it), and throughput at saturation (tok/s on the
workloads that run at or above capacity). Plots need matplotlib (the
``bench`` extra); without it the report writes the tables and says so.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from helios.scheduler.config import CHOICE_FIELDS, PolicyConfig
from helios.sim.files import SimulationFileError, load_catalog
from helios.sim.simulator import simulate
from scripts.scheduling_sim.baselines import baseline_specs
from scripts.scheduling_sim.bounds import Bound, capacity_bound
from scripts.scheduling_sim.capacity import SLO_PAIRS, CapacityRow, capacity_workloads, decode_step_ms, measure_capacity
from scripts.scheduling_sim.driver import run
from scripts.scheduling_sim.metrics import Distribution, Metrics, Slo, measure
from scripts.scheduling_sim.shapes import Shapes
from scripts.scheduling_sim.workloads import QUICK, Scale, build_workloads

HELIOS = "helios"


@dataclass(frozen=True, slots=True)
class Column:
    """One reported figure: its header, how to read it from Metrics, and which direction is better."""

    header: str
    key: str
    higher_is_better: bool

    def read(self, metrics: Metrics) -> float:
        value = metrics
        for part in self.key.split("."):
            value = getattr(value, part)
        return float(value)


COLUMNS = (
    Column("req/s", "request_throughput", True),
    Column("tok/s", "output_throughput", True),
    Column("TTFT p50 ms", "ttft_ms.median", False),
    Column("TTFT p99 ms", "ttft_ms.p99", False),
    Column("ITL p99 ms", "itl_ms.p99", False),
    Column("ITL max ms", "itl_ms.max", False),
    Column("goodput req/s", "request_goodput", True),
    Column("Jain", "jain_fairness_index", True),
    Column("VTC max diff", "service_difference_max", False),
    Column("VTC avg diff", "service_difference_mean", False),
)


@dataclass(frozen=True, slots=True)
class Job:
    catalog: str
    seed: int
    scale: Scale
    workload: str
    slo: Slo
    policy: tuple[tuple[str, float], ...] = ()  # --helios-policy overrides
    baselines: bool = True  # False: Helios only (--baselines-from supplies the rest)


def with_policy(trace, policy: tuple[tuple[str, float], ...]):
    """``trace`` with PolicyConfig fields overridden for Helios (knock-out experiments)."""
    if not policy:
        return trace
    return replace(trace, policy=replace(trace.policy, **dict(policy)))


def run_job(job: Job) -> dict[str, Metrics]:
    """Every scheduler on one workload of one seed."""
    catalog = load_catalog(job.catalog)
    shapes = Shapes(catalog)
    workload = next(w for w in build_workloads(shapes, job.seed, job.scale) if w.name == job.workload)
    results = {HELIOS: simulate(catalog, with_policy(workload.trace, job.policy))}
    for spec in baseline_specs(shapes) if job.baselines else ():
        results[spec.name] = run(catalog, workload.trace, spec.build(shapes), workload.clients)
    windows = {"fairness_window_ms": job.scale.fairness_window_ms, "service_window_ms": job.scale.service_window_ms}
    return {
        name: measure(result, workload.trace, workload.clients, job.slo, **windows) for name, result in results.items()
    }


def run_all(catalog: str, seeds: int, scale: Scale, slo: Slo, jobs: int,
            policy: tuple[tuple[str, float], ...] = (), baselines: bool = True) -> dict[str, dict[str, list[Metrics]]]:
    """workload -> scheduler -> one Metrics per seed (``baselines`` False: Helios only)."""
    names = [w.name for w in build_workloads(Shapes(load_catalog(catalog)), 0, scale)]
    work = [Job(catalog, seed, scale, name, slo, policy, baselines) for seed in range(seeds) for name in names]
    table: dict[str, dict[str, list[Metrics]]] = {name: {} for name in names}
    with ProcessPoolExecutor(jobs) if jobs > 1 else _InProcess() as pool:
        for index, (job, output) in enumerate(zip(work, pool.map(run_job, work)), start=1):
            print(f"[{index}/{len(work)}] seed {job.seed} {job.workload}", flush=True)
            _collect(table[job.workload], output)
    return table


BASELINES = "baselines"  # the capacity table's group of every baseline configuration


@dataclass(frozen=True, slots=True)
class CapacityJob:
    catalog: str
    seed: int
    scale: Scale
    workload: str
    group: str  # HELIOS or BASELINES
    policy: tuple[tuple[str, float], ...] = ()


def run_capacity_job(job: CapacityJob) -> CapacityRow:
    catalog = load_catalog(job.catalog)
    shapes = Shapes(catalog)
    workload = next(w for w in build_workloads(shapes, job.seed, job.scale) if w.name == job.workload)
    if job.group == HELIOS:
        workload = replace(workload, trace=with_policy(workload.trace, job.policy))
        return measure_capacity(catalog, workload, [HELIOS])
    return measure_capacity(catalog, workload, [spec.name for spec in baseline_specs(shapes)])


def run_capacity(catalog: str, seeds: int, scale: Scale, jobs: int, policy: tuple[tuple[str, float], ...] = (),
                 baselines: bool = True) -> dict[str, dict[str, list[CapacityRow]]]:
    """workload -> HELIOS or BASELINES -> one CapacityRow per seed (the best of the group; only workloads
    with an arrival process to scale)."""
    shapes = Shapes(load_catalog(catalog))
    names = [w.name for w in capacity_workloads(build_workloads(shapes, 0, scale))]
    groups = [HELIOS, *([BASELINES] if baselines else [])]
    work = [CapacityJob(catalog, seed, scale, name, group, policy) for seed in range(seeds) for name in names
            for group in groups]
    table: dict[str, dict[str, list[CapacityRow]]] = {name: {} for name in names}
    with ProcessPoolExecutor(jobs) if jobs > 1 else _InProcess() as pool:
        for index, (job, row) in enumerate(zip(work, pool.map(run_capacity_job, work)), start=1):
            print(f"[capacity {index}/{len(work)}] seed {job.seed} {job.workload} {job.group}: "
                  f"{row.capacity} by {row.leader} ({row.runs} runs)", flush=True)
            table[job.workload].setdefault(job.group, []).append(row)
    return table


def run_bounds(catalog: str, seeds: int, scale: Scale) -> dict[str, dict[str, list[Bound]]]:
    """workload -> SLO pair -> one capacity upper bound per seed (``bounds.py``; arithmetic, no simulation)."""
    loaded = load_catalog(catalog)
    shapes = Shapes(loaded)
    step = decode_step_ms(shapes)
    table: dict[str, dict[str, list[Bound]]] = {}
    for seed in range(seeds):
        for workload in capacity_workloads(build_workloads(shapes, seed, scale)):
            for pair in SLO_PAIRS:
                ttft_ms, itl_ms = pair.limits_ms(step)
                found = capacity_bound(loaded, workload.trace, workload.capacity_rps, workload.load, ttft_ms, itl_ms)
                table.setdefault(workload.name, {}).setdefault(pair.name, []).append(found)
    return table


def _collect(rows: dict[str, list[Metrics]], output: dict[str, Metrics]) -> None:
    for scheduler, metrics in output.items():
        rows.setdefault(scheduler, []).append(metrics)


class _InProcess:
    """``--jobs 1``: the executor interface, run lazily in this process."""

    def __enter__(self) -> _InProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def map(self, fn, items):
        return map(fn, items)


def mean_over_seeds(column: Column, runs: list[Metrics]) -> float:
    values = [column.read(m) for m in runs if not math.isnan(column.read(m))]
    return sum(values) / len(values) if values else math.nan


def _cell(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def _ratio(helios: float, other: float) -> float:
    return helios / other if other and not (math.isnan(helios) or math.isnan(other)) else math.nan


def markdown(table: dict[str, dict[str, list[Metrics]]], command: str, seeds: int,
             capacity: dict[str, dict[str, list[CapacityRow]]] | None = None, step_ms: float | None = None,
             bounds: dict[str, dict[str, list[Bound]]] | None = None) -> str:
    lines = [
        "# Helios vs baseline schedulers on the simulator", "",
        f"`{command}` ({seeds} seed(s); means over seeds).", "",
        "Ratio tables: Helios / baseline. For req/s, tok/s, goodput and Jain above 1 favours Helios;"
        " for latencies and VTC service differences below 1 favours Helios.", "",
    ]
    lines += goal(table, capacity or {}, bounds or {})
    lines += summary(table)
    lines += pareto(table)
    if capacity:
        lines += capacity_tables(capacity, step_ms, bounds or {})
    for workload, rows in table.items():
        lines += _workload_tables(workload, rows)
    lines += _losses(table)
    return "\n".join(lines) + "\n"


def summary(table: dict[str, dict[str, list[Metrics]]]) -> list[str]:
    """Per workload and figure: Helios's value, then the best baseline's value and name."""
    lines = ["## Summary: Helios / best baseline (which)", "",
             "| workload | " + " | ".join(c.header for c in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for workload, rows in table.items():
        cells = []
        for column in COLUMNS:
            helios, best = mean_over_seeds(column, rows[HELIOS]), _best_baseline(column, rows)
            cells.append("-" if best is None else f"{_cell(helios)} / {_cell(best[1])} ({best[0]})")
        lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    return lines + [""]


# The Pareto check's figures: throughput, and the two latency tails a user feels.
PARETO = (Column("tok/s", "output_throughput", True), Column("TTFT p99 ms", "ttft_ms.p99", False),
          Column("ITL p99 ms", "itl_ms.p99", False))


def dominators(rows: dict[str, list[Metrics]]) -> list[str]:
    """Baseline configurations that dominate Helios on ``PARETO`` (means over seeds): at least as good on
    every figure and better on one. A figure a run could not measure (NaN) dominates nothing."""
    helios = [mean_over_seeds(c, rows[HELIOS]) for c in PARETO]
    found = []
    for name, runs in rows.items():
        if name == HELIOS:
            continue
        other = [mean_over_seeds(c, runs) for c in PARETO]
        if any(math.isnan(v) for v in (*helios, *other)):
            continue
        at_least = all((o >= h) if c.higher_is_better else (o <= h) for c, h, o in zip(PARETO, helios, other))
        if at_least and other != helios:
            found.append(name)
    return found


def pareto(table: dict[str, dict[str, list[Metrics]]]) -> list[str]:
    """Per workload: is Helios Pareto-dominated on (throughput, TTFT p99, ITL p99), and by which baselines."""
    lines = ["## Pareto check: baselines at least as good as Helios on tok/s, TTFT p99 and ITL p99 at once", "",
             "| workload | dominated by |", "|---|---|"]
    for workload, rows in table.items():
        found = dominators(rows)
        lines.append(f"| {workload} | {', '.join(found) if found else 'none'} |")
    dominated = sum(bool(dominators(rows)) for rows in table.values())
    return lines + ["", f"Helios is dominated on {dominated} of {len(table)} workloads.", ""]


def _workload_tables(workload: str, rows: dict[str, list[Metrics]]) -> list[str]:
    header = "| scheduler | " + " | ".join(c.header for c in COLUMNS) + " |"
    rule = "|---" * (len(COLUMNS) + 1) + "|"
    values = {name: [mean_over_seeds(c, runs) for c in COLUMNS] for name, runs in rows.items()}
    lines = [f"## {workload}", "", header, rule]
    lines += [f"| {name} | " + " | ".join(_cell(v) for v in vals) + " |" for name, vals in values.items()]
    lines += ["", f"Helios / baseline on {workload}:", "", header, rule]
    helios = values[HELIOS]
    for name, vals in values.items():
        if name != HELIOS:
            lines.append(f"| {name} | " + " | ".join(_cell(_ratio(h, v)) for h, v in zip(helios, vals)) + " |")
    return lines + [""]


def _losses(table: dict[str, dict[str, list[Metrics]]]) -> list[str]:
    """Every workload and figure where some baseline beats Helios by more than 5 %, with the best such baseline."""
    lines = ["## Where Helios loses (a baseline better by more than 5 %)", ""]
    for workload, rows in table.items():
        for column in COLUMNS:
            helios = mean_over_seeds(column, rows[HELIOS])
            best = _best_baseline(column, rows)
            if best is not None and _worse_by(column, helios, best[1]) > 0.05:
                lines.append(f"- {workload}, {column.header}: Helios {_cell(helios)}, {best[0]} {_cell(best[1])}")
    return lines + [""] if len(lines) > 2 else lines + ["None.", ""]


def _best_baseline(column: Column, rows: dict[str, list[Metrics]]) -> tuple[str, float] | None:
    scored = [(name, mean_over_seeds(column, runs)) for name, runs in rows.items() if name != HELIOS]
    scored = [(name, value) for name, value in scored if not math.isnan(value)]
    if not scored:
        return None
    pick = max if column.higher_is_better else min
    return pick(scored, key=lambda item: item[1])


def _worse_by(column: Column, helios: float, other: float) -> float:
    """How much worse Helios is, as a fraction of the better value (0 when it is not worse)."""
    if math.isnan(helios) or other == 0:
        return 0.0
    gap = (other - helios) if column.higher_is_better else (helios - other)
    return max(0.0, gap / abs(other))


# Workloads whose arrivals reach or pass the catalog's capacity: throughput at saturation.
SATURATED = ("steady-100", "steady-120", "vtc-overload")
THROUGHPUT = Column("tok/s", "output_throughput", True)


def _capacity_mean(rows: list[CapacityRow], read) -> float:
    values = [read(row) for row in rows]
    return sum(values) / len(values) if values else math.nan


def _best_capacity(rows: dict[str, list[CapacityRow]], read, leader=None) -> tuple[str, float] | None:
    """The baselines' best (mean over seeds) and which configuration reached it (the commonest, over seeds)."""
    runs = rows.get(BASELINES)
    if not runs:
        return None
    names = [leader(row) for row in runs] if leader else []
    named = [n for n in names if n]
    return (max(set(named), key=named.count) if named else "none"), _capacity_mean(runs, read)


def capacity_ratios(capacity: dict[str, dict[str, list[CapacityRow]]], pair: str) -> dict[str, float]:
    """Per workload: Helios's capacity under ``pair`` / the best baseline's (inf when only Helios meets it)."""
    out = {}
    for workload, rows in capacity.items():
        helios = _capacity_mean(rows[HELIOS], lambda r: r.capacity[pair])
        best = _best_capacity(rows, lambda r: r.capacity[pair])
        out[workload] = math.nan if best is None else (helios / best[1] if best[1] > 0 else
                                                       (math.inf if helios > 0 else math.nan))
    return out


def goal(table: dict[str, dict[str, list[Metrics]]], capacity: dict[str, dict[str, list[CapacityRow]]],
         bounds: dict[str, dict[str, list[Bound]]] | None = None) -> list[str]:
    """The issue's goal figures in one place: Pareto, capacity ratio per SLO pair, saturation throughput."""
    dominated = [w for w, rows in table.items() if dominators(rows)]
    lines = ["## Goal figures (issue 20)", "",
             f"- Pareto: Helios is dominated on {len(dominated)} of {len(table)} workloads"
             + (f" ({', '.join(dominated)})" if dominated else "") + " (goal: 0)."]
    for pair in SLO_PAIRS:
        ratios = capacity_ratios(capacity, pair.name) if capacity else {}
        if ratios:
            worst = min(ratios, key=lambda w: ratios[w] if not math.isnan(ratios[w]) else math.inf)
            lines.append(f"- Capacity under the {pair.name} SLO (TTFT p99 <= {pair.ttft_steps:g} d, ITL p99 <= "
                         f"{pair.itl_steps:g} d), Helios / best baseline: lowest {_cell(ratios[worst])} on {worst}; "
                         + ", ".join(f"{w} {_cell(r)}" for w, r in ratios.items())
                         + " (goal: >= 1.2 everywhere; -: no scheduler meets it even at load 1/64).")
        room = goal_room(capacity, bounds or {}, pair.name)
        if room:
            lines.append(f"  Upper bound (bounds.py) / (1.2 x best baseline), below 1 where the goal is impossible: "
                         + ", ".join(f"{w} {_cell(r)}" for w, r in room.items()) + ".")
    saturated = [w for w in SATURATED if w in table]
    if saturated:
        parts = []
        for workload in saturated:
            best = _best_baseline(THROUGHPUT, table[workload])
            helios = mean_over_seeds(THROUGHPUT, table[workload][HELIOS])
            parts.append(f"{workload} {_cell(_ratio(helios, best[1]))} ({best[0]})" if best else workload)
        lines.append("- Throughput at saturation, Helios / best baseline tok/s: " + ", ".join(parts)
                     + " (goal: >= 0.98).")
    return lines + [""]


def _bound_mean(bounds: dict[str, dict[str, list[Bound]]], workload: str, pair: str, read=lambda b: b.trace) -> float:
    found = (bounds or {}).get(workload, {}).get(pair, [])
    return sum(read(b) for b in found) / len(found) if found else math.nan


def goal_room(capacity: dict[str, dict[str, list[CapacityRow]]], bounds: dict[str, dict[str, list[Bound]]],
              pair: str) -> dict[str, float]:
    """Per workload: the capacity upper bound / (1.2 x the best baseline's capacity); inf where no baseline meets
    the pair, nan where the bound was not computed."""
    out = {}
    for workload, rows in capacity.items():
        bound = _bound_mean(bounds, workload, pair)
        best = _best_capacity(rows, lambda r: r.capacity[pair])
        if best is None or math.isnan(bound):
            continue
        out[workload] = bound / (1.2 * best[1]) if best[1] > 0 else math.inf
    return out


def capacity_tables(capacity: dict[str, dict[str, list[CapacityRow]]], step_ms: float | None,
                    bounds: dict[str, dict[str, list[Bound]]] | None = None) -> list[str]:
    """Capacity (load units) per SLO pair, and goodput at overload, Helios against the best baseline."""
    step = "" if step_ms is None else f" (d = {step_ms:.3g} ms on this catalog)"
    lines = ["## Capacity under SLO", "",
             "The largest arrival rate, as a fraction of the catalog's capacity for the workload's mix, at which p99"
             f" TTFT and p99 ITL stay within the pair, in units of the decode step d{step}; bisection on the rate"
             " (scripts/scheduling_sim/capacity.py). Goodput: requests/s meeting their own TTFT and TPOT limits at"
             " 1.5x capacity. Upper bound (scripts/scheduling_sim/bounds.py): the largest load at which the same"
             " trace passes necessary conditions no scheduler on the catalog escapes (work at the cheapest per-token"
             " costs of the programs the ITL bound lets run, the request slots, each prompt's fastest path); beside it"
             " the asymptotic device-time and slot (Little's law) bounds of a long run of the same mix.", ""]
    for pair in SLO_PAIRS:
        lines += [f"### {pair.name}: TTFT p99 <= {pair.ttft_steps:g} d, ITL p99 <= {pair.itl_steps:g} d", "",
                  "| workload | Helios capacity | best baseline | Helios / best | Helios goodput | best goodput |"
                  " upper bound (device / slots) | bound / (1.2 x best) |",
                  "|---|---|---|---|---|---|---|---|"]
        for workload, rows in capacity.items():
            read = lambda r, name=pair.name: r.capacity[name]  # noqa: E731
            good = lambda r, name=pair.name: r.goodput[name]  # noqa: E731
            helios = _capacity_mean(rows[HELIOS], read)
            best = _best_capacity(rows, read, lambda r, name=pair.name: (r.leader or {}).get(name))
            best_good = _best_capacity(rows, good, lambda r, name=pair.name: (r.goodput_leader or {}).get(name))
            ratio = capacity_ratios({workload: rows}, pair.name)[workload]
            bound = _bound_mean(bounds, workload, pair.name)
            room = goal_room({workload: rows}, bounds, pair.name).get(workload, math.nan)
            limits = (f"{_cell(bound)} ({_cell(_bound_mean(bounds, workload, pair.name, lambda b: b.device))} / "
                      f"{_cell(_bound_mean(bounds, workload, pair.name, lambda b: b.slots))})")
            lines.append(f"| {workload} | {_cell(helios)} | {_named(best)} | {_cell(ratio)} | "
                         f"{_cell(_capacity_mean(rows[HELIOS], good))} | {_named(best_good)} | "
                         f"{limits if not math.isnan(bound) else '-'} | {_cell(room)} |")
        lines.append("")
    return lines


def _named(best: tuple[str, float] | None) -> str:
    return "-" if best is None else f"{_cell(best[1])} ({best[0]})"


# ---------------------------------------------------------------------------
# Plots (matplotlib, optional)
# ---------------------------------------------------------------------------


def write_plots(table: dict[str, dict[str, list[Metrics]]], out: Path) -> list[Path]:
    """One PNG per figure: a panel per workload, a bar per scheduler (Helios highlighted)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    written = []
    for column in COLUMNS:
        workloads = [w for w, rows in table.items() if _has_values(column, rows)]
        if not workloads:
            continue
        columns = min(4, len(workloads))
        rows = math.ceil(len(workloads) / columns)
        figure, axes = plt.subplots(rows, columns, figsize=(3.4 * columns, 4.2 * rows), squeeze=False)
        for axis, workload in zip(axes.flat, workloads):
            _panel(axis, column, workload, table[workload])
        for axis in list(axes.flat)[len(workloads):]:
            axis.set_visible(False)
        figure.suptitle(column.header + (" (higher is better)" if column.higher_is_better else " (lower is better)"))
        figure.tight_layout()
        path = out / f"{column.key.replace('.', '_')}.png"
        figure.savefig(path, dpi=90)
        plt.close(figure)
        written.append(path)
    return written


def _has_values(column: Column, rows: dict[str, list[Metrics]]) -> bool:
    return not all(math.isnan(mean_over_seeds(column, runs)) for runs in rows.values())


def _panel(axis, column: Column, workload: str, rows: dict[str, list[Metrics]]) -> None:
    names = list(rows)
    values = [mean_over_seeds(column, rows[name]) for name in names]
    colours = ["tab:red" if name == HELIOS else "tab:blue" for name in names]
    axis.barh(names, [0 if math.isnan(v) else v for v in values], color=colours)
    axis.invert_yaxis()
    axis.set_title(workload, fontsize=9)
    axis.tick_params(labelsize=7)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def parse_slo(items: list[str]) -> Slo:
    """``ttft:MS tpot:MS e2el:MS`` (any subset), as ``flare bench --goodput`` takes them."""
    limits = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
        try:
            limits[f"{name}_ms"] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
    return Slo(**limits)


def parse_policy(items: list[str]) -> tuple[tuple[str, float], ...]:
    """``FIELD=VALUE`` pairs naming PolicyConfig fields; checked by building the config once."""
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in {f.name for f in fields(PolicyConfig)}:
            raise ValueError(f"--helios-policy {item!r}: expected FIELD=VALUE with a PolicyConfig field")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"--helios-policy {item!r}: {value!r} is not a number") from None
        pairs.append((name, int(number) if number.is_integer() and name in CHOICE_FIELDS else number))
    replace(PolicyConfig(), **dict(pairs))  # an out-of-range value fails here, with PolicyConfig's message
    return tuple(pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.scheduling_sim.report", description=__doc__.split("\n")[0])
    parser.add_argument("--catalog", help="synthetic catalog YAML (docs/simulation.md); required unless --from-results")
    parser.add_argument("--out", required=True, help="folder for report.md, results.json and the PNG plots")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per workload (default 3; --quick uses 1)")
    parser.add_argument("--quick", action="store_true", help="one seed, short workloads (tests)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--goodput", nargs="*", default=["ttft:250", "tpot:25"], help="SLOs, e.g. ttft:250 tpot:25")
    parser.add_argument("--capacity-seeds", type=int, default=1,
                        help="seeds of the capacity-under-SLO search (default 1; 0 skips it)")
    parser.add_argument("--helios-policy", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="PolicyConfig fields for Helios, e.g. token_rate_by_value=0 (knock-out experiments)")
    parser.add_argument("--baselines-from", metavar="RESULTS_JSON",
                        help="simulate Helios only and take every baseline's rows from an earlier results.json of "
                             "the same catalog, seeds and --goodput (baselines do not depend on Helios's code)")
    parser.add_argument("--from-results", help="re-render report.md and the plots from an earlier results.json")
    args = parser.parse_args(argv)
    command = "python -m scripts.scheduling_sim.report " + " ".join(argv if argv is not None else sys.argv[1:])
    try:
        results = _load_or_run(args, command)
    except (ValueError, OSError, SimulationFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    seeds = max(len(runs) for rows in results.table.values() for runs in rows.values())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(markdown(results.table, results.command, seeds, results.capacity, results.step_ms,
                                            results.bounds))
    (out / "results.json").write_text(json.dumps(results.to_json(), indent=1))
    print(f"wrote {out / 'report.md'} and {out / 'results.json'}")
    _plots(results.table, out)
    return 0


@dataclass(frozen=True, slots=True)
class Results:
    """What results.json holds: the command that simulated, and workload -> scheduler -> Metrics per seed."""

    command: str
    table: dict[str, dict[str, list[Metrics]]]
    capacity: dict[str, dict[str, list[CapacityRow]]] = None  # workload -> scheduler -> one row per seed
    step_ms: float | None = None  # the catalog's decode step d, the SLO unit
    bounds: dict[str, dict[str, list[Bound]]] = None  # workload -> SLO pair -> one capacity upper bound per seed

    def to_json(self) -> dict:
        capacity = {w: {s: [asdict(r) for r in rows] for s, rows in by.items()} for w, by in (self.capacity or {}).items()}
        bounds = {w: {p: [asdict(b) for b in found] for p, found in by.items()} for w, by in (self.bounds or {}).items()}
        return {"command": self.command, "workloads": _json(self.table), "capacity": capacity, "step_ms": self.step_ms,
                "bounds": bounds}


def _load_or_run(args: argparse.Namespace, command: str) -> Results:
    if args.from_results:
        return load_results(Path(args.from_results))
    if not args.catalog:
        raise ValueError("give --catalog SYNTHETIC_CATALOG.yaml (or --from-results results.json)")
    slo = parse_slo(args.goodput)
    policy = parse_policy(args.helios_policy)
    load_catalog(args.catalog)  # a bad catalog fails here, with one line, before any worker starts
    seeds, scale = (1, QUICK) if args.quick else (args.seeds, Scale())
    earlier = load_results(Path(args.baselines_from)) if args.baselines_from else None
    table = run_all(args.catalog, seeds, scale, slo, args.jobs, policy, baselines=earlier is None)
    capacity_seeds = min(args.capacity_seeds, 1) if args.quick else args.capacity_seeds
    capacity = (run_capacity(args.catalog, capacity_seeds, scale, args.jobs, policy, baselines=earlier is None)
                if capacity_seeds > 0 else {})
    if earlier is not None:
        table, capacity = _with_baselines(table, capacity, earlier, args.baselines_from)
    bounds = run_bounds(args.catalog, capacity_seeds, scale) if capacity_seeds > 0 else {}
    return Results(command, table, capacity, decode_step_ms(Shapes(load_catalog(args.catalog))), bounds)


def _with_baselines(table, capacity, earlier: Results, source: str):
    """Helios's new rows beside the baseline rows of an earlier run (their code did not change)."""
    def merged(new: dict, old: dict, what: str) -> dict:
        out = {}
        for workload, rows in new.items():
            seeds = len(rows[HELIOS])
            kept = {name: runs[:seeds] for name, runs in old.get(workload, {}).items() if name != HELIOS}
            if not kept or any(len(runs) < seeds for runs in kept.values()):
                raise ValueError(f"--baselines-from {source}: no {what} baselines for {workload} with {seeds} seed(s)")
            out[workload] = {HELIOS: rows[HELIOS], **kept}
        return out
    return merged(table, earlier.table, "table"), merged(capacity, earlier.capacity or {}, "capacity")


def load_results(path: Path) -> Results:
    """The inverse of ``Results.to_json``; re-rendering keeps the command that simulated."""
    document = json.loads(path.read_text())
    if not isinstance(document, dict) or "workloads" not in document:
        raise ValueError(f"{path}: not a results.json written by this report (no 'workloads' key)")
    rows = document["workloads"]
    table = {w: {s: [_metrics(m) for m in runs] for s, runs in by.items()} for w, by in rows.items()}
    capacity = {w: {s: [CapacityRow(**r) for r in runs] for s, runs in by.items()}
                for w, by in document.get("capacity", {}).items()}
    bounds = {w: {p: [Bound(**b) for b in found] for p, found in by.items()} for w, by in document.get("bounds", {}).items()}
    return Results(document.get("command", "(unknown command)"), table, capacity, document.get("step_ms"), bounds)


def _metrics(data: dict) -> Metrics:
    return Metrics(**{k: Distribution(**v) if isinstance(v, dict) else v for k, v in data.items()})


def _plots(table: dict[str, dict[str, list[Metrics]]], out: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: wrote the tables only (pip install 'flare[bench]' for the plots)")
        return
    for path in write_plots(table, out):
        print(f"wrote {path}")


def _json(table: dict[str, dict[str, list[Metrics]]]) -> dict:
    return {w: {s: [asdict(m) for m in runs] for s, runs in rows.items()} for w, rows in table.items()}


if __name__ == "__main__":
    sys.exit(main())
