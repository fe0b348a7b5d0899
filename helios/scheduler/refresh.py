"""Exploration credit: funded timing refresh and funded acceptance learning.

Spec sections "Funded timing refresh" and "Funded acceptance learning";
checklist D6, D7 (credit, episodes, refresh order), D8 (the learning ledger)
and D9 (execution time and counts by selection reason).

Ordinary work pays for exploration. Every ordinary completion with a valid
device interval earns a fixed share of its frame interval in two separate
ledgers: 0.002/0.998 for timing refresh, 0.01/0.99 for acceptance learning.
A ledger's balance is capped at 5 ms, and an episode may start only with a
full 5 ms, one at a time; the episode then pays its whole actual duration,
which can leave the balance negative. Because a start needs a nonnegative
balance, everything paid before the latest episode was earned first, which
is the spec's aggregate bound P <= share * O + D (D: the latest episode).

Shares are exact fractions and balances are integers in units of
1/denominator ns, so thresholds such as "2,495 ms of ordinary execution funds
the first refresh" hold exactly, with no rounding drift over long runs.

``ExplorationAccounts`` is the one entry point the scheduler uses: it routes
each executed frame by its ``SelectionReason``, so a refresh execution can only
pay the timing ledger and a probe only the learning ledger (D8: the ledgers
never charge the same execution).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from flare_contract.graphs import CostKey
from helios.scheduler.cost import CostModel
from helios.scheduler.types import ExecutionTiming, SelectionReason

TIMING_REFRESH_SHARE = Fraction(2, 998)  # D6
ACCEPTANCE_LEARNING_SHARE = Fraction(1, 99)  # D8: 0.01 / 0.99
CREDIT_CAP_NS = 5_000_000  # both ledgers: balance cap and full credit (5 ms)

EXPLORATION_REASONS = (SelectionReason.TIMING_REFRESH, SelectionReason.ACCEPTANCE_LEARNING)


def frame_interval_ns(timing: ExecutionTiming, queued: bool) -> int:
    """The frame's measured interval (A3): device for queued frames, max(device, wall) otherwise.

    Raw physical time: the readiness correction belongs to cost samples
    only, never to exploration budgets.
    """
    return timing.device_ns if queued else max(timing.device_ns, timing.wall_ns)


def physical_ns(timing: ExecutionTiming, queued: bool) -> int:
    """Time an execution is charged: its interval, or its wall time when the device interval is missing (D7)."""
    if timing.device_ns > 0:
        return frame_interval_ns(timing, queued)
    return timing.wall_ns


class CreditLedger:
    """One exploration budget: a capped balance and at most one open episode.

    The scheduler drives ledgers only through ``ExplorationAccounts``; the
    methods here are its building blocks.
    """

    __slots__ = ("share", "_balance", "episode_open", "last_episode_ns", "_denominator", "_cap")

    def __init__(self, share: Fraction) -> None:
        if not 0 < share < 1:
            raise ValueError(f"a credit share must lie strictly between 0 and 1, got {share}")
        self.share = share
        self._denominator = share.denominator  # a Fraction's parts are properties: read once
        self._cap = CREDIT_CAP_NS * share.denominator  # CREDIT_CAP_NS in balance units
        self._balance = 0  # in 1/share.denominator ns
        self.episode_open = False
        self.last_episode_ns = 0  # actual duration of the latest closed episode

    @property
    def balance_ns(self) -> float:
        """Credit in ns; negative while an overrun's debt is being repaid."""
        return self._balance / self._denominator

    @property
    def full(self) -> bool:
        return self._balance >= self._cap

    def earn(self, credited_ns: int) -> None:
        """An ordinary completion's share of its credited interval; the balance stops at the cap."""
        self._balance = min(self._cap, self._balance + credited_ns * self.share.numerator)

    def discard_positive(self) -> None:
        """Idle: unused credit lapses, debt stays (D6)."""
        self._balance = min(self._balance, 0)

    def begin(self) -> None:
        if self.episode_open:
            raise ValueError("an exploration episode is already open; complete it before starting another")
        if not self.full:
            raise ValueError(
                f"an episode needs full credit ({CREDIT_CAP_NS} ns), the balance is {self.balance_ns:.0f} ns"
            )
        self.episode_open = True

    def close(self, charged_ns: int) -> None:
        """The episode's frame completed: it pays its whole actual duration, possibly into debt."""
        if not self.episode_open:
            raise ValueError("no open episode to close: call begin at commit")
        self._balance -= charged_ns * self._denominator
        self.episode_open = False
        self.last_episode_ns = charged_ns


class TimingRefreshLedger(CreditLedger):
    """D6/D7: 0.002/0.998 of credited ordinary time; the first refresh needs 2,495 ms of it."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(TIMING_REFRESH_SHARE)


class AcceptanceLearningLedger(CreditLedger):
    """D8: 0.01/0.99 of raw ordinary time; the first probe needs 495 ms of it."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(ACCEPTANCE_LEARNING_SHARE)


@dataclass(slots=True)
class ReasonTotals:
    """One D9 category: executions and their physical nanoseconds."""

    executions: int = 0
    nanoseconds: int = 0


class ExecutionCounters:
    """D9: execution counts and nanoseconds split by selection reason."""

    __slots__ = ("_totals",)

    def __init__(self) -> None:
        self._totals = {reason: ReasonTotals() for reason in SelectionReason}

    def add(self, reason: SelectionReason, nanoseconds: int) -> None:
        totals = self._totals[reason]
        totals.executions += 1
        totals.nanoseconds += nanoseconds

    def executions(self, reason: SelectionReason) -> int:
        return self._totals[reason].executions

    def nanoseconds(self, reason: SelectionReason) -> int:
        return self._totals[reason].nanoseconds

    def as_labels(self) -> dict[str, tuple[int, int]]:
        """{category: (executions, nanoseconds)} in the metric label spelling."""
        return {r.value: (t.executions, t.nanoseconds) for r, t in self._totals.items()}


