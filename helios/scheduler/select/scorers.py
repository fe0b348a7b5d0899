"""Scores (U6, U8) and the group scorers of measured rectangular, prefill and mixed programs.

The selection objective of a graph of known duration T is its value rate
(U6, ``utility.value_rate``): (served value + c*sigma*T) / T minus the
waiting cost T/2 times the active age price. ``rate`` is the one place
selection writes that arithmetic out (the same operations in the same order
as ``value_rate``, without its argument check, for the hot loops); a graph
whose duration is unknown scores its optimistic work instead (U8, ``score``).

The group scorers read one group's shared rankings (U9) and write every
member's score to ``Out``: a measured program's score and cohort (the
ranking it reads, or a ``PromptRow``) go to two flat lists by catalog
position, anything else as a full entry.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from flare_contract.graphs import GraphDescriptor
from helios.scheduler.select.rankings import DecodeRanking, PromptRanking, PromptRow, DecisionRankings
from helios.scheduler.select.timing import GraphTiming
from helios.scheduler.utility import optimistic_work_score

from helios.scheduler.select.catalog import GroupKind

if TYPE_CHECKING:
    from helios.scheduler.select.catalog import Group

MISSING = -math.inf  # ``Out.scores`` of a graph with no measured candidate (scores are finite)

Cohort = DecodeRanking | PromptRanking | PromptRow
"""Which lanes a measured program's score stands for (``rankings.py``)."""


def rate(value: float, slope: float, t_ms: float, active: float) -> float:
    """U6: ``value_rate(value + slope * t_ms, t_ms, active)`` for t_ms > 0, with the same floats."""
    return (value + slope * t_ms) / t_ms - 0.5 * t_ms * active


def score(value: float, slope: float, timing: GraphTiming, active: float) -> float:
    """A cohort's score: its value rate when the duration is known (U6), else its optimistic work (U8)."""
    if not timing.known:
        return optimistic_work_score(value)
    return rate(value, slope, timing.duration_ns / 1e6, active)


class Out:
    """Where the group scorers write a decision's candidates.

    A measured program's score and cohort go to two flat lists indexed by
    catalog position (no per-program rank tuple: the leader is then found by
    ``max``, ``count`` and ``index`` over plain floats); anything else -- an
    unknown duration's entry, a deferred candidate, a ragged or prefix-limit
    program's own result -- goes to ``entries`` as the full entry it is:
    ``(rank key, catalog index, payload)``, where the rank key is
    (unknown duration, score) and the payload a cohort or a built candidate.
    """

    __slots__ = ("scores", "payloads", "entries")

    def __init__(self, size: int) -> None:
        self.scores: list[float] = [MISSING] * size
        self.payloads: list[Cohort | None] = [None] * size  # see ``Cohort``
        self.entries: dict[int, object] = {}

    def put(self, index: int, known: bool, value: float, payload: "Cohort") -> None:
        if known:
            self.scores[index] = value
            self.payloads[index] = payload
        else:
            self.entries[index] = (True, value), index, payload

    def add(self, entry) -> None:
        if entry is not None:
            self.entries[entry[1]] = entry

    def entry(self, index: int):
        """The ``(rank key, index, payload)`` entry of a graph, or None (or a ``Deferred``)."""
        value = self.scores[index]
        if value != MISSING:
            return (False, value), index, self.payloads[index]
        return self.entries.get(index)

    def all_entries(self) -> list:
        """Every graph's entry in catalog order (deferred candidates included)."""
        return [self.entry(index) for index in range(len(self.scores))]


def score_rectangular(sel: DecisionRankings, group: "Group", graphs, timings, out: Out) -> None:
    """Rectangular decode and speculative programs of one width: the best B lanes of one ranking (U9).

    The hottest loop of a decision, so it reads the shared prefix sums directly:
    an unknown duration scores its optimistic work (U8), a known one its value
    rate (U6). A member that a smaller member of the group pads out (U12: both
    serve all n decoders, ``Group.padded_by``) is not written at all: the
    pruning would remove it anyway, and an unmeasured one left in would send
    every decision down the general path to be pruned there again (at one
    stream, every larger batch capacity of every width, for the whole run).
    """
    untimed = sel.decode_ranking(group.source, group.width)
    n = untimed.size
    if n == 0:
        return
    active = sel.pop.active_age_price
    prefix, slopes, uniform, durations = untimed.ranked.prefix, untimed.slope_prefix, untimed.uniform_slope, sel.t_ms
    scores, payloads = out.scores, out.payloads
    padded_by = group.padded_by or (0,) * len(group.batches)
    for (index, batch), padded in zip(group.batches, padded_by):
        if padded >= n:
            continue  # U12: a member of batch ``padded`` >= n does the same work in a smaller shape
        t = durations[index]
        k = batch if batch < n else n
        if t <= 0.0:
            out.entries[index] = (True, prefix[k]), index, untimed
        elif uniform:
            scores[index] = rate(prefix[k], slopes[k], t, active)
            payloads[index] = untimed
        else:
            timing = timings[index]
            r = sel.decode_ranking(group.source, group.width, timing)
            scores[index] = score(r.ranked.prefix[k], r.slope_prefix[k], timing, active)
            payloads[index] = r


