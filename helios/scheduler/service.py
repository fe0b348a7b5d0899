"""Service histories and their prices (spec "Useful service and selection", "Service accounting").

Checklist U3, U4, U5, A3, A4, A5 and A10. The derivation is written out in
docs/scheduling-utility.md; in short:

- Each request carries a token-rate history x (tokens/ms) and, once it has
  published visible output, a delivery-rate history z (deliveries/ms). Both are
  in physical units and are only changed by measured service, so phase
  changes, acceptance updates and normalizer changes leave them alone (U4).
- Prices are the gradients of the utility rate
  ``v*x + f*log(x) + g*log(z)``: a prompt token is worth ``1 + f/x``, an output
  token ``beta + f/x``, a delivery ``g/z`` (U3).
- One measured interval of length dt updates a history as a first-order filter
  with time constant tau = ``adaptation_ms``:
  ``x <- a*x + (1 - a) * tokens/dt`` with ``a = exp(-dt/tau)``. Requests that
  took part in the interval without being served get tokens = 0 (A3).
- Completion records zero deliveries; the first visible publication for that
  fence replaces the interval's delivery update with one delivery
  (``amend_delivery``, A4). A missing delivery history is created by that
  first burst as one delivery over the frame's duration (A5).
- Queue projection (A10) advances a *copy* (the core's snapshot) by a queued
  frame's frozen expected service; the real history is never touched.
- ``reference_interval_ms`` is U5's sigma = K*T/min(B, k).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from flare_contract.graphs import GraphDescriptor, GraphKind
from helios.scheduler.types import Fence

MIN_RATE_PER_MS = 1e-12
"""Floor on x and z: a long-starved request's price grows huge, never infinite."""

COLD_TOKEN_RATE_PER_MS = 1.0
"""Starting token rate while no program is measured yet. It is the same for
every request (so it ranks nobody ahead) and is forgotten within a few
``adaptation_ms`` of measured service."""


def decay_factor(interval_ms: float, adaptation_ms: float) -> float:
    """exp(-dt/tau): how much of the old history survives an interval of dt ms."""
    if interval_ms <= 0 or adaptation_ms <= 0:
        raise ValueError(
            f"service intervals and adaptation_ms must be > 0 ms, got {interval_ms!r} and {adaptation_ms!r}"
        )
    return math.exp(-interval_ms / adaptation_ms)


def blend(rate: float, served: float, interval_ms: float, decay: float) -> float:
    """One exponentially weighted step: the old rate and this interval's rate served/dt."""
    return max(decay * rate + (1.0 - decay) * served / interval_ms, MIN_RATE_PER_MS)


@dataclass(slots=True)
class IntervalNote:
    """The last real interval, kept so its delivery update can be amended (A4)."""

    fence: Fence
    delivery_before: float | None
    decay: float
    interval_ms: float
    delivered: bool = False


@dataclass(slots=True)
class ServiceHistory:
    """A request's measured service rates; embed one in the request object.

    token_rate     x, tokens per ms (prompt and output tokens alike)
    delivery_rate  z, visible deliveries per ms; None until the first burst
    """

    token_rate: float
    delivery_rate: float | None = None
    last_interval: IntervalNote | None = None

    @classmethod
    def starting_at(cls, token_rate: float) -> "ServiceHistory":
        """A new request's history: x at the fair share, no delivery history."""
        if not token_rate > 0 or not math.isfinite(token_rate):
            raise ValueError(f"a starting token rate must be positive and finite, got {token_rate!r}")
        return cls(token_rate=token_rate)

    def record_interval(self, fence: Fence, tokens: float, interval_ms: float, adaptation_ms: float) -> None:
        """Fold one measured interval of real service into the history (A3, A4).

        ``tokens`` counts committed useful tokens this request got from the
        frame (0 for a participant left out of the cohort). Deliveries are
        recorded as zero; ``amend_delivery`` corrects that on publication.
        """
        if tokens < 0:
            raise ValueError(f"served tokens must be >= 0, got {tokens!r}")
        decay = decay_factor(interval_ms, adaptation_ms)
        self.last_interval = IntervalNote(fence, self.delivery_rate, decay, interval_ms)
        self.token_rate = blend(self.token_rate, tokens, interval_ms, decay)
        if self.delivery_rate is not None:
            self.delivery_rate = blend(self.delivery_rate, 0.0, interval_ms, decay)

    def amend_delivery(self, fence: Fence) -> bool:
        """The first visible publication for ``fence``: count one delivery (A4, A5).

        Replaces the interval's zero-delivery update by a one-delivery update
        (or, with no delivery history yet, starts z at one delivery over the
        frame's duration). Returns False, changing nothing, when ``fence`` is not
        the last recorded interval (e.g. it had no valid device interval) or was
        already amended: later tokens of the same burst are not new deliveries.
        """
        note = self.last_interval
        if note is None or note.fence != fence or note.delivered:
            return False
        note.delivered = True
        if note.delivery_before is None:
            self.delivery_rate = max(1.0 / note.interval_ms, MIN_RATE_PER_MS)
        else:
            self.delivery_rate = blend(note.delivery_before, 1.0, note.interval_ms, note.decay)
        return True



