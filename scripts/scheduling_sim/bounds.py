"""Upper bounds on capacity under an SLO pair that no scheduler on the catalog can pass (issue 20).

The capacity search (``capacity.py``) says how much load Helios and the best
baseline carry; this module says how much any scheduler could carry on the same
catalog and trace, so that a goal such as "1.2x the best baseline" can be read
against what is possible. Everything here is arithmetic on the catalog's
nominal durations and the trace's lengths; nothing is simulated.

Three ingredients:

1. **The cheapest per-token costs.** A pair of prices (c_tok per prompt token,
   c_out(a) per committed output token of a request with acceptance model a)
   such that every allowed program's duration covers the work it can do at
   those prices: D >= rows * e_W(a) * c_out(a) + T * c_tok, where rows are its
   decode rows (a mixed program's batch less its one prompt row), W its width,
   e_W(a) = 1 + sum of the first W - 1 survival probabilities the draft
   positions accepted at most, T its prompt capacity. Any schedule that
   delivers a request's P prompt tokens and o - 1 decoded tokens spends at
   least P c_tok + (o - 1) c_out device time on it (LP duality; the prices are
   the dual of "cover the work with the fewest milliseconds of programs").
   ``prices`` picks the pair that makes the bound largest (the objective is
   concave in c_tok, so a ternary search finds it).
2. **The slot limit.** A request occupies one of the catalog's S request slots
   from its first scheduled work to its last token, at least R_min = its
   fastest prompt path (the quickest chain of programs that can carry its
   prompt) plus (o - 1) times the quickest expected time per token of a
   one-row round. Little's law: rate * E[R_min] <= S.
3. **The ITL bound restricts the programs.** A frame longer than Y between two
   bursts of a resident decoder makes a gap longer than Y; a prefill-only frame
   makes the gap its duration plus the next round's. With decoders resident
   (always, near capacity), the programs that may run are the decode-carrying
   ones of duration <= Y and the prefill-only ones with duration + the
   quickest round <= Y. The bound computes everything from those programs.
   This is an assumption, not a theorem: the p99 lets 1 % of gaps break Y and
   a frame run with no decoder resident breaks nothing. ``Bound.every`` gives
   the same figures with every program allowed.

Asymptotic forms (infinite Poisson trace): the device bound 1000 / E[work]
requests per second and the slot bound S * 1000 / E[R_min]. The figure the
report uses is the trace bound (``trace_capacity``): the largest scale of the
workload's own finite trace at which the following necessary conditions hold
(first tokens by arrival + X for all but the misses the p99 allows; the
interpolated p99 is at least the value at index floor(0.99 (n - 1)) of the
sorted TTFTs, so at most n - floor(0.99 (n - 1)) - 1 may miss):

- every request that meets must have its fastest prompt path fit: arrival +
  path <= arrival + X;
- for every window [rho, tau] (rho an arrival, tau a deadline): of the
  requests arriving in it with deadline <= tau, k = count - misses must have
  their first token by tau; at most S of those are still resident at tau, so
  at least k - S requests arriving at or after rho have finished by tau, each
  needing arrival + R_min <= tau; the device time this takes, at least the k
  smallest prompt works plus the k - S smallest finishing (decode) works, must
  fit in tau - rho.

Each condition relaxes the real problem (a schedule may choose different
misses per window, a finisher's own prompt work is not counted twice, the
decode cadence the ITL bound imposes is not charged), so the result is an upper
bound, not an estimate: a scheduler can be far below it because of queueing,
which no work or slot count sees.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from flare_contract.graphs import GraphKind
from helios.sim.files import AcceptanceModel, FixedAcceptance, SyntheticCatalog, Trace

NS_PER_MS = 1_000_000


@dataclass(frozen=True, slots=True)
class Frame:
    """One program as the bound sees it: what work it can carry and how long it takes."""

    rows: int  # decode rows (a mixed program's prompt row excluded)
    width: int  # target positions per decode row
    tokens: int  # prompt tokens it can carry (every prompt row together)
    duration_ms: float


def frames(catalog: SyntheticCatalog) -> list[Frame]:
    out = []
    for graph in catalog.graphs:
        d, ms = graph.descriptor, graph.duration_ns / NS_PER_MS
        if d.kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
            out.append(Frame(0, 1, d.prefill_capacity * d.batch_capacity, ms))
        elif d.kind in (GraphKind.DECODE, GraphKind.SPECULATIVE):
            out.append(Frame(d.batch_capacity, d.width, 0, ms))
        elif d.kind is GraphKind.MIXED:
            out.append(Frame(d.batch_capacity - 1, d.width, d.prefill_capacity, ms))
    return out


def itl_feasible(programs: list[Frame], itl_ms: float) -> list[Frame]:
    """The programs that may run while decoders are resident without a gap over ``itl_ms`` (module docstring)."""
    rounds = [f for f in programs if f.rows > 0 and f.duration_ms <= itl_ms]
    if not rounds:
        return []
    quickest = min(f.duration_ms for f in rounds)
    return rounds + [f for f in programs if f.rows == 0 and f.duration_ms + quickest <= itl_ms]


def tokens_per_row(model: AcceptanceModel, width: int) -> float:
    """Expected committed tokens of one row in a round of ``width`` positions (the pending token included)."""
    if isinstance(model, FixedAcceptance):
        return 1 + min(model.accepted_drafts, width - 1)
    return 1 + sum(model.survival[: width - 1])


@dataclass(frozen=True, slots=True)
class Demand:
    """One request's work: prompt tokens, and decoded output tokens per acceptance model."""

    prompt: int
    output: tuple[tuple[AcceptanceModel, int], ...]


