"""Every graph's duration knowledge as selection reads it, kept current instead of rebuilt per plan.

The cost model (``CostModel``, or any ``cost.DurationModel``) answers per
physical program (D1-D3, D5), and says until when each answer holds. Selection wants one
``GraphTiming`` per catalog graph on every plan, and the token normalizer the
best measured token rate of the catalog. Both change only when an estimate
changes (an observation of one physical program) or when the clock passes the
time its standing holds until (for ``CostModel``, a measured estimate turning
stale at its last observation plus ``ttl_ns``, D2). So
the table is updated on exactly those events: an observation refreshes the
graphs sharing that cost key, and the clock passing the earliest staleness
time refreshes the freshness of all. The lists it hands out are never mutated
afterwards; an update builds new ones, and only when a timing really changed
(an observation that leaves the median where it was keeps the list), so the
list's identity tells a caller whether anything it derived is still current.

The reference interval (U5) needs, per delivery family, the fastest measured
program of each batch capacity; those are kept here too and updated per batch
when a duration changes, instead of being rescanned per plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from flare_contract.graphs import GENERATION_KINDS, CostKey, GraphDescriptor, GraphKind
from helios.scheduler.cost import DurationModel
from helios.scheduler.select.timing import GraphTiming, durations_ms
from helios.scheduler.service import DeliveryFamily, ShapeTiming, guaranteed_tokens
from helios.scheduler.utility import PrefillTimes


class CatalogTiming:
    """``GraphTiming`` per graph and the token normalizer, for one catalog over one cost model."""

    def __init__(self, graphs: Sequence[GraphDescriptor], cost: DurationModel) -> None:
        self._cost = cost
        self._keys = tuple(g.cost_key() for g in graphs)
        self._by_key: dict[CostKey, list[int]] = {}
        for index, key in enumerate(self._keys):
            self._by_key.setdefault(key, []).append(index)
        self._graphs = tuple(graphs)
        # (index, guaranteed tokens) of the programs ``_best_rate`` reads: generation programs first, every one
        # serving tokens as fallback (``service.token_normalizer``'s terms, fixed by the catalog)
        tokens = [guaranteed_tokens(g) for g in self._graphs]
        self._generation_tokens = tuple((i, n) for i, (g, n) in enumerate(zip(self._graphs, tokens))
                                        if n > 0 and g.kind in GENERATION_KINDS)
        self._serving_tokens = tuple((i, n) for i, n in enumerate(tokens) if n > 0)
        self._timings: list[GraphTiming] = []
        self._durations: list[float] | None = None  # durations_ms(self._timings), built on first use
        self._prefill: tuple[PrefillTimes | None] | None = None  # (prefill_times(self._timings),), on first use
        self._stale_at: dict[CostKey, int] = {}  # measured, still fresh: when each turns stale
        # never later than the earliest of ``_stale_at`` (a re-observation only moves an entry
        # later), so ``at`` scans the entries only once the clock reaches it
        self._stale_bound: int | None = None
        self._normalizer: float | None = None
        self._families: dict[DeliveryFamily, _FamilyShapes] = {}
        self._raw: dict[CostKey, GraphTiming] = {}  # the cost model's answer per key, before any floor
        self._floors: dict[int, int] = {}  # ``floor_twins``: draft-keeping twin index -> its plain program's
        self._floored_by: dict[int, list[int]] = {}  # plain index -> the twins it floors
        self.reset(0)

    def floor_twins(self, twins: dict[int, int], now_ns: int) -> None:
        """Read each draft-keeping width-one program (index) as never faster than its plain twin (index):
        it runs the plain program's target work and the draft's absorption step besides, so an estimate
        below the plain one is noise (an early sample on a busy machine that the loser of the decision
        never gets to correct). Set where both are loaded (the adaptive engine's plain floor,
        ``Scheduler.track_draft_state``); docs/scheduling-utility.md, departure 4."""
        self._floors = dict(twins)
        self._floored_by = {}
        for twin, plain in self._floors.items():
            self._floored_by.setdefault(plain, []).append(twin)
        self.reset(now_ns)

    def at(self, now_ns: int) -> list[GraphTiming]:
        """Every graph's timing at ``now_ns`` (the scheduler clock never goes back)."""
        bound = self._stale_bound
        if bound is not None and now_ns >= bound:
            earliest = self._stale_bound = min(self._stale_at.values(), default=None)
            if earliest is not None and now_ns >= earliest:
                self.reset(now_ns)
        return self._timings

    def durations_ms(self, timings: Sequence[GraphTiming]) -> list[float]:
        """``select.timing.durations_ms(timings)``, kept with this table's own list while it stands."""
        if timings is not self._timings:
            return durations_ms(timings)
        if self._durations is None:
            self._durations = durations_ms(timings)
        return self._durations

    def prefill_times(self, timings: Sequence[GraphTiming]) -> PrefillTimes | None:
        """The fastest known one-row prefill time per prompt capacity under ``timings`` (issue 20's chunk share)."""
        if timings is self._timings and self._prefill is not None:
            return self._prefill[0]
        measured = [(g.prefill_capacity, t.duration_ns / 1e6) for g, t in zip(self._graphs, timings)
                    if g.kind is GraphKind.PREFILL and t.known]
        found = PrefillTimes.of(measured)
        if timings is self._timings:
            self._prefill = (found,)
        return found

    def normalizer(self, now_ns: int) -> float | None:
        """Best measured token rate of the generation programs, else of the whole catalog (tokens/ms),
        at ``now_ns`` (an estimate that lapses with time, as the direct scheduler's do, lapses here too)."""
        self.at(now_ns)
        return self._normalizer

    def observed(self, key: CostKey, now_ns: int) -> None:
        """``key``'s estimate may have changed at ``now_ns``: refresh the graphs that share it."""
        indices = self._by_key.get(key)
        if not indices:
            return
        timing = self._timing(key, now_ns)
        if timing == self._raw.get(key):
            return  # same estimate and freshness: everything derived from the list still holds
        self._raw[key] = timing
        timings = list(self._timings)
        touched = [*indices, *(t for i in indices for t in self._floored_by.get(i, ()))]  # and twins they floor
        for index in touched:
            timings[index] = self._floored(index)
        self._timings = timings
        # what was derived from the old list stands except at the touched programs: durations are per
        # program, and the prefill times read prefill programs only (each entry as ``durations_ms`` and
        # ``prefill_times`` would build it: the same floats)
        durations = self._durations
        if durations is not None:
            durations = self._durations = list(durations)
            for index in touched:
                ns = timings[index].duration_ns
                durations[index] = ns / 1e6 if ns > 0 else 0.0
        if self._prefill is not None and any(self._graphs[i].kind is GraphKind.PREFILL for i in touched):
            self._prefill = None
        self._normalizer = self._best_rate()
        for shapes in self._families.values():
            shapes.update(touched, timings)

    def reset(self, now_ns: int) -> None:
        """Rebuild everything from the cost model (at start, after the TTL changes, when an entry turns stale)."""
        self._stale_at = {}
        self._stale_bound = None
        self._raw = {key: self._timing(key, now_ns) for key in self._by_key}
        self._timings = [self._floored(index) for index in range(len(self._keys))]
        self._durations = None
        self._prefill = None
        self._normalizer = self._best_rate()
        self._families = {}

    def fastest_shapes(self, family: DeliveryFamily, timings: Sequence[GraphTiming]) -> tuple[ShapeTiming, ...]:
        """The family's fastest measured program per batch capacity under ``timings``: all U5's minimum can pick from.

        A slower program of the same B never has the smaller T/min(B, k).
        Kept current for this table's own list; any other list (a scheduler
        with a cost model of its own) is scanned afresh.
        """
        if timings is not self._timings:
            return _FamilyShapes.serving(family, self._graphs, timings).shapes
        found = self._families.get(family)
        if found is None:
            found = self._families[family] = _FamilyShapes.serving(family, self._graphs, self._timings)
        return found.shapes

    def _floored(self, index: int) -> GraphTiming:
        """Graph ``index``'s timing: the cost model's, raised past its plain twin's known estimate (``floor_twins``)."""
        own = self._raw[self._keys[index]]
        plain = self._floors.get(index)
        if plain is None or not own.known:
            return own
        floor = self._raw[self._keys[plain]]
        if not floor.known or own.duration_ns > floor.duration_ns:
            return own
        # strictly longer, as its work is: one nanosecond past the plain estimate sends U8's first tie
        # rule (shorter known time) to the plain program instead of letting later rules alternate them
        return GraphTiming(floor.duration_ns + 1, own.fresh)

    def _timing(self, key: CostKey, now_ns: int) -> GraphTiming:
        standing = self._cost.standing(key, now_ns)
        stale_at = standing.until_ns
        if stale_at is not None:
            self._stale_at[key] = stale_at
            if self._stale_bound is None or stale_at < self._stale_bound:
                self._stale_bound = stale_at
        else:
            self._stale_at.pop(key, None)
        return GraphTiming(standing.estimate_ns, standing.fresh)

    def _best_rate(self) -> float | None:
        """The normalizer as the core defines it: generation programs first, the whole catalog as fallback
        (``service.token_normalizer`` over each, with the tokens each program guarantees read once; this runs
        after every completed frame, over every program of the catalog)."""
        timings = self._timings
        for terms in (self._generation_tokens, self._serving_tokens):
            best = None
            for index, tokens in terms:
                ns = timings[index].duration_ns
                if ns > 0:
                    rate = tokens / (ns / 1e6)
                    if best is None or rate > best:
                        best = rate
            if best is not None:
                return best
        return None