def score_prefill(sel: DecisionRankings, group: "Group", graphs, timings, out: Out) -> None:
    """Every prefill program: the best B prompters of its capacity (U13), no age term.

    An unmeasured one is left out where D4 would drop it whichever prompters it took: no waiting prompt
    reaches further than a smaller prefill capacity (the longest distance to an endpoint, capped at its
    capacity, fits in one). Never run, such programs (``prefill_p1024`` beside prompts of 128 tokens)
    stayed entries of every decision while a prompt waited, each sending it down the general path.
    """
    prompters = sel.pop.prompters
    if not prompters.handle:
        return
    active, durations, sizes = sel.pop.active_age_price, sel.t_ms, sel.infos.prefill_sizes
    furthest = max(prompters.to_endpoint)
    for index, batch in group.batches:
        capacity = graphs[index].prefill_capacity
        prompts = sel.prompt_ranking(capacity)
        ranked = prompts.ranked
        n = len(ranked.values)
        k = batch if batch < n else n
        if k:
            t = durations[index]
            if t > 0.0:
                out.scores[index] = rate(ranked.top() if k == 1 else ranked.prefix[k], 0.0, t, active)
                out.payloads[index] = prompts
            else:
                reach = furthest if furthest < capacity else capacity
                if any(reach <= size < capacity for size in sizes):
                    continue  # D4 (``leader._explores_redundantly``) drops it for any cohort
                out.entries[index] = (True, ranked.prefix[k]), index, prompts


def score_mixed(sel: DecisionRankings, group: "Group", graphs, timings, out: Out) -> None:
    """Mixed programs of one prompt capacity and width (P7): written out below when every lane
    shares one age slope (the usual case); otherwise a known duration needs its own ranking."""
    untimed = sel.decode_ranking(group.source, group.width)
    prompts = sel.prompt_ranking(group.prefill_capacity)
    if not untimed.uniform_slope:
        for index in group.members:
            out.add(mixed_entry(sel, index, graphs[index], timings[index], untimed, prompts))
        return
    ranked = prompts.ranked
    has_row = len(ranked) > 0 and group.prefill_capacity > 0
    row_value = ranked.top() if has_row else 0.0
    # a row worth >= 0 beside the same decoders scores at least as much: x + y >= x for y >= 0 in
    # floating point too, and every later step of ``rate`` is monotone, so it wins or ties (and wins)
    row_adds = has_row and row_value >= 0.0
    with_row = PromptRow(untimed, prompts, ranked.first()) if has_row else None
    prefix, slopes, n = untimed.ranked.prefix, untimed.slope_prefix, untimed.size
    active, durations = sel.pop.active_age_price, sel.t_ms
    scores, payloads = out.scores, out.payloads
    # Per program, the best prompt row with the best B - 1 decoders, then the decode-only cohort,
    # which must beat it strictly (on a tie the row wins).
    for index, batch in group.batches:
        t = durations[index]
        known = t > 0.0
        k = batch if batch < n else n
        best = None
        if has_row:
            k2 = batch - 1 if batch - 1 < n else n
            value = row_value + prefix[k2]
            best, cohort = rate(value, slopes[k2], t, active) if known else value, with_row
        if k and not (row_adds and k2 == k):
            alone = rate(prefix[k], slopes[k], t, active) if known else prefix[k]
            if best is None or alone > best:
                best, cohort = alone, untimed
        if best is None:
            continue
        if known:
            scores[index] = best
            payloads[index] = cohort
        else:
            out.entries[index] = (True, best), index, cohort


def mixed_entry(sel: DecisionRankings, index: int, graph: GraphDescriptor, timing: GraphTiming,
                 untimed: DecodeRanking, prompts: PromptRanking):
    """``candidates.mixed_candidate`` from rankings already in hand (shared by every mixed graph of one group)."""
    r = untimed if untimed.uniform_slope or not timing.known else sel.decode_ranking(
        sel.infos[index].source, sel.infos[index].width, timing)
    active = sel.pop.active_age_price
    prefix, slopes, n = r.ranked.prefix, r.slope_prefix, r.size
    best, row = None, None  # the best score, and its prompt row (None: decoders only)
    k = min(graph.batch_capacity, n)
    if k:
        best = score(prefix[k], slopes[k], timing, active)
    ranked = prompts.ranked
    if len(ranked) and graph.prefill_capacity:
        k2 = min(graph.batch_capacity - 1, n)
        with_row = score(ranked.top() + prefix[k2], slopes[k2], timing, active)
        if best is None or with_row >= best:  # on a tie the prompt row wins
            best, row = with_row, ranked.first()
    if best is None:
        return None
    return (not timing.known, best), index, r if row is None else PromptRow(r, prompts, row)



