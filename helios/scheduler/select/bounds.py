"""Wider speculative widths only when they can win: one bound per proposal source (U6, U8, S5).

Called once the eager groups are scored. A lane's expected tokens grow with
the width by the survival of each further draft, and survival never rises
with depth (S5: prefix survival), so from the narrowest width w0 ranked,
width w adds at most (w - w0) times the lane's next gain, p * s_w0 ** alpha.
The best k lanes at width w are then worth at most the best k at w0 plus
(w - w0) times the best k of those gains; every program of the bounded groups
is bounded with that value (its own duration, the same age terms; a mixed
program also with its best prompt row). If every bound stays below the best
score, none is scored: none can win, tie (U8), or prune the winner as padding
(a program of a wider logical width at the winner's depth never does the
same work), so the decision is the one scoring everything gives. Otherwise
every one is scored.

Only lanes sharing one age slope are bounded this way (otherwise rankings
depend on the duration), and only while everything scored is measured.

Ragged and prefix-limit speculative programs of a wider logical width are
bounded with their batch capacity B and that width: their candidate search
serves at most B lanes at no more than the full width, which the rectangular
ranking at that width values (``candidates.generation_candidate`` defers them
with exactly that bound). They may serve fewer than B lanes, so they are
bounded only where every lane adds value (prices positive, slope not
negative): then the best B lanes bound any fewer. Without this, their
candidates went to ``Out.entries`` on every decision with decoders and sent
each one down the general path, even where they cost several decode steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

from helios.scheduler.select.candidates import score_group
from helios.scheduler.select.catalog import Group, GroupKind
from helios.scheduler.select.rankings import DecisionRankings
from helios.scheduler.select.scorers import MISSING, Out

# A bound is trusted only with this relative margin over the rounding of the
# sums it bounds (64 positive terms and a few operations: far below 1e-12).
BOUND_MARGIN = 1e-9

_ABSENT = object()  # a ``PerDurations.bound_rows`` key not computed yet


@dataclass(slots=True)
class BoundRows:
    """The bounded programs of one prompt capacity (0: decoders-only cohorts).

    ``rows`` per program: (batch, 1/T, (width - w0)/T, T/2); the other fields
    are the largest of each, which scale the bound's rounding margin.
    """

    rows: list[tuple[int, float, float, float]]
    inverse: float
    steps_inverse: float
    half: float


def score_bounded(sel: DecisionRankings, groups: Sequence[Group], graphs, timings, out: Out) -> list[Group]:
    """Score the wider speculative groups unless none can reach the best measured score; return
    the groups left unscored (all of them, or none)."""
    top = max(out.scores, default=MISSING)
    if top != MISSING and not out.entries and groups and _none_can_reach(sel, top):
        return list(groups)
    for group in groups:
        score_group(sel, group, graphs, timings, out)
    return []


def _none_can_reach(sel: DecisionRankings, top: float) -> bool:
    """Whether every bounded program's bound is below ``top``: one comprehension over all of them
    per source, and one more per prompt capacity whose best row may ride in a mixed program; each
    bound trusted with a margin of ``BOUND_MARGIN`` times its terms. The decoders-only cohorts of
    mixed programs beaten by a faster rectangular sibling (``decode_only_beaten``) are left out:
    they cannot win either.
    """
    active, margin, prompters = sel.pop.active_age_price, BOUND_MARGIN, bool(sel.pop.prompters.handle)
    for bounded in sel.infos.bounded_sources:
        source = bounded.source
        cols = sel.source_columns(source)
        w0 = sel.narrowest_ranked(source, bounded.first_width)
        base = sel.decode_rankings.get((source, w0))
        if not cols.uniform or base is None:
            return False
        flat = _flat_bound_rows(sel, source, bounded.groups, w0, cols.positive)
        if flat is None:
            return False
        gains, value, slopes, n = sel.next_gains(source, w0), base.ranked.prefix, cols.slope_prefix, base.size
        if not (cols.positive and slopes[n] >= 0.0) and any(g.kind is GroupKind.ONE_BY_ONE for g in bounded.groups):
            # a ragged or prefix-limit cohort takes at most B lanes, maybe fewer (the best prefix of a
            # row budget); the best B's value and slope bound fewer lanes' only when no lane adds less
            return False
        for capacity, found in flat.items():
            if not found.rows:
                continue
            if capacity:  # the best prompt row of that capacity beside the best B - 1 decoders
                if not prompters:
                    continue
                row = sel.prompt_ranking(capacity).ranked.top()
                best = max([(row + value[k]) * inv + gains[k] * s_inv + slopes[k] - t_half * active
                            for b, inv, s_inv, t_half in found.rows for k in (b - 1 if b - 1 < n else n,)])
            else:  # decoders only
                row = 0.0
                best = max([value[k] * inv + gains[k] * s_inv + slopes[k] - t_half * active
                            for b, inv, s_inv, t_half in found.rows for k in (b if b < n else n,)])
            scale = (row + value[n]) * found.inverse + gains[n] * found.steps_inverse + slopes[n] + found.half * active
            if best + margin * scale >= top:
                return False
    return True


def _flat_bound_rows(sel: DecisionRankings, source: str, groups: Sequence[Group], w0: int,
                     positive: bool) -> dict[int, BoundRows] | None:
    """The programs of ``groups`` for ``_none_can_reach`` by prompt capacity, or None if a duration
    is unknown. Kept with the durations they were read from (``PerDurations``)."""
    cache = sel.derived.bound_rows
    key = (source, w0, positive)
    cached = cache.get(key, _ABSENT)
    if cached is not _ABSENT:
        return cached
    durations = sel.t_ms
    by_capacity: dict[int, list] = {0: []}
    for group in groups:
        steps = group.width - w0
        rows = [(batch, 1.0 / t, steps / t, 0.5 * t) for index, batch in group.batches if (t := durations[index]) > 0.0]
        if len(rows) < len(group.batches):
            cache[key] = None
            return None
        if group.kind is GroupKind.MIXED:
            if group.prefill_capacity:
                by_capacity.setdefault(group.prefill_capacity, []).extend(rows)
            if positive and decode_only_beaten(sel, group):
                continue
        by_capacity[0].extend(rows)
    flat = cache[key] = {capacity: BoundRows(rows, max((r[1] for r in rows), default=0.0),
                                             max((r[2] for r in rows), default=0.0),
                                             max((r[3] for r in rows), default=0.0))
                         for capacity, rows in by_capacity.items()}
    return flat


def _first_gains(sel: DecisionRankings, source: str) -> list[float]:
    """``sel.next_gains(source, 1)`` read straight from the kept gains: p * s_1**a per lane with room and
    the source (0 without a first survival), largest first, as prefix sums; one entry per eligible lane,
    so a source no lane may take has none. Without the source's columns, which a decision that bounds
    speculation out never needs otherwise."""
    d = sel.pop.decoders
    if len(d.gains) != len(d):  # gains not kept per request (a hand-built population): the ranking's own
        return sel.next_gains(source, 1)
    first = sorted([p * row[1] if len(row) > 1 else 0.0 for p, g, room in zip(d.token_price, d.gains, d.room)
                    if room >= 1 and (row := g.get(source)) is not None], reverse=True)
    return list(accumulate(first, initial=0.0))


def decode_only_beaten(sel: DecisionRankings, group: Group) -> bool:
    """Whether every program of a mixed ``group`` scores its decoders-only cohort strictly below
    a rectangular program of the same source and width that serves the same lanes, measured faster.

    A member of batch B takes k = min(B, m) of the m eligible decoders. Of the
    rectangular programs holding k rows, U12 keeps those of the smallest batch
    (a larger one serves the same k lanes with more padding, and is dropped
    whatever its speed), so only they can be ahead of the member. Such a
    program takes the same lanes, worth the same (positive) value; over a
    shorter duration that value earns a higher rate and the waiting cost is
    smaller (U6). So where one of them is measured faster, the member's cohort
    never wins or ties (U8): the rectangular program, scored or bounded below
    the best score, is ahead of it. (Until 2026-12-05 the same-batch program
    was read as the one ahead even where it is padding U12 drops: with fewer
    decoders than its batch, the smaller program that serves them may be
    slower than the mixed one.)
    """
    cols = sel.source_columns(group.source)
    if not cols.positive:
        return False
    siblings = sel.infos.siblings.get(group.number)
    if siblings is None:
        return False
    m = len(cols.idx)
    key = (group.number, min(m, max(b for _, b in group.batches)))  # the answer depends on m only up to the largest B
    beaten = sel.derived.beaten.get(key)
    if beaten is None:
        beaten = sel.derived.beaten[key] = all(_member_beaten(sel.t_ms, index, min(batch, m), siblings)
                                                for index, batch in group.batches)
    return beaten


def _member_beaten(durations, index: int, k: int, siblings) -> bool:
    """Whether a rectangular program of the smallest batch holding ``k`` rows is measured faster than ``index``."""
    t = durations[index]
    if t <= 0.0:
        return False
    for batch, others in siblings:
        if batch >= k:
            return any(0.0 < durations[other] < t for other in others)
    return False


def speculation_cannot_reach(sel: DecisionRankings, groups: Sequence[Group], top: float) -> bool:
    """Whether no program of the speculative ``groups`` (every width, rectangular, ragged and prefix-limit)
    can reach ``top``, bounded from the plain width-one ranking alone (``select`` then scores none).

    A lane's value at width w is its token price times its expected tokens, 1 + s_1**a + ... +
    s_(w-1)**a, plus its width-free delivery price and age credit; survival never rises with depth (S5),
    so that is at most its width-one value plus (w - 1) times its next gain p * s_1**a (``next_gains``
    at width one: zero for a lane without the source). Any source's lanes are among the plain ranking's
    (a room of at least one), so the best k lanes of a speculative program are worth at most the best k
    width-one values plus (w - 1) times the k largest next gains, a ragged or prefix-limit program's
    fewer lanes no more than that while every lane adds value. (Bounding each draft by the whole price,
    as if every draft were accepted, let cheap copy rounds through at four streams, where their ranking
    was built in every decision for drafts accepted a tenth of the time.)
    Each program is bounded with its own duration and the age terms of its k lanes (one slope for all);
    one unknown duration scores everything (U8), except where the program cannot have a cohort (no
    decoder eligible for its source) or is padding U12 prunes whatever its score (a smaller member of
    its ranking serves all n decoders: never-run batch-eight programs at four streams). Used only in
    catalogs without mixed programs (nothing is charged a deferred round and no prompt row rides beside
    decoders: ``CatalogInfo.speculation_bounded``).
    """
    plain = sel.decode_ranking(None, 1)
    n = plain.size
    if n == 0:
        return True  # no decoder with room: no speculative program has a lane either
    cols = sel.source_columns(None)
    if not (cols.uniform and cols.positive and cols.slope_prefix[n] >= 0.0):
        return False
    value, slopes, active, durations = plain.ranked.prefix, cols.slope_prefix, sel.pop.active_age_price, sel.t_ms
    ragged_padded_by, infos = sel.infos.ragged_padded_by, sel.infos.graphs
    by_source: dict[str, list[float]] = {}
    for group in groups:
        extra = group.width - 1
        gains = by_source.get(group.source)
        if gains is None:  # prefix sums, largest first; one entry per eligible lane, and 0
            gains = by_source[group.source] = _first_gains(sel, group.source)
        last = len(gains) - 1
        if last == 0:
            continue  # no decoder may take this source's drafts (e.g. its draft cache fell behind): no cohort
        padded_by = group.padded_by or (0,) * len(group.batches)
        for (index, batch), padded in zip(group.batches, padded_by):
            if padded >= n or ragged_padded_by and ragged_padded_by[index] >= n and (
                    n * group.width <= infos[index].capacities[2]) and not infos[index].prefix_limit:
                continue  # padding U12 prunes (``score_rectangular``, ``_score_one_by_one``), measured or not
            t = durations[index]
            if t <= 0.0:
                return False
            k = batch if batch < n else n
            v = value[k] + extra * gains[k if k < last else last]
            bound = (v + slopes[k] * t) / t - 0.5 * t * active
            if bound + BOUND_MARGIN * (v / t + slopes[k] + 0.5 * t * active) >= top:
                return False
    return True
