"""Learned duration estimates, one per physical program (spec "Duration estimates").

Checklist D1-D3 and the bookkeeping D5-D7 need:

- An entry is keyed by ``CostKey`` (``GraphDescriptor.cost_key()``): kind, B,
  token capacity W, proposal depth D, prefill capacity and P. How many rows a
  dispatch actually used never changes which entry it updates (D1).
- Every entry starts unknown (estimate 0) whatever the catalog file says (C11);
  the descriptor's ``estimated_duration_ns`` is never read here.
- The first positive observation sets the estimate. While the entry is fresh,
  each further valid sample joins a window of the last nine and the estimate
  becomes the window's median (the mean of the middle pair for an even count).
- An entry is stale once ``ttl_ns`` has passed since its last valid
  observation. A stale entry keeps its measured estimate (selection and the
  service normalizer still use it), and its first valid observation replaces
  the estimate outright: the old window is dropped, because the conditions it
  measured are the ones staleness says we no longer trust (D2).
- A sample is the device interval minus the exposed readiness delay (D3),
  floored at ``min_sample_ns`` so that a delay measured a little longer than
  its interval cannot turn a measured program into an unknown or free one.
  Missing (zero) device intervals change nothing and do not refresh freshness.
- ``mark_attempt`` records the last committed dispatch (D7 orders refresh
  candidates by the later of last observation and last attempt); the core
  calls it on commit only, never on plan.

Times are integer nanoseconds on the scheduler's own clock (``advance_to``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from flare_contract.graphs import CostKey

MEDIAN_WINDOW = 9
"""Samples the fresh median is taken over (D2)."""


@dataclass(slots=True)
class CostEntry:
    """What is known about one physical program's duration."""

    estimate_ns: int = 0  # 0: unknown (never measured)
    window: deque[int] = field(default_factory=lambda: deque(maxlen=MEDIAN_WINDOW))
    last_observation_ns: int | None = None  # last valid sample, scheduler clock
    last_attempt_ns: int | None = None  # last committed dispatch, scheduler clock


@dataclass(slots=True, unsafe_hash=True)  # per-frame: not frozen (docs/runtime.md, "Per-frame records")
class Standing:
    """One program's estimate as selection reads it at one instant, and until when it holds."""

    estimate_ns: int  # 0: unmeasured
    fresh: bool  # False: measured but stale (D2); still usable, needs feedback (D5)
    until_ns: int | None  # when it changes without an observation (None: only an observation changes it)


class DurationModel(Protocol):
    """What the scheduler core asks of a cost model (``Scheduler(cost=...)``).

    ``CostModel`` below is Helios's (D1-D3, D5); ``helios.direct.cost.MovingAverageCost``
    is the direct scheduler's. ``CatalogTiming`` reads ``standing`` after each observation
    and at each ``until_ns``, so estimates that change with time alone stay current.
    """

    ttl_ns: int

    def observe(self, key: CostKey, device_ns: int, readiness_delay_ns: int, now_ns: int) -> bool: ...

    def standing(self, key: CostKey, now_ns: int) -> Standing: ...

    def requires_feedback(self, key: CostKey, now_ns: int) -> bool: ...

    def mark_attempt(self, key: CostKey, now_ns: int) -> None: ...

    def last_observation_ns(self, key: CostKey) -> int | None: ...


def median_ns(samples: deque[int] | list[int]) -> int:
    """Median of a nonempty sample list; an even count averages the middle pair."""
    ordered = sorted(samples)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) // 2