def demands(trace: Trace) -> list[Demand]:
    out = []
    for request in trace.requests:
        # the prompt's last program emits the first output token; the others are decoded, each under the
        # model in force once the tokens before it exist
        counts = Counter(request.acceptance_after(produced) for produced in range(1, request.max_tokens))
        out.append(Demand(request.prompt_tokens, tuple(counts.items())))
    return out


@dataclass(frozen=True, slots=True)
class Prices:
    token_ms: float  # per prompt token
    output_ms: dict  # acceptance model -> per decoded output token

    def work_ms(self, demand: Demand) -> float:
        return demand.prompt * self.token_ms + sum(n * self.output_ms[m] for m, n in demand.output)


def prices(programs: list[Frame], work: list[Demand]) -> Prices:
    """The dual prices that make the total work of ``work`` largest while every program covers its work."""
    models = {m for d in work for m, _ in d.output} or {FixedAcceptance(0)}
    prompt_total = sum(d.prompt for d in work)
    output_total = Counter()
    for d in work:
        for m, n in d.output:
            output_total[m] += n
    carriers = [f for f in programs if f.tokens > 0]
    top = min((f.duration_ms / f.tokens for f in carriers), default=0.0)

    def outputs(c_tok: float) -> dict:
        return {m: min((max(0.0, f.duration_ms - f.tokens * c_tok) / (f.rows * tokens_per_row(m, f.width))
                        for f in programs if f.rows > 0), default=math.inf) for m in models}

    def objective(c_tok: float) -> float:
        return c_tok * prompt_total + sum(n * c for m, c in outputs(c_tok).items() for n in [output_total[m]])

    low, high = 0.0, top
    for _ in range(100):
        a, b = low + (high - low) / 3, high - (high - low) / 3
        low, high = (a, high) if objective(a) < objective(b) else (low, b)
    return Prices(low, outputs(low))


def prompt_path_ms(programs: list[Frame], tokens: int) -> float:
    """The quickest chain of programs that carries a prompt of ``tokens`` (one prompt row per program)."""
    carriers = sorted({(min(f.tokens, tokens), f.duration_ms) for f in programs if f.tokens > 0})
    if not carriers:
        return math.inf

    @lru_cache(maxsize=None)
    def quickest(left: int) -> float:
        if left <= 0:
            return 0.0
        return min(ms + quickest(left - size) for size, ms in carriers)

    if tokens > 20000:  # deep recursion guard: fall back to the cheapest per-token carrier
        size, ms = min(carriers, key=lambda c: c[1] / c[0])
        return math.ceil(tokens / size) * ms
    for left in range(0, tokens + 1, 64):  # fill the cache bottom-up
        quickest(left)
    return quickest(tokens)


def residence_ms(programs: list[Frame], demand: Demand) -> float:
    """R_min: the fastest prompt path, then every decoded token at the quickest expected time per token."""
    rounds = [f for f in programs if f.rows > 0]
    if not rounds:
        return math.inf
    decode = sum(n * min(f.duration_ms / tokens_per_row(m, f.width) for f in rounds) for m, n in demand.output)
    return prompt_path_ms(programs, demand.prompt) + decode


def allowed_misses(n: int) -> int:
    """How many TTFTs may exceed X with the linear-interpolated p99 still <= X."""
    return n - math.floor(0.99 * (n - 1)) - 1


@dataclass(frozen=True, slots=True)
class Request:
    arrival_ms: float
    prompt_work: float
    decode_work: float
    path_ms: float
    residence_ms: float


def requests(trace: Trace, programs: list[Frame]) -> list[Request]:
    work = demands(trace)
    price = prices(programs, work)
    out = []
    for request, demand in zip(trace.requests, work):
        prompt = demand.prompt * price.token_ms
        out.append(Request(request.arrival_ns / NS_PER_MS, prompt, price.work_ms(demand) - prompt,
                           prompt_path_ms(programs, demand.prompt), residence_ms(programs, demand)))
    return out