def charge_deferred_round(sel: DecisionRankings, graphs, groups, out: Out) -> None:
    """Score each measured program at most as itself followed by the frames of the work it leaves waiting.

    ``PolicyConfig.prefill_defers_decode`` (docs/scheduling-utility.md, "The deferred round"): a
    program that serves k of the n decoders (none for a prefill) leaves n - k waiting, and they still
    take a plain decode round of their own (the fastest measured one holding them); a program with
    no prompt row leaves the prompts waiting, and the best measured prefill-only candidate of this
    decision runs later. Its score is the lower of its own U6 rate and the rate of that sequence,
    ``(N + N_rest) / (T + T_rest)`` minus the waiting cost over ``T + T_rest`` (N: a U6 numerator; the
    left-out decoders' age credits at ``T + T_rest``). The order of U6 between a program and the work
    it defers is kept (the sequence's rate lies between the two); a mixed program that does both in
    less time than the two frames, or one full batch instead of two partial ones, wins. Applied only
    where the catalog has a mixed program with a prompt row (P7): without one nothing merges, and the
    charge would only favour longer prefill chunks. Only measured candidates are touched; unknown
    durations keep U8's optimistic work.
    """
    if not any(group.kind is GroupKind.MIXED and group.prefill_capacity for group in groups):
        return  # nothing can carry a chunk beside decoders: the pair would only reorder prefill sizes
    plain = sel.decode_ranking(None, 1)
    n = plain.size
    if n == 0:
        return
    rest_ms = _rest_round_ms(sel, groups, n)
    prefix, slopes = plain.ranked.prefix, plain.slope_prefix
    scores, payloads, durations, active = out.scores, out.payloads, sel.t_ms, sel.pop.active_age_price
    prompt_n, prompt_t = _best_prompt_frame(sel, groups, out)
    charged = []
    for index, own in enumerate(scores):
        if own == MISSING:
            continue
        payload = payloads[index]
        served = payload.decoders_served(graphs[index]) if hasattr(payload, "decoders_served") else 0
        t = durations[index]
        numerator, total = (own + 0.5 * t * active) * t, t
        if served < n and rest_ms[n - served] > 0.0:
            t_rest = rest_ms[n - served]
            total += t_rest
            numerator += prefix[n] - prefix[served]
            late_slope = slopes[n] - slopes[served]
        else:
            late_slope = 0.0
        if prompt_t > 0.0 and type(payload) is DecodeRanking:  # no prompt row: the prompt's frame comes after
            numerator += prompt_n
            total += prompt_t
        if total == t:
            continue
        pair = rate(numerator + late_slope * total, 0.0, total, active)
        if pair < own:
            charged.append((index, pair))
    for index, pair in charged:
        scores[index] = pair


def drop_prefill_beside_decoders(sel: DecisionRankings, graphs, eager, bounded, out: Out) -> None:
    """With decoders active, no measured prefill-only program that a mixed prompt row could stand in for.

    ``PolicyConfig.prompts_beside_decoders`` (docs/scheduling-utility.md, "Departures from the spec"):
    a prefill-only frame makes every active decoder wait its whole duration and then its own round,
    while a mixed program carries a chunk of the same prompt beside them. U6's rate prefers the
    prefill whenever a newcomer's prompt is worth much more per ms than the decoders' round (with few
    decoders, nearly always), and each such frame is a gap of prefill plus round for every stream.
    Here a measured prefill-only program is no candidate when a measured mixed program with a prompt
    row holds at least half its prompt capacity (so a catalog whose mixed rows are small still
    prefills long prompts in programs of their own, instead of crawling). Unknown durations keep U8's
    optimistic work (discovery is untouched).
    """
    durations = sel.t_ms
    carry = 0
    for group in (*eager, *bounded):
        if group.kind is GroupKind.MIXED and group.prefill_capacity > carry:
            if any(durations[index] > 0.0 for index in group.members):
                carry = group.prefill_capacity
    if carry == 0:
        return
    scores = out.scores
    for group in eager:
        if group.kind is GroupKind.PREFILL:
            for index in group.members:
                if scores[index] != MISSING and graphs[index].prefill_capacity <= 2 * carry:
                    scores[index] = MISSING
                    out.payloads[index] = None


def _best_prompt_frame(sel: DecisionRankings, groups, out: Out) -> tuple[float, float]:
    """The U6 numerator and duration of the best measured prefill-only candidate (0.0 duration: none)."""
    best, best_t = MISSING, 0.0
    scores, durations, active = out.scores, sel.t_ms, sel.pop.active_age_price
    for group in groups:
        if group.kind is GroupKind.PREFILL:
            for index in group.members:
                if scores[index] > best:
                    best, best_t = scores[index], durations[index]
    if best == MISSING:
        return 0.0, 0.0
    return (best + 0.5 * best_t * active) * best_t, best_t


def _rest_round_ms(sel: DecisionRankings, groups, n: int) -> list[float]:
    """Per count m <= n: the fastest measured plain decode program holding m rows (0.0: none)."""
    best = [0.0] * (n + 1)
    durations = sel.t_ms
    for group in groups:
        if group.kind is not GroupKind.RECTANGULAR or group.source is not None or group.width != 1:
            continue
        for index, batch in group.batches:
            t = durations[index]
            if t <= 0.0:
                continue
            for m in range(1, min(batch, n) + 1):
                if best[m] == 0.0 or t < best[m]:
                    best[m] = t
    return best
