"""The direct scheduler's duration estimates: a 7/8 moving average that forgets.

Unlike Helios (spec D2: first sample, then the median of the last nine, stale
entries kept usable), each program here holds one number: the first positive
device interval sets it, every later one moves it by an eighth of the
difference, and an estimate that no sample has refreshed for the time to live
(30 s) reverts to unmeasured. Time comes only from the caller (``now_ns``).
"""

from __future__ import annotations

from dataclasses import dataclass

from flare_contract.graphs import CostKey
from helios.scheduler.cost import Standing

ESTIMATE_TTL_NS = 30_000_000_000  # spec, first section: reverts to unmeasured after 30 s
KEEP = 7 / 8  # weight of the old estimate in each update


@dataclass(slots=True)
class Estimate:
    """One program's average and when a sample last refreshed it."""

    average_ns: float
    observed_ns: int
    last_attempt_ns: int | None = None


class MovingAverageCost:
    """Per cost key: new = 7/8 old + 1/8 sample; unmeasured again after ``ttl_ns`` without a sample."""

    def __init__(self, ttl_ns: int = ESTIMATE_TTL_NS) -> None:
        if ttl_ns <= 0:
            raise ValueError(f"ttl_ns must be positive, got {ttl_ns}")
        self.ttl_ns = ttl_ns
        self._entries: dict[CostKey, Estimate] = {}

    def observe(self, key: CostKey, device_ns: int, readiness_delay_ns: int, now_ns: int) -> bool:
        """Fold one device interval in; False when it carries no duration (zero or missing: D3)."""
        sample = device_ns - max(0, readiness_delay_ns)
        if device_ns <= 0 or sample <= 0:
            return False
        entry = self._entries.get(key)
        if entry is None or not self._fresh(entry, now_ns):
            self._entries[key] = Estimate(float(sample), now_ns, entry.last_attempt_ns if entry else None)
        else:
            entry.average_ns = KEEP * entry.average_ns + (1 - KEEP) * sample
            entry.observed_ns = now_ns
        return True

    def estimate_ns(self, key: CostKey, now_ns: int) -> int:
        """The current average in whole nanoseconds, or 0 (unmeasured, or reverted after the TTL)."""
        entry = self._entries.get(key)
        if entry is None or not self._fresh(entry, now_ns):
            return 0
        return max(1, round(entry.average_ns))

    def age_ns(self, key: CostKey, now_ns: int) -> int | None:
        """Time since the last sample, None if never measured."""
        entry = self._entries.get(key)
        return None if entry is None else now_ns - entry.observed_ns

    def _fresh(self, entry: Estimate, now_ns: int) -> bool:
        return now_ns - entry.observed_ns < self.ttl_ns

    # -- what the Helios core asks of its cost model (``helios.scheduler.cost.DurationModel``) --

    def standing(self, key: CostKey, now_ns: int) -> Standing:
        """The estimate now, always fresh (nothing is stale-but-usable here), until it reverts."""
        entry = self._entries.get(key)
        if entry is None or not self._fresh(entry, now_ns):
            return Standing(0, True, None)
        return Standing(max(1, round(entry.average_ns)), True, entry.observed_ns + self.ttl_ns)

    def requires_feedback(self, key: CostKey, now_ns: int) -> bool:
        return self.estimate_ns(key, now_ns) == 0

    def mark_attempt(self, key: CostKey, now_ns: int) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            entry.last_attempt_ns = now_ns

    def last_observation_ns(self, key: CostKey) -> int | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.observed_ns