@dataclass(frozen=True, slots=True)
class ExplorationCredit:
    """Both balances at one moment, for the plan trace (A12); ns, negative while in debt."""

    timing_refresh_ns: float
    acceptance_learning_ns: float


class ExplorationAccounts:
    """Both ledgers and the D9 counters behind one entry point.

    Core hooks: ``can_begin(reason)`` while planning, ``begin(reason)`` when an
    exploration plan commits, ``record(reason, timing, queued)`` for every
    completed frame, ``idle()`` when the device runs dry. ``credit_ns(reason)``
    feeds the plan trace (A12).
    """

    __slots__ = ("timing", "learning", "counters")

    def __init__(self) -> None:
        self.timing = TimingRefreshLedger()
        self.learning = AcceptanceLearningLedger()
        self.counters = ExecutionCounters()

    def _ledger(self, reason: SelectionReason) -> CreditLedger:
        if reason is SelectionReason.TIMING_REFRESH:
            return self.timing
        if reason is SelectionReason.ACCEPTANCE_LEARNING:
            return self.learning
        raise ValueError(f"{reason.value} executions spend no exploration credit; expected one of "
                         f"{', '.join(r.value for r in EXPLORATION_REASONS)}")

    @property
    def episode_open(self) -> bool:
        return self.timing.episode_open or self.learning.episode_open

    def credit_ns(self, reason: SelectionReason) -> float:
        return self._ledger(reason).balance_ns

    def credit(self) -> ExplorationCredit:
        return ExplorationCredit(self.timing.balance_ns, self.learning.balance_ns)

    def can_begin(self, reason: SelectionReason) -> bool:
        """Full credit in that ledger and no exploration episode in flight."""
        return not self.episode_open and self._ledger(reason).full

    def begin(self, reason: SelectionReason) -> None:
        """An exploration plan was committed: open its episode (one at a time, overall)."""
        if self.episode_open:
            raise ValueError("an exploration episode is already in flight; complete it first")
        self._ledger(reason).begin()

    def record(self, reason: SelectionReason, timing: ExecutionTiming, queued: bool) -> None:
        """One completed frame, routed by why it was selected.

        Ordinary frames with a valid device interval earn in both ledgers;
        discovery earns nothing; an exploration frame closes its episode and
        pays its physical time to its own ledger only. A frame that never ran
        (cancelled before dispatch) passes zero intervals and pays nothing.
        """
        if timing.device_ns < 0 or timing.wall_ns < 0:
            raise ValueError(f"execution intervals must be >= 0 ns, got {timing}")
        exploring = reason in EXPLORATION_REASONS
        if exploring and not self._ledger(reason).episode_open:
            raise ValueError(f"no open {reason.value} episode to close: call begin at commit")
        spent = physical_ns(timing, queued)
        self.counters.add(reason, spent)
        if exploring:
            self._ledger(reason).close(spent)
        elif reason is SelectionReason.ORDINARY and timing.device_ns > 0:
            credited = frame_interval_ns(timing, queued)
            self.timing.earn(credited)
            self.learning.earn(credited)

    def idle(self) -> None:
        """The device ran out of work: positive credit lapses in both ledgers, debt stays."""
        if self.episode_open:
            raise ValueError("idle() while an exploration episode is in flight: its frame has not completed")
        self.timing.discard_positive()
        self.learning.discard_positive()


# ---------------------------------------------------------------------------
# Which stale alternative a funded refresh runs (D7)
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StaleAlternative:
    """A feasible stale program that could displace the ordinary winner.

    ``last_observation_ns``: its last valid timing sample (a stale program was
    measured once, so there is one); ``last_attempt_ns``: its last committed
    dispatch, None if never; ``value``: its ordinary useful-value ranking
    score (larger is better).
    """

    key: Hashable
    last_observation_ns: int
    last_attempt_ns: int | None
    value: float

    @property
    def last_touched_ns(self) -> int:
        if self.last_attempt_ns is None:
            return self.last_observation_ns
        return max(self.last_observation_ns, self.last_attempt_ns)


def refresh_order(alternatives: Iterable[StaleAlternative]) -> list[StaleAlternative]:
    """Oldest first by the later of observation and attempt, then higher value (D7).

    A failed attempt counts as touching the program, so an alternative whose
    timings keep coming back invalid does not monopolise refresh credit.
    """
    return sorted(alternatives, key=lambda a: (a.last_touched_ns, -a.value))


def refresh_choice(alternatives: Iterable[StaleAlternative]) -> StaleAlternative | None:
    """The alternative a funded refresh runs, or None when there is none."""
    ordered = refresh_order(alternatives)
    return ordered[0] if ordered else None


def stale_alternatives(cost: CostModel, values: Mapping[CostKey, float], now_ns: int) -> list[StaleAlternative]:
    """The stale entries among feasible alternatives, with their D7 ordering data.

    ``values`` maps each feasible alternative's cost key to its ordinary
    value score. Unknown programs are discovery's, fresh ones ordinary
    selection's; only measured, stale ones can be refreshed.
    """
    out = []
    for key, value in values.items():
        if cost.is_known(key) and cost.is_stale(key, now_ns):
            observed = cost.last_observation_ns(key)
            out.append(StaleAlternative(key, observed, cost.last_attempt_ns(key), value))
    return out
