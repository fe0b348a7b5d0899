"""One decision: score every group, take the fast leader path when it applies, else rank every entry.

Order of a decision (spec "Useful service and selection"):
1. best cohort per graph (U9, U10, U13, P7), optimistic work score when the
   duration is unknown (U8);
2. prefill exploration filter for unmeasured larger prompt graphs (D4);
3. dominance pruning of padded alternatives for the same logical work (U12);
4. unknown beats known, then value, then the tie order (U8).

``select`` takes a columnar snapshot of the runnable population and the
duration knowledge of every prepared graph, and returns the single best
``Choice``. The usual decision -- every candidate measured, one strictly best
and not padding -- is read straight from the flat scores
(:func:`_measured_leader`); anything else goes through the general path,
which reaches the same answer.
"""

from __future__ import annotations

import math
from typing import Sequence

from flare_contract.graphs import GraphDescriptor, GraphKind
from helios.scheduler.select import dominance
from helios.scheduler.select.bounds import decode_only_beaten, score_bounded, speculation_cannot_reach
from helios.scheduler.select.candidates import (SCORERS, Candidate, Deferred, FlatIndex, Scored, built_prefill, decode_lanes,
                                                prefill_candidate, score_group)
from helios.scheduler.select.catalog import CatalogInfo, Group, GroupKind, describe
from helios.scheduler.select.choice import Choice
from helios.scheduler.select.population import Population
from helios.scheduler.select.rankings import DecisionRankings
from helios.scheduler.select.scorers import MISSING, Out, charge_deferred_round, drop_prefill_beside_decoders
from helios.scheduler.select.timing import GraphTiming, durations_ms
from helios.scheduler.utility import decision_log_scale


def select(
    graphs: Sequence[GraphDescriptor],
    timings: Sequence[GraphTiming],
    population: Population,
    described: CatalogInfo | None = None,
    durations: Sequence[float] | None = None,
) -> Choice | None:
    """The best graph and cohort for the population, or None when nothing can run.

    ``described`` is :func:`describe` of ``graphs`` and ``durations`` is
    :func:`durations_ms` of ``timings``; callers planning repeatedly on one
    catalog pass them to skip recomputing them.
    """
    described = described if described is not None else describe(graphs)
    sel = DecisionRankings(population, described)
    sel.t_ms = durations if durations is not None else durations_ms(timings)
    sel.derived = described.per_durations.current(sel.t_ms)
    out = Out(len(graphs))
    skipped = []  # groups whose programs cannot win (the general path scores them)
    charged = False  # whether the deferred round was charged (then every program must be, before ranking)
    if described.speculation_bounded:
        _score_eager(sel, described.eager_plain, graphs, timings, out, skipped)
        top = max(out.scores, default=MISSING)
        if top != MISSING and not out.entries and speculation_cannot_reach(
                sel, (*described.eager_speculative, *described.bounded), top):
            skipped += [*described.eager_speculative, *described.bounded]
        else:
            _score_eager(sel, described.eager_speculative, graphs, timings, out, skipped)
            skipped += score_bounded(sel, described.bounded, graphs, timings, out)
    else:
        _score_eager(sel, described.eager, graphs, timings, out, skipped)
        charged = _charge(sel, graphs, described.groups, out)
        bounded_skipped = score_bounded(sel, described.bounded, graphs, timings, out)
        if charged and described.bounded and not bounded_skipped:
            # the wider groups were scored after the deferred round was charged: score every group
            # eagerly and charge them all alike (skipping them stays right: a charge only lowers a score)
            out, skipped = _eagerly(sel, described, graphs, timings)
        else:
            skipped += bounded_skipped
    fast = _measured_leader(sel, Scored(sel, graphs, timings, FlatIndex(out)), out, skipped)
    if fast is not None:
        return _prompts_join_round(sel, graphs, timings, fast)
    if charged and skipped:  # the general path ranks every program: each scored first, then all charged alike
        out = Out(len(graphs))
        for group in described.groups:
            score_group(sel, group, graphs, timings, out)
        _charge(sel, graphs, described.groups, out)
    else:
        for group in skipped:  # the general path below ranks every program
            score_group(sel, group, graphs, timings, out)
    return _prompts_join_round(sel, graphs, timings, _general(sel, graphs, timings, out))