@dataclass(slots=True)
class _FamilyShapes:
    """One delivery family's programs grouped by batch capacity, and the fastest measured one of each."""

    batch_of: dict[int, int]  # catalog index of a serving program -> its batch capacity
    batches: dict[int, tuple[int, ...]]  # batch capacity -> its serving programs (catalog order)
    fastest: dict[int, ShapeTiming] = field(default_factory=dict)
    shapes: tuple[ShapeTiming, ...] = ()

    @classmethod
    def serving(cls, family: DeliveryFamily, graphs: Sequence[GraphDescriptor], timings) -> "_FamilyShapes":
        batch_of = {i: g.batch_capacity for i, g in enumerate(graphs) if family.serves(g)}
        batches: dict[int, list[int]] = {}
        for i, batch in batch_of.items():
            batches.setdefault(batch, []).append(i)
        found = cls(batch_of, {b: tuple(ix) for b, ix in batches.items()})
        found.update(batch_of, timings)
        return found

    def update(self, indices, timings: Sequence[GraphTiming]) -> None:
        """Recompute the batch capacities of ``indices`` (catalog positions whose timing changed)."""
        touched = {self.batch_of[i] for i in indices if i in self.batch_of}
        for batch in touched:
            measured = [timings[i].duration_ns / 1e6 for i in self.batches[batch] if timings[i].known]
            if measured:
                self.fastest[batch] = ShapeTiming(min(measured), batch)
            else:
                self.fastest.pop(batch, None)
        if touched:
            self.shapes = tuple(self.fastest[b] for b in self.batches if b in self.fastest)