class CostModel:
    """Duration estimates for every physical program the scheduler may pick.

    ``ttl_ns`` is the freshness interval (``PolicyConfig.estimate_ttl_ns``);
    assign ``ttl_ns`` again if the policy is reconfigured before admission.
    """

    def __init__(self, ttl_ns: int, *, min_sample_ns: int = 1) -> None:
        if ttl_ns <= 0:
            raise ValueError(f"CostModel ttl_ns must be > 0, got {ttl_ns!r}")
        if min_sample_ns <= 0:
            raise ValueError(f"CostModel min_sample_ns must be > 0, got {min_sample_ns!r}")
        self.ttl_ns = ttl_ns
        self.min_sample_ns = min_sample_ns
        self._entries: dict[CostKey, CostEntry] = {}

    def _entry(self, key: CostKey) -> CostEntry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = CostEntry()
        return entry

    def estimate_ns(self, key: CostKey) -> int:
        """Current estimate in ns; 0 means unknown. Staleness never zeroes it."""
        entry = self._entries.get(key)
        return entry.estimate_ns if entry else 0

    def is_known(self, key: CostKey) -> bool:
        return self.estimate_ns(key) > 0

    def is_stale(self, key: CostKey, now_ns: int) -> bool:
        """A measured entry with no valid observation for ``ttl_ns`` (unknown is not stale)."""
        entry = self._entries.get(key)
        if entry is None or entry.last_observation_ns is None:
            return False
        return now_ns - entry.last_observation_ns >= self.ttl_ns

    def standing(self, key: CostKey, now_ns: int) -> Standing:
        """The estimate (kept when stale), its freshness, and when a fresh measured one turns stale."""
        entry = self._entries.get(key)
        observed = entry.last_observation_ns if entry else None
        if observed is None:
            return Standing(entry.estimate_ns if entry else 0, True, None)
        fresh = now_ns - observed < self.ttl_ns
        return Standing(entry.estimate_ns, fresh, observed + self.ttl_ns if fresh else None)

    def requires_feedback(self, key: CostKey, now_ns: int) -> bool:
        """Unknown or stale programs may run only with an empty queue and feedback (D5)."""
        return not self.is_known(key) or self.is_stale(key, now_ns)

    def observe(self, key: CostKey, device_ns: int, readiness_delay_ns: int, now_ns: int) -> bool:
        """Feed one executed frame's device interval; True when it was a valid sample.

        ``device_ns`` is the maximum positive rank-local device interval (0 when
        missing); ``readiness_delay_ns`` the exposed embedding-readiness delay
        already aggregated over ranks (0 when not measured).
        """
        if device_ns < 0 or readiness_delay_ns < 0:
            raise ValueError(
                "device and readiness intervals must be >= 0 ns "
                f"(0 = missing), got device_ns={device_ns}, readiness_delay_ns={readiness_delay_ns}"
            )
        if device_ns == 0:
            return False  # missing: no change, and no freshness either
        sample = max(device_ns - readiness_delay_ns, self.min_sample_ns)
        entry = self._entry(key)
        if self.is_stale(key, now_ns):
            entry.window.clear()  # a stale entry's first sample replaces it (D2)
        entry.window.append(sample)
        entry.estimate_ns = median_ns(entry.window)
        entry.last_observation_ns = now_ns
        return True

    def mark_attempt(self, key: CostKey, now_ns: int) -> None:
        """Record a committed dispatch of this program (not a planned one)."""
        self._entry(key).last_attempt_ns = now_ns

    def last_observation_ns(self, key: CostKey) -> int | None:
        entry = self._entries.get(key)
        return entry.last_observation_ns if entry else None

    def last_attempt_ns(self, key: CostKey) -> int | None:
        entry = self._entries.get(key)
        return entry.last_attempt_ns if entry else None

    def last_touched_ns(self, key: CostKey) -> int | None:
        """The later of last valid observation and last attempt (D7's refresh order)."""
        times = [t for t in (self.last_observation_ns(key), self.last_attempt_ns(key)) if t is not None]
        return max(times) if times else None

    def samples(self, key: CostKey) -> tuple[int, ...]:
        """The current median window (oldest first), for traces and tests."""
        entry = self._entries.get(key)
        return tuple(entry.window) if entry else ()
