"""Each listed graph's own best cohort, as ``select`` would build it (funded exploration, D7, D8)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from flare_contract.graphs import GraphDescriptor
from helios.scheduler.select.candidates import CANDIDATES, Candidate, Deferred, Scored
from helios.scheduler.select.catalog import GraphInfo
from helios.scheduler.select.choice import Choice
from helios.scheduler.select.population import Population
from helios.scheduler.select.rankings import DecisionRankings
from helios.scheduler.select.timing import GraphTiming


@dataclass(frozen=True, slots=True)
class Evaluated:
    """One graph's own best cohort, scored; its lanes are built only when its ``Choice`` is asked for."""

    candidate: Candidate

    @property
    def score(self) -> float:
        return self.candidate.score

    def choice(self) -> Choice:
        c = self.candidate
        lanes, prefill_row = c.build()
        return Choice(c.graph, lanes, c.timing, c.score, 0.0, prefill_row)


def evaluate_scores(
    graphs: Sequence[GraphDescriptor],
    timings: Sequence[GraphTiming],
    population: Population,
    infos: Sequence[GraphInfo],
    indices: Sequence[int],
    selection: "DecisionRankings | None" = None,
) -> dict[int, Evaluated]:
    """Each listed graph's own best cohort, as ``select`` would build it, by catalog index.

    Funded exploration (D7, D8) needs the cohort and ordinary value of
    programs that did not win; graphs with nothing to run are left out. Lanes
    are built only by ``Evaluated.choice()``: timing refresh ranks every stale
    program by its score and runs one, so only that one needs its cohort's
    lanes (64 per program at most). The choice's ``log_scale`` is 0: callers
    scale by the winning decision's factor.

    ``selection`` is a ``Choice.selection`` of a decision on the same population:
    its rankings are reused (they depend on the population alone).
    """
    if isinstance(selection, DecisionRankings) and selection.pop is population:
        sel = selection
    else:
        sel = DecisionRankings(population, infos)
    scored = Scored(sel, graphs, timings)
    out = {}
    for index in indices:
        graph = graphs[index]
        make = CANDIDATES.get(graph.kind)
        c = make(sel, index, graph, timings[index]) if make else None
        if isinstance(c, Deferred):
            c = c.make()
        elif c is not None:
            c = scored.candidate(c)
        if c is not None:
            out[index] = Evaluated(c)
    return out