def _prompts_join_round(sel: DecisionRankings, graphs, timings, choice: Choice | None) -> Choice | None:
    """``PolicyConfig.finishing_prompts_fill_rows``: a measured decode round D gives way to the best
    measured prefill program P (as the prompters' ranking scores each alone) whose prompts would then
    decode beside D's decoders, where the sequence that starts with P earns more per ms.

    Let D' be the round with the new decoders in it: D itself where they fit its idle rows, else the
    smallest measured decode program that holds them all. A prompt U6 defers waits about N rounds,
    N = adaptation time / T_D (prices move on the adaptation time; at least one). Compare D x N, P, D'
    with P, D' x (N + 1). U6's waiting cost and age credits sum alike over both orders where D' is D;
    P first serves the new decoders' lanes (each its first output token's value) N rounds more. The
    decoders wait one T_P either way, but P first adds it to the ages A_i they already have: at the age
    cost U6 integrates (c * A per ms of age, so c * G^2 / 2 over a gap G) that costs sum_i c * A_i * T_P
    more. A chunk that leaves prompt behind stands for the whole prompt (T_P its least prefill time),
    which must fit the adaptation time. U6's value rate reads each program alone and prices P against
    D, not the rows P fills: a prompt whose first chunk made it look served then waits rounds that run
    short (issue 22's closed loops at 4 and 16 streams). Where a mixed program carries a prompt row,
    the prompt rides beside the decoders and this rarely applies (docs/scheduling-utility.md,
    "Departures from the spec", 16).
    """
    if (not sel.pop.prompts_join_rounds or choice is None or choice.graph.kind is not GraphKind.DECODE
            or not choice.timing.known):
        return choice
    p = sel.pop.prompters
    if not p.handle:
        return choice
    best = None  # the best measured prefill program, as the prompters' own ranking would pick it
    for index in sel.infos.prefill_graphs:
        graph, timing = graphs[index], timings[index]
        if timing.known and (entry := prefill_candidate(sel, index, graph, timing)) is not None:
            if best is None or entry[0][1] > best[0][1]:
                best = entry
    if best is None:
        return choice
    (_, value), index, prompts = best
    graph, timing = graphs[index], timings[index]
    rows = prompts.ranked.order[:prompts.served(graph)]
    # each row's prompt must then decode (a cut prompt, or one with no output room, does not)
    if not all(p.first_token[i] > 0.0 for i in rows):
        return choice
    t_d = choice.timing.duration_ns / 1e6
    after = _round_holding(graphs, timings, len(choice.lanes) + len(rows), choice)
    if after is None:
        return choice
    t_after = after.duration_ns / 1e6
    # the time to finish the rows' prompts: this program's if it finishes them, else the least time to
    # prefill what is left; a prompt that takes longer than the adaptation time is not one the next
    # rounds lose
    t_ms = timing.duration_ns / 1e6
    t_fin = max(t_ms if prompts.tokens[i] == p.remaining[i] else (
        p.times.ms(p.remaining[i]) if p.times is not None else math.inf) for i in rows)
    horizon = sel.pop.adaptation_ms
    if t_fin > max(horizon, t_ms):
        return choice
    d = sel.pop.decoders
    # sum of c * A_i over the decoders (A_i = age credit / age slope; an unmeasured slope reads A = 0)
    aged = sel.pop.age_price * sum(credit / slope for credit, slope in zip(d.age_credit, d.age_slope) if slope > 0.0)
    n = max(1.0, horizon / t_d)
    v_d = choice.score * t_d
    v_after = v_d + sum(p.first_token[i] for i in rows)
    v_p = value * t_fin
    deferred = (n * v_d + v_p + v_after) / (n * t_d + t_fin + t_after)
    first = (v_p + (n + 1.0) * v_after - aged * t_fin) / (t_fin + (n + 1.0) * t_after)
    if first <= deferred:
        return choice
    lanes, prefill_row = built_prefill(sel, index, graph, timing, value, prompts).build()
    return Choice(graph, lanes, timing, value, decision_log_scale(abs(value)), prefill_row, sel)