# ---------------------------------------------------------------------------
# Normalizer: where a new request's token history starts.
# ---------------------------------------------------------------------------


def guaranteed_tokens(graph: GraphDescriptor) -> int:
    """Committed tokens one fully occupied dispatch is sure to serve.

    Prompt programs consume their prompt capacity; decode and speculative
    programs guarantee one token per row (accepted drafts depend on the
    request, not the catalog); mixed ones both. State, vision and init
    programs serve no tokens.
    """
    if graph.kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
        return graph.prefill_capacity
    if graph.kind in (GraphKind.DECODE, GraphKind.SPECULATIVE):
        return graph.batch_capacity
    if graph.kind is GraphKind.MIXED:
        return graph.prefill_capacity + graph.batch_capacity - 1
    return 0


def token_normalizer(measured: Iterable[tuple[GraphDescriptor, int]]) -> float | None:
    """Best measured token throughput of the catalog, tokens/ms; None if nothing is measured.

    ``measured`` yields (descriptor, estimated duration ns); entries with an
    unknown (0) duration are skipped. Stale estimates count (D2).
    """
    best = None
    for graph, duration_ns in measured:
        tokens = guaranteed_tokens(graph)
        if duration_ns > 0 and tokens > 0:
            rate = tokens / (duration_ns / 1e6)
            best = rate if best is None else max(best, rate)
    return best


def fair_token_rate(normalizer: float | None, participants: int) -> float:
    """A new request's starting x: the normalizer shared by ``participants`` requests."""
    if participants < 1:
        raise ValueError(f"participants must be >= 1 (the new request counts), got {participants}")
    if normalizer is None:
        return COLD_TOKEN_RATE_PER_MS
    return normalizer / participants


# ---------------------------------------------------------------------------
# Reference interval sigma (U5).
# ---------------------------------------------------------------------------


@dataclass(slots=True, unsafe_hash=True)  # per-frame: not frozen (docs/runtime.md, "Per-frame records")
class DeliveryFamily:
    """Delivery-bearing streams that the same programs can serve together.

    ``proposal_source`` None is the family of ordinary decoders; "learned" or
    "copy" the speculative decoders drafting from that source. A program
    serves a family when it produces output tokens (decode, speculative or
    mixed) with that proposal source.
    """

    proposal_source: str | None = None

    def serves(self, graph: GraphDescriptor) -> bool:
        return (
            graph.kind in (GraphKind.DECODE, GraphKind.SPECULATIVE, GraphKind.MIXED)
            and graph.proposal_source == self.proposal_source
        )


@dataclass(slots=True, unsafe_hash=True)  # per-frame: not frozen (docs/runtime.md, "Per-frame records")
class ShapeTiming:
    """A measured program that can serve a family: its duration and batch capacity."""

    duration_ms: float
    batch_capacity: int


def reference_interval_ms(total_streams: int, family_streams: int, shapes: Iterable[ShapeTiming]) -> float | None:
    """sigma = K*T/min(B, k) for the shape minimizing T/min(B, k) (U5); None if none is measured.

    ``total_streams`` K counts delivery-bearing streams (decoders; prefill-only
    requests excluded), ``family_streams`` k those of the request's family,
    ``shapes`` the family's measured programs.
    """
    if not 1 <= family_streams <= total_streams:
        raise ValueError(
            f"need 1 <= family streams <= total streams, got k={family_streams}, K={total_streams}"
        )
    best = None
    for shape in shapes:
        if shape.duration_ms > 0 and shape.batch_capacity > 0:
            per_stream = shape.duration_ms / min(shape.batch_capacity, family_streams)
            best = per_stream if best is None else min(best, per_stream)
    return None if best is None else total_streams * best
