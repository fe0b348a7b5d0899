"""The fixed workload set of the comparison, seeded and scaled to the catalog's capacity.

Capacity (requests per second) of a catalog for a request mix is the rate at
which the device is fully busy when every request is served as cheaply as
the catalog allows without speculation: its prompt prefilled in the largest
captured chunks (the tail padded to the smallest bucket that holds it), its
remaining output tokens decoded in the widest plain decode batch the catalog
and the request slots allow, each token paying that batch's duration divided
by its rows. Averaged over the mix's uniform length ranges:

    capacity = 1000 / E[prefill_ms(prompt) + (output - 1) * decode_ms(B) / B]

It ignores mixed programs and speculation, so a scheduler may exceed it.

Workloads (``build_workloads``):
- ``steady-50`` .. ``steady-120``: Poisson arrivals at 50/80/100/120 % of capacity;
- ``long-prompt``: four chat streams decoding when one long prompt arrives;
- ``vtc-overload``: VTC's two-client overload (Sheng et al. 2024 send 1.5 and 3
  req/s of 256/256 tokens): here 3 req/s is mapped to the catalog's capacity,
  so the clients send 0.5x and 1x capacity;
- ``spec-low`` / ``spec-high``: Poisson load at 60 % of capacity with
  sampled per-position acceptance 0.35 or 0.85 (prefix survival alpha^d).

Shapes added for issue 20, so that a result is not tuned to one trace:
- ``short-chat``: Poisson at 70 % of capacity, prompts 16-64 and outputs 16-64
  tokens (the capacity of that mix);
- ``long-docs``: Poisson at 70 % of capacity, 2k-8k-token documents with
  32-128-token answers;
- ``bursts``: two long generations (128-token prompts, 2048 tokens each, from
  time 0) and bursts of 16 short chats (32-128 / 32-128) arriving together,
  the bursts spaced so that the mean load is 60 % of the chats' capacity;
- ``mixed-acceptance``: Poisson at 60 % of capacity; each request's
  per-position acceptance is one of 0.2, 0.5, 0.9 and changes to another of
  them halfway through its output (``acceptance_schedule``).

Every workload records ``load``: its arrival rate as a fraction of
``capacity_rps``. The capacity-under-SLO search (``capacity.py``) scales the
arrival times of the built trace, so a scale s runs the same requests at s
times the rate.

Client ids are not a trace field (``helios.sim.files`` refuses unknown
request fields), so each workload keeps them in its own ``clients`` table.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from helios.scheduler.config import PolicyConfig
from helios.sim.files import AcceptanceChange, FixedAcceptance, SampledAcceptance, Trace, TraceRequest
from scripts.scheduling_sim.shapes import Shapes

NS_PER_MS = 1_000_000
STEADY_LOADS = (0.5, 0.8, 1.0, 1.2)
ACCEPTANCE_RATES = {"spec-low": 0.35, "spec-high": 0.85}


@dataclass(frozen=True, slots=True)
class Lengths:
    """Uniform prompt and output lengths, inclusive."""

    prompt: tuple[int, int]
    output: tuple[int, int]

    def draw(self, rng: random.Random) -> tuple[int, int]:
        return rng.randint(*self.prompt), rng.randint(*self.output)

    def shorter_outputs(self, divisor: int) -> Lengths:
        low, high = self.output
        return Lengths(self.prompt, (max(2, low // divisor), max(2, high // divisor)))


CHAT = Lengths(prompt=(128, 512), output=(64, 256))
SHORT_CHAT = Lengths(prompt=(16, 64), output=(16, 64))
DOCUMENT = Lengths(prompt=(2048, 8192), output=(32, 128))
BURST_CHAT = Lengths(prompt=(32, 128), output=(32, 128))
BURST_SIZE = 16
MIXED_ACCEPTANCE = (0.2, 0.5, 0.9)
VTC_REQUEST = Lengths(prompt=(256, 256), output=(256, 256))
SPEC_CHAT = Lengths(prompt=(128, 256), output=(128, 256))


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    trace: Trace
    clients: dict[str, str] = field(default_factory=dict)  # request id -> client (VTC workloads)
    capacity_rps: float = 0.0
    load: float = 0.0  # arrival rate / capacity_rps (0: not an arrival process, e.g. long-prompt)


@dataclass(frozen=True, slots=True)
class Scale:
    """How long each workload runs: the full report or the quick test mode."""

    steady_requests: int = 160
    stream_tokens: int = 512
    long_prompt_tokens: int = 8192
    overload_s: float = 6.0
    spec_requests: int = 64
    document_requests: int = 24
    burst_count: int = 6
    output_divisor: int = 1  # the quick mode shortens every output
    fairness_window_ms: float = 100.0  # Jain's index windows (metrics.windowed_jain)
    service_window_ms: float = 500.0  # VTC service-difference windows (metrics.service_difference)


QUICK = Scale(steady_requests=8, stream_tokens=32, long_prompt_tokens=2048, overload_s=0.25, spec_requests=6,
              document_requests=3, burst_count=1, output_divisor=8, fairness_window_ms=20.0, service_window_ms=50.0)


def capacity_rps(shapes: Shapes, lengths: Lengths) -> float:
    """Requests per second that keep the device busy (module docstring)."""
    rows = min(shapes.request_slots, shapes.max_decode_rows())
    per_token_ms = shapes.duration_ns(shapes.decode(rows)) / NS_PER_MS / rows
    prompts = range(lengths.prompt[0], lengths.prompt[1] + 1)
    prefill_ms = sum(_prefill_ms(shapes, p) for p in prompts) / len(prompts)
    mean_output = (lengths.output[0] + lengths.output[1]) / 2
    return 1000.0 / (prefill_ms + (mean_output - 1) * per_token_ms)


def _prefill_ms(shapes: Shapes, tokens: int) -> float:
    chunk = shapes.max_prefill_chunk()
    sizes = [chunk] * (tokens // chunk) + ([tokens % chunk] if tokens % chunk else [])
    return sum(shapes.duration_ns(shapes.prefill(size)) for size in sizes) / NS_PER_MS


def poisson_requests(rng: random.Random, rate_rps: float, count: int, lengths: Lengths, prefix: str,
                     acceptance=FixedAcceptance(0)) -> list[TraceRequest]:
    requests, now_ms = [], 0.0
    for index in range(count):
        now_ms += rng.expovariate(rate_rps) * 1000.0
        prompt, output = lengths.draw(rng)
        requests.append(TraceRequest(f"{prefix}{index}", _ns(now_ms), prompt, output, acceptance))
    return requests


def steady(shapes: Shapes, load: float, seed: int, scale: Scale) -> Workload:
    lengths = CHAT.shorter_outputs(scale.output_divisor)
    capacity = capacity_rps(shapes, lengths)
    requests = poisson_requests(random.Random(seed), load * capacity, scale.steady_requests, lengths, "s")
    return Workload(f"steady-{round(load * 100)}", _trace(requests, seed), capacity_rps=capacity, load=load)


def poisson_shape(shapes: Shapes, name: str, lengths: Lengths, load: float, count: int, seed: int) -> Workload:
    """Poisson arrivals of one length mix at ``load`` times that mix's capacity."""
    capacity = capacity_rps(shapes, lengths)
    requests = poisson_requests(random.Random(seed), load * capacity, count, lengths, name[0])
    return Workload(name, _trace(requests, seed), capacity_rps=capacity, load=load)


