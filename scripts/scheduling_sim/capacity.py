"""Capacity under latency SLOs, and goodput at a fixed overload (issue 20, item 1).

In the style of Sarathi-Serve and DistServe: for one workload and one
scheduler, the *capacity* under an SLO pair (X, Y) is the largest arrival rate
at which the run's p99 TTFT is at most X and its p99 ITL at most Y, with every
request finished. The rate is searched as a *scale* of the workload's own
arrival process: scale s divides every arrival time by s, so the same
requests arrive s times as fast (a Poisson process stays Poisson, bursts stay
bursts). It is reported in load units, the rate as a fraction of the
catalog's capacity for that mix (``workloads.capacity_rps``), so 1.0 is the
rate that keeps the device busy without speculation or mixed programs.

The search assumes that meeting the SLO is monotone in the rate. From load
1.0 it doubles or halves until the outcome changes (between load 1/64 and 8;
a scheduler that meets the SLO even at 8 is reported as 8, one that misses it
even at 1/64 as 0), then bisects in log space ``BISECTIONS`` times: the
result is within a factor 2^(1/2^BISECTIONS) (2.2 % at 5) below the true
boundary. Each step is one full simulation; runs are cached by scale, so the
two SLO pairs share their common points.

SLO pairs are stated in units of the catalog's decode step d, the duration of
the plain decode program of the widest batch the request slots allow, so that
they transfer between catalogs: an interactive pair and a relaxed one
(``SLO_PAIRS``). Goodput at overload runs each workload at
``OVERLOAD_LOAD`` (1.5x capacity) and counts, per second, the requests whose
own TTFT is at most X and whose TPOT (mean time per output token after the
first) at most Y.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from helios.sim.files import SyntheticCatalog, Trace
from helios.sim.simulator import SimulationResult, simulate
from scripts.scheduling_sim.baselines import baseline_specs
from scripts.scheduling_sim.driver import run
from scripts.scheduling_sim.metrics import NS_PER_MS, Slo, measure
from scripts.scheduling_sim.shapes import Shapes
from scripts.scheduling_sim.workloads import Workload

HELIOS = "helios"
BISECTIONS = 5
LOWEST_LOAD = 1 / 64
HIGHEST_LOAD = 8.0
OVERLOAD_LOAD = 1.5


@dataclass(frozen=True, slots=True)
class SloPair:
    """p99 TTFT <= ttft_steps * d and p99 ITL <= itl_steps * d, with d the catalog's decode step."""

    name: str
    ttft_steps: float
    itl_steps: float

    def limits_ms(self, step_ms: float) -> tuple[float, float]:
        return self.ttft_steps * step_ms, self.itl_steps * step_ms


SLO_PAIRS = (SloPair("interactive", ttft_steps=30.0, itl_steps=2.5), SloPair("relaxed", ttft_steps=250.0, itl_steps=8.0))


def decode_step_ms(shapes: Shapes) -> float:
    """d: the plain decode program of the widest batch the request slots allow."""
    rows = min(shapes.request_slots, shapes.max_decode_rows())
    return shapes.duration_ns(shapes.decode(rows)) / NS_PER_MS


@dataclass(frozen=True, slots=True)
class Capacity:
    """One scheduler's capacity under one SLO pair, in load units; ``runs`` simulations were needed."""

    load: float
    runs: int


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a run at one load says: the tails the SLO reads, and whether every request finished."""

    ttft_p99_ms: float
    itl_p99_ms: float
    finished: bool

    def meets(self, ttft_ms: float, itl_ms: float) -> bool:
        return self.finished and self.ttft_p99_ms <= ttft_ms and self.itl_p99_ms <= itl_ms


def scaled(trace: Trace, scale: float) -> Trace:
    """The same requests arriving ``scale`` times as fast."""
    requests = tuple(replace(r, arrival_ns=int(round(r.arrival_ns / scale))) for r in trace.requests)
    return replace(trace, requests=requests)


class Runner:
    """Runs one scheduler on one workload at any load; outcomes are cached by load."""

    def __init__(self, catalog: SyntheticCatalog, shapes: Shapes, workload: Workload, scheduler: str):
        self.catalog, self.shapes, self.workload, self.scheduler = catalog, shapes, workload, scheduler
        self.cache: dict[float, Outcome] = {}

    def simulate(self, load: float) -> SimulationResult:
        trace = scaled(self.workload.trace, load / self.workload.load)
        if self.scheduler == HELIOS:
            return simulate(self.catalog, trace)
        spec = next(s for s in baseline_specs(self.shapes) if s.name == self.scheduler)
        return run(self.catalog, trace, spec.build(self.shapes), self.workload.clients)

    def outcome(self, load: float) -> Outcome:
        if load not in self.cache:
            result = self.simulate(load)
            metrics = measure(result, self.workload.trace, self.workload.clients, Slo())
            finished = metrics.completed == len(self.workload.trace.requests)
            self.cache[load] = Outcome(metrics.ttft_ms.p99, metrics.itl_ms.p99, finished)
        return self.cache[load]


def capacity(runner: Runner, ttft_ms: float, itl_ms: float) -> Capacity:
    """The largest load meeting (ttft_ms, itl_ms) at p99 (module docstring: bracket, then bisect)."""
    before = len(runner.cache)
    meets = lambda load: runner.outcome(load).meets(ttft_ms, itl_ms)  # noqa: E731
    load = 1.0
    if meets(load):
        while load < HIGHEST_LOAD and meets(load * 2):
            load *= 2
        if load >= HIGHEST_LOAD:
            return Capacity(HIGHEST_LOAD, len(runner.cache) - before)
        low, high = load, load * 2
    else:
        while load > LOWEST_LOAD and not meets(load / 2):
            load /= 2
        if load <= LOWEST_LOAD:
            return Capacity(0.0, len(runner.cache) - before)
        low, high = load / 2, load
    for _ in range(BISECTIONS):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if meets(middle) else (low, middle)
    return Capacity(low, len(runner.cache) - before)


def overload_goodput(runner: Runner, ttft_ms: float, tpot_ms: float) -> float:
    """Requests per second meeting their own TTFT and TPOT limits at OVERLOAD_LOAD."""
    workload = runner.workload
    result = runner.simulate(OVERLOAD_LOAD)
    trace = scaled(workload.trace, OVERLOAD_LOAD / workload.load)
    return measure(result, trace, workload.clients, Slo(ttft_ms=ttft_ms, tpot_ms=tpot_ms)).request_goodput


@dataclass(frozen=True, slots=True)
class CapacityRow:
    """One scheduler on one workload: capacity per SLO pair (load units) and goodput at overload (req/s)."""

    capacity: dict[str, float]
    goodput: dict[str, float]
    runs: int


def measure_capacity(catalog: SyntheticCatalog, workload: Workload, scheduler: str) -> CapacityRow:
    shapes = Shapes(catalog)
    step = decode_step_ms(shapes)
    runner = Runner(catalog, shapes, workload, scheduler)
    found, goodput = {}, {}
    for pair in SLO_PAIRS:
        ttft_ms, itl_ms = pair.limits_ms(step)
        found[pair.name] = capacity(runner, ttft_ms, itl_ms).load
        goodput[pair.name] = overload_goodput(runner, ttft_ms, itl_ms)
    return CapacityRow(found, goodput, len(runner.cache))


def capacity_workloads(workloads: list[Workload]) -> list[Workload]:
    """The workloads with an arrival process to scale: one steady chat (the steady-* share one mix), the rest."""
    keep = [w for w in workloads if w.load > 0 and not (w.name.startswith("steady-") and w.name != "steady-100")]
    return keep