def feasible(reqs: list[Request], scale: float, ttft_ms: float, slots: int) -> bool:
    """Whether the trace, arriving ``scale`` times as fast, passes every necessary condition of the module
    docstring for p99 TTFT <= ttft_ms."""
    misses = allowed_misses(len(reqs))
    arrival = sorted(((r.arrival_ms / scale, r) for r in reqs), key=lambda pair: pair[0])
    if sum(1 for _, r in arrival if r.path_ms > ttft_ms) > misses:
        return False
    times = [a for a, _ in arrival]
    for start in range(len(arrival)):
        rho = times[start]
        later = arrival[start:]
        # requests of the window that could have finished by tau, in the order they become able to
        finishing = sorted((a + r.residence_ms, r.decode_work) for a, r in later)  # floats only
        chosen: list[float] = []  # max-heap (negated) of the smallest finishing works taken
        rest: list[float] = []  # min-heap of the others that could finish
        chosen_sum, added = 0.0, 0
        total, largest = 0.0, []  # prompt works of the due requests; min-heap of the ``misses`` largest
        for offset, (a, r) in enumerate(later):
            total += r.prompt_work
            heapq.heappush(largest, r.prompt_work)
            if len(largest) > misses:
                heapq.heappop(largest)
            end = start + offset
            if end + 1 < len(arrival) and times[end + 1] == times[end]:
                continue  # the same deadline: check once, with every request arriving then
            tau = a + ttft_ms
            k = offset + 1 - misses
            if k <= 0:
                continue
            while added < len(finishing) and finishing[added][0] <= tau:
                heapq.heappush(rest, finishing[added][1])
                added += 1
            need = k - slots
            while len(chosen) < need and rest:
                work = heapq.heappop(rest)
                heapq.heappush(chosen, -work)
                chosen_sum += work
            while chosen and rest and rest[0] < -chosen[0]:  # keep ``chosen`` the smallest
                small, big = heapq.heappop(rest), -heapq.heappop(chosen)
                heapq.heappush(chosen, -small)
                heapq.heappush(rest, big)
                chosen_sum += small - big
            if need > len(chosen):
                return False
            prompt = total - (sum(largest) if misses else 0.0)
            finish = chosen_sum if need > 0 else 0.0
            if prompt + finish > tau - rho + 1e-9:
                return False
    return True


@dataclass(frozen=True, slots=True)
class Bound:
    """Capacity bounds in load units (fractions of the workload's capacity_rps) under one SLO pair."""

    trace: float  # the largest load the trace passes the necessary conditions at (the figure the report uses)
    device: float  # 1000 / E[work] requests/s, the asymptotic device-time bound
    slots: float  # S * 1000 / E[R_min], the asymptotic slot bound
    every: float  # the trace bound with every program allowed (no ITL restriction)


def trace_capacity(reqs: list[Request], base_load: float, ttft_ms: float, slots: int,
                   lowest: float = 1 / 64, highest: float = 8.0, steps: int = 12) -> float:
    """The largest load (a scale of the trace's own load ``base_load``) that ``feasible`` accepts: 0 when even
    ``lowest`` fails, ``highest`` when that passes; else bisection in log space, ``steps`` times."""
    def ok(load: float) -> bool:
        return feasible(reqs, load / base_load, ttft_ms, slots)

    if ok(highest):
        return highest
    if not ok(lowest):
        return 0.0
    low, high = lowest, highest
    for _ in range(steps):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if ok(middle) else (low, middle)
    return low


def capacity_bound(catalog: SyntheticCatalog, trace: Trace, capacity_rps: float, base_load: float,
                   ttft_ms: float, itl_ms: float) -> Bound:
    """Every bound of the module docstring for one workload trace (arriving at ``base_load``) and SLO pair."""
    everything = frames(catalog)
    allowed = itl_feasible(everything, itl_ms)
    if not allowed or capacity_rps <= 0 or base_load <= 0:
        return Bound(0.0, 0.0, 0.0, 0.0)
    reqs = requests(trace, allowed)
    n = len(reqs)
    device = 1000.0 * n / sum(r.prompt_work + r.decode_work for r in reqs) / capacity_rps
    slot = catalog.request_slots * 1000.0 * n / sum(r.residence_ms for r in reqs) / capacity_rps
    found = trace_capacity(reqs, base_load, ttft_ms, catalog.request_slots)
    every = trace_capacity(requests(trace, everything), base_load, ttft_ms, catalog.request_slots)
    return Bound(found, device, slot, every)
