"""Dominance pruning (U12): a padded shape loses to a smaller one doing the same logical work.

Every U12 site of selection is here: which shapes can dominate which (a
catalog property, :func:`dominator_table`), the full check on scored entries
(:func:`is_dominated`, which builds logical keys only when a cheap necessary
condition holds), the best undominated entries (:func:`undominated_leaders`),
and the fast leader path's checks on flat cohorts (:func:`flat_may_be_dominated`,
:func:`skipped_may_dominate`).

A candidate's logical key names what it does independently of its physical
shape: the kind, the proposal depth, and the served lanes with their query
lengths (or prompt tokens). Two shapes with equal keys do the same work; the
one whose capacities are all no larger, and not all equal, prunes the other.
"""

from __future__ import annotations

from operator import itemgetter
from typing import TYPE_CHECKING, Sequence

from flare_contract.graphs import GraphDescriptor

if TYPE_CHECKING:
    from helios.scheduler.select.candidates import Scored
    from helios.scheduler.select.catalog import CatalogInfo, Group
    from helios.scheduler.select.scorers import Cohort


def dominates(small: tuple[int, ...], large: tuple[int, ...]) -> bool:
    """Capacities (B, W, P, prompt capacity) all no larger and not all equal."""
    return small != large and all(a <= b for a, b in zip(small, large))


def dominator_table(graphs: Sequence[GraphDescriptor], capacities: Sequence[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """Per graph, the graphs of its kind that dominate its capacities: the only shapes that can prune it."""
    return tuple(
        tuple(j for j, o in enumerate(graphs) if o.kind is g.kind and dominates(capacities[j], capacities[i]))
        for i, g in enumerate(graphs)
    )


def is_dominated(scored: "Scored", entry: tuple) -> bool:
    """U12: another shape of the same kind does the same logical work with no larger capacity."""
    graphs, by_index = scored.graphs, scored.by_index
    served, depth, key = scored.served(entry), graphs[entry[1]].proposal_depth, None
    for other in scored.sel.infos.dominators[entry[1]]:
        found = by_index.get(other)
        # every logical key names its served lanes, and generation keys the depth:
        # a cheap necessary condition before any candidate or key is built
        if found is None or scored.served(found) != served or graphs[other].proposal_depth != depth:
            continue
        key = scored.candidate(entry).logical_key() if key is None else key
        if scored.candidate(found).logical_key() == key:
            return True
    return False


def undominated_leaders(scored: "Scored") -> list[tuple]:
    """Every entry tied at the best rank among those no padded alternative dominates.

    Pruning only ever removes candidates, so it is enough to test the best
    ones in rank order (usually the first rank level holds the answer); the
    logical keys of the rest are never built.
    """
    entries = scored.entries
    if not entries:
        return []
    top = max(map(_rank_of, entries))
    tied = [e for e in entries if e[0] == top and not is_dominated(scored, e)]
    if tied:
        return tied
    for e in sorted(entries, key=_rank_of, reverse=True):
        if tied and e[0] < tied[0][0]:
            break
        if not is_dominated(scored, e):
            tied.append(e)
    return tied


_rank_of = itemgetter(0)  # an entry's rank key


def flat_may_be_dominated(infos: "CatalogInfo", graphs: Sequence[GraphDescriptor],
                          payloads: Sequence["Cohort | None"], index: int) -> bool:
    """``is_dominated``'s first test on the flat cohorts of measured programs: whether any dominator
    of ``index``'s depth serves as many lanes and, for a single prompt row, could give it as many tokens."""
    graph, cohort = graphs[index], payloads[index]
    served, prompt_tokens = cohort.served(graph), cohort.prompt_tokens(graph)
    return any(payloads[other] is not None and payloads[other].served(graphs[other]) == served
               and prompt_tokens <= graphs[other].prefill_capacity for other in infos.same_depth_dominators[index])


def skipped_may_dominate(infos: "CatalogInfo", index: int, skipped: Sequence["Group"]) -> bool:
    """Whether a program of a group left unscored could prune ``index`` as padding (same depth)."""
    numbers = {group.number for group in skipped}
    group_of = infos.group_of
    return any(group_of[other] is not None and group_of[other].number in numbers
               for other in infos.same_depth_dominators[index])
