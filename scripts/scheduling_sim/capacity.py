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
boundary. Each step is one full simulation per scheduler asked; runs are
cached by scale, so the two SLO pairs share their common points.

The baselines are searched as one group, for the best of them (the goal
figure compares Helios with the best baseline configuration): at each load
the search asks the group's members until one meets the pair, and a
member's cached outcomes answer for other loads by monotonicity (a miss at
l is a miss above l, a meet at l a meet below), so a member that missed a
load another one met is not simulated again. On the example
catalog's steady-100 (160 requests) the 14 baselines' search takes 72
simulations instead of about 14 x 10, plus one overload run each for the
goodput; a whole capacity seed (8 workloads, Helios and the baselines) is
a few minutes on one core.

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
        self.overload: SimulationResult | None = None  # the run at OVERLOAD_LOAD, for goodput

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


@dataclass(frozen=True, slots=True)
class Best:
    """The largest capacity among several schedulers, which of them reached it, and the simulations it took."""

    load: float
    leader: str | None  # None when none of them meets the pair even at LOWEST_LOAD
    runs: int


class _Search:
    """Whether the best of several runners meets one SLO pair at a load, with as few simulations as it can.

    Meeting the pair is taken to be monotone in the load (module docstring), so a runner's cached
    outcomes answer for other loads: a miss at load l is a miss at every load above l, a meet at l a meet
    at every load below. The runner that met last is asked first, and the others only while nobody has
    met the load. A runner that missed a load another one met is never simulated again: every later
    load of the search lies above the best load met so far.
    """

    def __init__(self, runners: dict[str, Runner], ttft_ms: float, itl_ms: float):
        self.runners, self.ttft_ms, self.itl_ms = runners, ttft_ms, itl_ms
        self.leader: str | None = None

    def runs(self) -> int:
        return sum(len(runner.cache) for runner in self.runners.values())

    def _meets(self, name: str, load: float) -> bool:
        cache = self.runners[name].cache
        if any(done <= load and not o.meets(self.ttft_ms, self.itl_ms) for done, o in cache.items()):
            return False
        if any(done >= load and o.meets(self.ttft_ms, self.itl_ms) for done, o in cache.items()):
            return True
        return self.runners[name].outcome(load).meets(self.ttft_ms, self.itl_ms)

    def __call__(self, load: float) -> bool:
        order = ([self.leader] if self.leader else []) + [name for name in self.runners if name != self.leader]
        for name in order:
            if self._meets(name, load):
                self.leader = name
                return True
        return False


def best_capacity(runners: dict[str, Runner], ttft_ms: float, itl_ms: float) -> Best:
    """The largest load some runner meets (ttft_ms, itl_ms) at, at p99: bracket from load 1 by doubling or
    halving, then bisect in log space (module docstring); ``_Search`` spends the simulations."""
    meets = _Search(runners, ttft_ms, itl_ms)
    before = meets.runs()
    load = 1.0
    if meets(load):
        while load < HIGHEST_LOAD and meets(load * 2):
            load *= 2
        if load >= HIGHEST_LOAD:
            return Best(HIGHEST_LOAD, meets.leader, meets.runs() - before)
        low, high = load, load * 2
    else:
        while load > LOWEST_LOAD and not meets(load / 2):
            load /= 2
        if load <= LOWEST_LOAD:
            return Best(0.0, None, meets.runs() - before)
        low, high = load / 2, load
    for _ in range(BISECTIONS):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if meets(middle) else (low, middle)
    return Best(low, meets.leader, meets.runs() - before)


def capacity(runner: Runner, ttft_ms: float, itl_ms: float) -> Capacity:
    """The largest load one runner meets (ttft_ms, itl_ms) at, at p99."""
    found = best_capacity({"one": runner}, ttft_ms, itl_ms)
    return Capacity(found.load, found.runs)


def overload_goodput(runner: Runner, ttft_ms: float, tpot_ms: float) -> float:
    """Requests per second meeting their own TTFT and TPOT limits at OVERLOAD_LOAD (one simulation per runner)."""
    workload = runner.workload
    if runner.overload is None:
        runner.overload = runner.simulate(OVERLOAD_LOAD)
    trace = scaled(workload.trace, OVERLOAD_LOAD / workload.load)
    return measure(runner.overload, trace, workload.clients, Slo(ttft_ms=ttft_ms, tpot_ms=tpot_ms)).request_goodput


@dataclass(frozen=True, slots=True)
class CapacityRow:
    """The best of a group of schedulers (Helios alone, or every baseline) on one workload: per SLO pair its
    capacity (load units) and goodput at overload (req/s), which scheduler reached each (``leader``,
    ``goodput_leader``; None where none meets the pair), and the simulations the search took."""

    capacity: dict[str, float]
    goodput: dict[str, float]
    runs: int
    leader: dict[str, str | None] = None
    goodput_leader: dict[str, str] = None


def measure_capacity(catalog: SyntheticCatalog, workload: Workload, schedulers: list[str]) -> CapacityRow:
    shapes = Shapes(catalog)
    step = decode_step_ms(shapes)
    runners = {name: Runner(catalog, shapes, workload, name) for name in schedulers}
    found, leader, goodput, goodput_leader = {}, {}, {}, {}
    for pair in SLO_PAIRS:
        ttft_ms, itl_ms = pair.limits_ms(step)
        best = best_capacity(runners, ttft_ms, itl_ms)
        found[pair.name], leader[pair.name] = best.load, best.leader
        scored = {name: overload_goodput(runner, ttft_ms, itl_ms) for name, runner in runners.items()}
        goodput_leader[pair.name] = max(scored, key=scored.get)
        goodput[pair.name] = scored[goodput_leader[pair.name]]
    runs = sum(len(r.cache) + (r.overload is not None) for r in runners.values())
    return CapacityRow(found, goodput, runs, leader, goodput_leader)


def capacity_workloads(workloads: list[Workload]) -> list[Workload]:
    """The workloads with an arrival process to scale: one steady chat (the steady-* share one mix), the rest."""
    keep = [w for w in workloads if w.load > 0 and not (w.name.startswith("steady-") and w.name != "steady-100")]
    return keep