def _round_holding(graphs, timings, rows: int, current: Choice) -> GraphTiming | None:
    """The timing of the decode round after the prefill: ``current``'s where ``rows`` fit it, else the
    smallest measured decode program holding them (the fastest of equal batches); None if none does."""
    if rows <= current.graph.batch_capacity:
        return current.timing
    found = None
    for graph, timing in zip(graphs, timings):
        if graph.kind is GraphKind.DECODE and timing.known and graph.batch_capacity >= rows:
            key = (graph.batch_capacity, timing.duration_ns)
            if found is None or key < found[0]:
                found = key, timing
    return None if found is None else found[1]


def _eagerly(sel: DecisionRankings, described: CatalogInfo, graphs, timings) -> tuple[Out, list]:
    """Every group scored eagerly and charged: what ``select`` decides without bounding wider widths."""
    out, skipped = Out(len(graphs)), []
    _score_eager(sel, described.groups, graphs, timings, out, skipped)
    _charge(sel, graphs, described.groups, out)
    return out, skipped


def _charge(sel: DecisionRankings, graphs, groups, out: Out) -> bool:
    """The deferred round and the prefill-beside-decoders drop over the scored programs, read against
    ``groups``; whether the deferred round was charged."""
    # charged only where a mixed program may carry a prompt row (``charge_deferred_round`` does nothing else)
    charged = bool(sel.pop.defers_decode and sel.pop.decoders.handle and sel.infos.carries_prompts)
    if charged:  # before the drop: the deferred round reads the best prefill-only frame
        charge_deferred_round(sel, graphs, groups, out)
    if sel.pop.prompts_beside_decoders and sel.pop.decoders.handle and sel.pop.prompters.handle:
        drop_prefill_beside_decoders(sel, graphs, groups, (), out)  # prefill programs only: all are eager
    return charged


def _score_eager(sel: DecisionRankings, groups, graphs, timings, out: Out, skipped: list) -> None:
    for group in groups:
        kind = group.kind
        # a mixed group with no prompt row to carry, whose decoders run faster elsewhere, cannot win
        if kind is GroupKind.MIXED and decode_only_beaten(sel, group) and not (
                group.prefill_capacity and sel.pop.prompters.handle):
            skipped.append(group)
            continue
        SCORERS[kind](sel, group, graphs, timings, out)


def _general(sel: DecisionRankings, graphs, timings, out: Out) -> Choice | None:
    """Rank every entry: D4's filter, deferred searches, U12 pruning, then the tie order (U8)."""
    described = sel.infos
    scored = Scored(sel, graphs, timings)
    found = out.all_entries()
    # catalog order: ties keep it (U8)
    scored.add_all([c for c in found if type(c) is tuple])
    deferred = [c for c in found if type(c) is Deferred]
    # D4 reads unmeasured prefill programs only
    for entry in [e for i in described.prefill_graphs if type(e := found[i]) is tuple and e[0][0]]:
        if _explores_redundantly(scored.candidate(entry), sel, described.prefill_sizes):
            scored.drop(entry[1])
    _add_deferred(scored, deferred)
    tied = [scored.candidate(e) for e in scored.best_undominated()]
    if not tied:
        return None
    if len(tied) > 1:
        for c in tied:
            c.recency = _recency(c, sel)
    best = max(tied, key=Candidate.tie_key)
    lanes, prefill_row = best.build()
    return Choice(best.graph, lanes, best.timing, best.score, decision_log_scale(abs(best.score)), prefill_row, sel)