def bursts(shapes: Shapes, seed: int, scale: Scale) -> Workload:
    """Two long generations, and bursts of 16 short chats arriving at once (module docstring)."""
    lengths = BURST_CHAT.shorter_outputs(scale.output_divisor)
    capacity, load = capacity_rps(shapes, lengths), 0.6
    spacing_ms = BURST_SIZE / (load * capacity) * 1000.0
    rng = random.Random(seed)
    long_tokens = max(2, 2048 // scale.output_divisor)
    requests = [TraceRequest(f"gen-{i}", _ns(i), 128, long_tokens) for i in range(2)]
    for burst in range(scale.burst_count):
        at_ms = 20.0 + burst * spacing_ms
        for index in range(BURST_SIZE):
            prompt, output = lengths.draw(rng)
            requests.append(TraceRequest(f"b{burst}-{index}", _ns(at_ms), prompt, output))
    return Workload("bursts", _trace(requests, seed), capacity_rps=capacity, load=load)


def mixed_acceptance(shapes: Shapes, seed: int, scale: Scale) -> Workload:
    """Per-request acceptance from MIXED_ACCEPTANCE, changing to another halfway through the output."""
    depth = max(shapes.speculative_widths(), default=1) - 1
    lengths = SPEC_CHAT.shorter_outputs(scale.output_divisor)
    capacity, load = capacity_rps(shapes, lengths), 0.6
    rng = random.Random(seed)
    requests = []
    for request in poisson_requests(rng, load * capacity, scale.spec_requests, lengths, "m"):
        first, later = rng.sample(MIXED_ACCEPTANCE, 2)
        change = AcceptanceChange(max(1, request.max_tokens // 2), _survival(later, depth))
        requests.append(replace(request, acceptance=_survival(first, depth), acceptance_schedule=(change,)))
    return Workload("mixed-acceptance", _trace(requests, seed), capacity_rps=capacity, load=load)


def _survival(alpha: float, depth: int) -> SampledAcceptance:
    return SampledAcceptance(tuple(alpha**d for d in range(1, depth + 1)))


def long_prompt(shapes: Shapes, seed: int, scale: Scale) -> Workload:
    """Four streams start 1 ms apart; a long prompt arrives once they decode."""
    streams = [TraceRequest(f"stream-{i}", _ns(i), 128, scale.stream_tokens) for i in range(4)]
    document = TraceRequest("long", _ns(100.0), scale.long_prompt_tokens, 32)
    return Workload("long-prompt", _trace([*streams, document], seed), capacity_rps=capacity_rps(shapes, CHAT))


def vtc_overload(shapes: Shapes, seed: int, scale: Scale) -> Workload:
    lengths = VTC_REQUEST.shorter_outputs(scale.output_divisor)
    capacity = capacity_rps(shapes, lengths)
    rng = random.Random(seed)
    requests, clients = [], {}
    for client, share in (("A", 0.5), ("B", 1.0)):
        count = max(2, round(share * capacity * scale.overload_s))
        for request in poisson_requests(rng, share * capacity, count, lengths, f"{client}-"):
            requests.append(request)
            clients[request.id] = client
    return Workload("vtc-overload", _trace(requests, seed), clients, capacity, load=1.5)


def speculation(shapes: Shapes, name: str, seed: int, scale: Scale) -> Workload:
    alpha = ACCEPTANCE_RATES[name]
    depth = max(shapes.speculative_widths(), default=1) - 1
    acceptance = _survival(alpha, depth)
    lengths = SPEC_CHAT.shorter_outputs(scale.output_divisor)
    capacity = capacity_rps(shapes, lengths)
    requests = poisson_requests(random.Random(seed), 0.6 * capacity, scale.spec_requests, lengths, "q", acceptance)
    return Workload(name, _trace(requests, seed), capacity_rps=capacity, load=0.6)


def build_workloads(shapes: Shapes, seed: int, scale: Scale = Scale()) -> list[Workload]:
    workloads = [steady(shapes, load, seed, scale) for load in STEADY_LOADS]
    workloads += [long_prompt(shapes, seed, scale), vtc_overload(shapes, seed, scale)]
    if shapes.speculative_widths():
        workloads += [speculation(shapes, name, seed, scale) for name in ACCEPTANCE_RATES]
    workloads += [
        poisson_shape(shapes, "short-chat", SHORT_CHAT.shorter_outputs(scale.output_divisor), 0.7,
                      scale.steady_requests, seed),
        poisson_shape(shapes, "long-docs", _documents(scale), 0.7, scale.document_requests, seed),
        bursts(shapes, seed, scale),
    ]
    if shapes.speculative_widths():
        workloads.append(mixed_acceptance(shapes, seed, scale))
    return workloads


def _documents(scale: Scale) -> Lengths:
    """The quick mode shortens documents as it shortens outputs, so that tests stay fast."""
    low, high = DOCUMENT.prompt
    return replace(DOCUMENT.shorter_outputs(scale.output_divisor),
                   prompt=(max(64, low // scale.output_divisor), max(64, high // scale.output_divisor)))


def _trace(requests: list[TraceRequest], seed: int) -> Trace:
    return Trace(policy=PolicyConfig.preset("balanced"), seed=seed, requests=tuple(requests))


def _ns(ms: float) -> int:
    return int(round(ms * NS_PER_MS))
