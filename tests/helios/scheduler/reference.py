"""Reference arithmetic the tests check the scheduler against; production never calls it.

The scheduler writes these formulas out inline where they are hot (the core's
queue snapshot, the explorer's bounded probe search); the straightforward
versions live here so that the tests have one oracle each and the production
modules carry only what runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from helios.scheduler.config import PolicyConfig
from helios.scheduler.learning import (
    ProbeCandidate,
    ProbeLane,
    WidthProgram,
    lane_probe_terms,
    rank_probes,
    term_candidate,
    term_rank_key,
)
from helios.scheduler.select.choice import Choice
from helios.scheduler.service import MIN_RATE_PER_MS, ServiceHistory, blend, decay_factor

# ---------------------------------------------------------------------------
# Service prices (U3, U5) and the queue projection (A10)
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Prices:
    """Value per unit of service for one request, in prompt-token value units (U3)."""

    prefill_token: float  # 1 + f/x
    output_token: float  # beta + f/x
    delivery: float  # g/z; only decoders earn deliveries


@dataclass(frozen=True, slots=True)
class FrameService:
    """Service one queued frame is expected to give one request: tokens and deliveries over its duration."""

    tokens: float
    deliveries: float
    duration_ms: float


def price_terms(policy: PolicyConfig, token_rate: float, delivery_rate: float | None,
                delivery_fallback_rate: float) -> tuple[float, float]:
    """(f/x, g/z) from bare rates; a missing z is replaced by ``delivery_fallback_rate``."""
    z = delivery_rate if delivery_rate is not None else delivery_fallback_rate
    return policy.token_fairness / token_rate, policy.delivery_fairness / max(z, MIN_RATE_PER_MS)


def prices(history: ServiceHistory, policy: PolicyConfig, *, delivery_fallback_rate: float) -> Prices:
    """A history's current prices. A decoder lacks z only while its first output is buffered (U5: 1/sigma)."""
    congestion, delivery = price_terms(policy, history.token_rate, history.delivery_rate, delivery_fallback_rate)
    return Prices(prefill_token=1.0 + congestion, output_token=policy.output_token_value + congestion,
                  delivery=delivery)


def projected_rates(token_rate: float, delivery_rate: float | None, service: FrameService,
                    decay: float) -> tuple[float, float | None]:
    """(x, z) advanced by one queued frame's expected service (A10)."""
    x = blend(token_rate, service.tokens, service.duration_ms, decay)
    if delivery_rate is not None:
        return x, blend(delivery_rate, service.deliveries, service.duration_ms, decay)
    if service.deliveries > 0:
        return x, service.deliveries / service.duration_ms  # A5's first-burst rule
    return x, None


def projected(history: ServiceHistory, service: FrameService, adaptation_ms: float) -> ServiceHistory:
    """A copy of ``history`` advanced by one queued frame (A10); ``history`` is untouched."""
    decay = decay_factor(service.duration_ms, adaptation_ms)
    token_rate, delivery_rate = projected_rates(history.token_rate, history.delivery_rate, service, decay)
    return ServiceHistory(token_rate=token_rate, delivery_rate=delivery_rate)


def utility_rate(token_rate: float, delivery_rate: float | None, token_value: float, policy: PolicyConfig) -> float:
    """One request's stationary utility rate v*x + f*log x (+ g*log z for decoders); prices are its gradient."""
    utility = token_value * token_rate + policy.token_fairness * math.log(token_rate)
    if delivery_rate is not None:
        utility += policy.delivery_fairness * math.log(delivery_rate)
    return utility


# ---------------------------------------------------------------------------
# Acceptance probes (D8)
# ---------------------------------------------------------------------------


def _probe_terms(lane: ProbeLane, programs: Iterable[WidthProgram]) -> tuple[int, float, list[tuple]]:
    """The ordinary depth and rate, and (program, depth, rate, gain, weight) of each qualifying program."""
    if lane.fixed_width:
        return 0, 0.0, []
    return lane_probe_terms(lane.means, lane.weights, lane.remaining_output, lane.ordinary, lane.token_value,
                            lane.alpha, programs)


def probe_candidates(lane: ProbeLane, programs: Iterable[WidthProgram]) -> list[ProbeCandidate]:
    """Every program that qualifies as an acceptance probe for ``lane``, best first."""
    ordinary_depth, ordinary_rate, terms = _probe_terms(lane, programs)
    return rank_probes(term_candidate(lane, ordinary_depth, ordinary_rate, t) for t in terms)


def best_lane_probe(lane: ProbeLane, programs: Iterable[WidthProgram]) -> ProbeCandidate | None:
    """``probe_candidates(lane, programs)[0]`` (or None), building only that one (``min`` keeps the first tie)."""
    ordinary_depth, ordinary_rate, terms = _probe_terms(lane, programs)
    if not terms:
        return None
    return term_candidate(lane, ordinary_depth, ordinary_rate, min(terms, key=term_rank_key))


def best_probe(lanes: Iterable[ProbeLane], programs: Sequence[WidthProgram]) -> ProbeCandidate | None:
    """The single probe to fund across several lanes, or None when no lane qualifies."""
    ranked = rank_probes(c for lane in lanes for c in probe_candidates(lane, programs))
    return ranked[0] if ranked else None


# ---------------------------------------------------------------------------
# Selection (U7)
# ---------------------------------------------------------------------------


def scaled_rate(choice: Choice) -> float:
    """The winner's score after the decision's common scaling (U7)."""
    return choice.score * math.exp(choice.log_scale)