def _measured_leader(sel: DecisionRankings, scored: Scored, out: Out, skipped: Sequence[Group]) -> Choice | None:
    """The usual decision, read from the flat scores: every candidate measured and rectangular,
    mixed or prefill, and one program strictly best and not padding (U12). None otherwise,
    and then ``select`` ranks every entry as it always has. ``scored`` reads its entries
    from ``out`` (``FlatIndex``); only the pruning check looks any up.

    With a single best score there is no tie to break (U8), no deferred program
    to consult and no unmeasured prefill for D4, so the entry ``select`` would
    pick is the one at that score. Programs of ``skipped`` groups score below it
    (``bounds.score_bounded``); if one of them could prune it as padding, this
    declines too, and ``select`` scores them all.

    Entries beside the flat scores (a ragged program's exact cohort, a
    prefix-limit program's deferred search) leave the answer alone when each
    is measured, ranks (or is bounded) strictly below the leader and cannot
    prune it: the general path's deferred search stops at a bound below the
    best undominated entry (``_add_deferred``). At one stream these entries are
    in every decision of a speculating server.
    """
    scores = out.scores
    top = max(scores, default=MISSING)
    if top == MISSING or scores.count(top) != 1:
        return None
    index = scores.index(top)
    infos, payloads, graphs = sel.infos, out.payloads, scored.graphs
    if out.entries:
        dominators = infos.same_depth_dominators[index]
        for other, entry in out.entries.items():
            unknown, value = entry.bound if type(entry) is Deferred else entry[0]
            if unknown or value >= top or other in dominators:
                return None
    if skipped and dominance.skipped_may_dominate(infos, index, skipped):
        return None
    entry = (False, top), index, payloads[index]
    if dominance.flat_may_be_dominated(infos, graphs, payloads, index) and dominance.is_dominated(scored, entry):
        return None
    graph, log_scale = graphs[index], decision_log_scale(abs(top))
    if graph.kind in _RECTANGULAR_KINDS:  # what built_generation's candidate would build: its lanes
        r = payloads[index]  # a DecodeRanking: the best min(B, n) of its decoders
        lanes = tuple(decode_lanes(sel, r, r.decoders_served(graph)))
        return Choice(graph, lanes, scored.timings[index], top, log_scale, None, sel)
    best = scored.candidate(entry)
    lanes, prefill_row = best.build()
    return Choice(best.graph, lanes, best.timing, best.score, log_scale, prefill_row, sel)


_RECTANGULAR_KINDS = (GraphKind.DECODE, GraphKind.SPECULATIVE)  # their flat cohorts are the best min(B, n) decoders


def _explores_redundantly(c: Candidate, sel: DecisionRankings, prefill_sizes: Sequence[int]) -> bool:
    """D4: an unmeasured prefill graph is skipped when a smaller capacity reaches the same endpoint."""
    if c.timing.known or c.graph.kind is not GraphKind.PREFILL:
        return False
    lanes, _ = c.build()
    p = sel.pop.prompters
    slot_to_index = {h.slot: i for i, h in enumerate(p.handle)}
    capacity = c.graph.prefill_capacity
    reach = max(min(capacity, p.to_endpoint[slot_to_index[lane.handle.slot]]) for lane in lanes)
    return any(reach <= size < capacity for size in prefill_sizes)


def _recency(c: Candidate, sel: DecisionRankings) -> int:
    by_slot = {}
    for cols in (sel.pop.decoders, sel.pop.prompters, *(() if sel.pop.scored is None else (sel.pop.scored,))):
        for h, r in zip(cols.handle, cols.recency):
            by_slot[h.slot] = r
    lanes, _ = c.build()
    return max((by_slot[lane.handle.slot] for lane in lanes), default=0)


def _add_deferred(scored: Scored, deferred: Sequence[Deferred]) -> None:
    """Evaluate expensive candidates best bound first, skipping those that cannot win.

    A bound strictly below the best *undominated* candidate in hand cannot win.
    The comparison is always against the undominated best: a candidate just
    built may score highest and still be pruned as padding (U12), and a bound
    compared with it would skip a program that wins once it is pruned.
    (A skipped shape could in principle have dominated that candidate with the
    same logical work at a longer measured duration; that corner is accepted.)
    """
    leaders = scored.best_undominated()
    best = leaders[0][0] if leaders else None
    for d in sorted(deferred, key=lambda d: d.bound, reverse=True):
        if best is not None and d.bound < best:
            break
        c = d.make()
        if c is not None:
            scored.add_built(c)
            leaders = scored.best_undominated()
            best = leaders[0][0] if leaders else None
