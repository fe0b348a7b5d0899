"""What selection derives from the catalog alone, once per catalog (:func:`describe`).

Per graph its pricing source and logical width; the U12 dominator table
(``dominance.py``); and the groups of graphs that read the same rankings and
are scored together (U9), split into those always scored and the wider
speculative ones scored only when a bound says they can win (``bounds.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Sequence

from flare_contract.graphs import GENERATION_KINDS, GraphDescriptor, GraphKind
from helios.scheduler.select.dominance import dominator_table


class GroupKind(Enum):
    """How a group's members are scored (``candidates.score_group``)."""

    RECTANGULAR = "rectangular"  # decode and speculative, device rows = B * W: the best B of one ranking
    PREFILL = "prefill"  # every prefill program: the best B prompters of its capacity
    MIXED = "mixed"  # one prompt row beside decoders, or decoders only (P7)
    ONE_BY_ONE = "one_by_one"  # ragged, prefix-limit and scored-prefill programs: their own candidate searches

    # members are singletons: hash them by identity, in C (``Enum.__hash__`` is Python code, and
    # every decision looks each group's scorer up by its kind)
    __hash__ = object.__hash__

    @property
    def boundable(self) -> bool:
        """Whether wider widths of this kind may be skipped by a bound (``bounds.py``)."""
        return self is GroupKind.RECTANGULAR or self is GroupKind.MIXED


@dataclass(frozen=True, slots=True)
class GraphInfo:
    """What selection derives from a descriptor alone; built once per catalog."""

    source: str | None  # proposal source pricing its rows; None for width-one rows
    width: int  # logical width: min(W, D + 1) for rows that draw proposals, else 1
    prefix_limit: bool  # the device allocates its rows within P (S2)
    capacities: tuple[int, int, int, int]  # (B, W, P, prompt capacity) for dominance (U12)


@dataclass(frozen=True, slots=True)
class Group:
    """Graphs whose candidates read the same rankings: one logical width and source, one prompt capacity.

    Every member is scored from those shared rankings; only the batch capacity
    (and the duration) differs between members (U9).
    """

    kind: GroupKind
    source: str | None
    width: int
    prefill_capacity: int
    members: tuple[int, ...]
    batches: tuple[tuple[int, int], ...] = ()  # (member, its batch capacity)
    number: int = 0  # position in ``CatalogInfo.groups``: the key of per-group caches
    # per ``batches`` entry of a rectangular group: the largest batch capacity among the members that prune
    # it as padding when both serve every decoder (U12: same kind and depth, capacities no larger), 0 if none
    padded_by: tuple[int, ...] = ()


@dataclass(slots=True)
class PerDurations:
    """What bounds derive from one durations list (``select``'s ``durations``), kept while it stands.

    The list is never mutated once handed out (``CatalogTiming`` builds a new one
    when a duration changes), so its identity says whether these still hold.

    ``beaten``: (group number, eligible decoders up to its largest batch) -> ``bounds.decode_only_beaten``;
    ``bound_rows``: (source, w0, positive) -> ``bounds.flat_bound_rows`` (None: a duration unknown).
    """

    durations: Sequence[float] | None = None
    beaten: dict[tuple[int, int], bool] = field(default_factory=dict)
    bound_rows: dict[tuple, object] = field(default_factory=dict)

    def current(self, durations: Sequence[float]) -> "PerDurations":
        """These caches for ``durations``, emptied first if they were derived from another list."""
        if durations is not self.durations:  # the core hands out a new list whenever a value changes
            self.durations = durations
            self.beaten = {}
            self.bound_rows = {}
        return self


@dataclass(frozen=True, slots=True)
class BoundedSource:
    """One proposal source's bounded groups and the narrowest width among them."""

    source: str
    first_width: int
    groups: tuple[Group, ...]


@dataclass(frozen=True, slots=True)
class CatalogInfo:
    """What selection derives from the catalog alone, built once per catalog (:func:`describe`).

    ``dominators[i]`` lists the graphs of graph i's kind whose capacities are
    all no larger and not all equal: the only shapes that can prune graph i as
    padding (U12) when they do the same logical work. It does not depend on
    requests, so it is never recomputed per decision.
    """

    graphs: tuple[GraphInfo, ...]
    dominators: tuple[tuple[int, ...], ...]
    prefill_sizes: tuple[int, ...]  # prompt capacities of the prefill graphs (D4)
    groups: tuple[Group, ...] = ()  # graphs that share their rankings, scored together
    prefill_graphs: tuple[int, ...] = ()  # catalog indices of the prefill graphs
    # ``groups`` split for ``select``: ``bounded`` are the rectangular and mixed groups of each
    # proposal source beyond its narrowest logical width, by source then width; ``eager`` the rest
    eager: tuple[Group, ...] = ()
    bounded: tuple[Group, ...] = ()
    group_of: tuple[Group | None, ...] = ()  # per graph: its group (None for graphs no group scores)
    same_depth_dominators: tuple[tuple[int, ...], ...] = ()  # ``dominators`` of the graph's proposal depth
    # number of a mixed group -> the rectangular programs of its source and width, by batch (ascending)
    siblings: dict[int, tuple[tuple[int, tuple[int, ...]], ...]] = field(default_factory=dict, compare=False,
                                                                          repr=False)
    bounded_sources: tuple[BoundedSource, ...] = ()
    # ``eager`` split for ``select`` where ``speculation_bounded``: the speculative groups (rectangular, ragged
    # and prefix-limit programs that draw proposals) and the rest; only in catalogs without mixed programs
    eager_plain: tuple[Group, ...] = ()
    eager_speculative: tuple[Group, ...] = ()
    speculation_bounded: bool = False
    carries_prompts: bool = False  # some mixed group has a prompt row (the deferred round can be charged)
    # per graph, for ragged (query-length) and prefix-limit programs: the largest batch capacity of a
    # rectangular program of the same source, logical width, kind and depth that prunes it as padding where
    # both serve all n decoders at full width (``candidates._score_one_by_one``); 0 for every other graph
    ragged_padded_by: tuple[int, ...] = ()
    per_durations: PerDurations = field(default_factory=PerDurations, compare=False, repr=False)

    def __getitem__(self, index: int) -> GraphInfo:
        return self.graphs[index]

    def __len__(self) -> int:
        return len(self.graphs)

    def __iter__(self):
        return iter(self.graphs)


def describe(graphs: Sequence[GraphDescriptor]) -> CatalogInfo:
    infos = tuple(
        GraphInfo(
            _proposal_source(g),
            _logical_width(g),
            g.is_prefix_limit,
            (g.batch_capacity, g.width, g.target_rows, g.prefill_capacity),
        )
        for g in graphs
    )
    dominators = dominator_table(graphs, [info.capacities for info in infos])
    same_depth = tuple(tuple(j for j in found if graphs[j].proposal_depth == graphs[i].proposal_depth)
                       for i, found in enumerate(dominators))
    groups = _with_padding(_groups(graphs, infos), same_depth)
    eager, bounded = _split_groups(groups)
    speculative = tuple(g for g in eager if _draws(g))
    group_of: list[Group | None] = [None] * len(graphs)
    for group in groups:
        for index in group.members:
            group_of[index] = group
    return CatalogInfo(
        infos, dominators,
        prefill_sizes=tuple(g.prefill_capacity for g in graphs if g.kind is GraphKind.PREFILL),
        groups=groups,
        prefill_graphs=tuple(i for i, g in enumerate(graphs) if g.kind is GraphKind.PREFILL),
        eager=eager, bounded=bounded, group_of=tuple(group_of),
        bounded_sources=_bounded_sources(bounded),
        eager_plain=tuple(g for g in eager if not _draws(g)), eager_speculative=speculative,
        speculation_bounded=bool(speculative or bounded) and not any(g.kind is GroupKind.MIXED for g in groups),
        carries_prompts=any(g.kind is GroupKind.MIXED and g.prefill_capacity for g in groups),
        same_depth_dominators=same_depth,
        ragged_padded_by=_ragged_padding(graphs, infos, same_depth, group_of),
        siblings=_siblings(groups),
    )


def _with_padding(groups: Sequence[Group], same_depth: Sequence[tuple[int, ...]]) -> tuple[Group, ...]:
    """Each rectangular group's ``padded_by``: a member whose dominator in the group has a batch of at
    least n decoders serves the same n lanes with the same query lengths as that dominator (both take all
    n), so U12 prunes it whatever its score (``scorers.score_rectangular`` leaves it out)."""
    found = []
    for group in groups:
        if group.kind is GroupKind.RECTANGULAR:
            batch_of = dict(group.batches)
            padded = tuple(max((batch_of[j] for j in same_depth[index] if j in batch_of), default=0)
                           for index, _ in group.batches)
            group = replace(group, padded_by=padded)
        found.append(group)
    return tuple(found)


def _ragged_padding(graphs: Sequence[GraphDescriptor], infos: Sequence[GraphInfo],
                    same_depth: Sequence[tuple[int, ...]], group_of: Sequence[Group | None]) -> tuple[int, ...]:
    """``CatalogInfo.ragged_padded_by``: a ragged program whose row budget does not bind serves the best
    min(B, n) decoders of its (source, logical width) ranking, the cohort the rectangular programs of that
    ranking serve, so a dominating rectangular one of batch >= n does its work in a smaller shape (U12).
    A prefix-limit program whose rows do not bind takes every lane of that ranking at its full ceiling
    where every lane adds value (a vouched positive population), the same logical work again."""
    found = []
    for index, (graph, info) in enumerate(zip(graphs, infos)):
        batch = 0
        if graph.ragged or info.prefix_limit:
            batch = max((graphs[j].batch_capacity for j in same_depth[index]
                         if (group := group_of[j]) is not None and group.kind is GroupKind.RECTANGULAR
                         and (group.source, group.width) == (info.source, info.width)), default=0)
        found.append(batch)
    return tuple(found)


def _bounded_sources(bounded: Sequence[Group]) -> tuple[BoundedSource, ...]:
    sources: dict[str, list[Group]] = {}
    for group in bounded:
        sources.setdefault(group.source, []).append(group)
    return tuple(BoundedSource(source, min(g.width for g in members), tuple(members))
                 for source, members in sources.items())


def _siblings(groups: Sequence[Group]) -> dict[int, tuple[tuple[int, tuple[int, ...]], ...]]:
    """Per mixed group of a source and width with rectangular programs: those programs by batch capacity,
    ascending, as (batch, catalog indices)."""
    rectangular: dict[tuple, dict[int, list[int]]] = {}
    for group in groups:
        if group.kind is GroupKind.RECTANGULAR:
            for index, batch in group.batches:
                rectangular.setdefault((group.source, group.width), {}).setdefault(batch, []).append(index)
    return {
        group.number: tuple((b, tuple(ix)) for b, ix in sorted(rectangular[(group.source, group.width)].items()))
        for group in groups
        if group.kind is GroupKind.MIXED and (group.source, group.width) in rectangular
    }


def _split_groups(groups: Sequence[Group]) -> tuple[tuple[Group, ...], tuple[Group, ...]]:
    """(eager, bounded): see ``bounds.score_bounded``. Per proposal source, the rectangular and mixed
    groups of its narrowest logical width are eager (they give the first bound its base); the wider
    ones, and the ragged and prefix-limit speculative programs of a wider logical width, are bounded
    (a ragged or prefix-limit cohort is worth at most the rectangular value of its lanes at full
    width, ``candidates.generation_candidate``'s own bound)."""
    widths: dict[str, int] = {}
    for group in groups:
        if group.source is not None and group.kind.boundable:
            widths[group.source] = min(widths.get(group.source, group.width), group.width)
    bounded = [g for g in groups
               if g.source in widths and (g.kind.boundable or _ragged_generation(g)) and g.width > widths[g.source]]
    eager = tuple(g for g in groups if all(g is not b for b in bounded))
    return eager, tuple(sorted(bounded, key=lambda g: (g.source, g.width)))


def _draws(group: Group) -> bool:
    """Decode-only programs that draw proposals: rectangular, ragged and prefix-limit speculative ones."""
    return group.source is not None and not group.prefill_capacity and group.kind in (
        GroupKind.RECTANGULAR, GroupKind.ONE_BY_ONE)


def _ragged_generation(group: Group) -> bool:
    """Ragged and prefix-limit speculative programs (scored one by one; scored prefill has no source)."""
    return group.kind is GroupKind.ONE_BY_ONE and group.source is not None and not group.prefill_capacity


def _groups(graphs: Sequence[GraphDescriptor], infos: Sequence[GraphInfo]) -> tuple[Group, ...]:
    found: dict[tuple, list[int]] = {}
    for index, (g, info) in enumerate(zip(graphs, infos)):
        if g.kind in GENERATION_KINDS and not info.prefix_limit and not g.ragged:
            key = (GroupKind.RECTANGULAR, info.source, info.width, 0)
        elif g.kind is GraphKind.PREFILL:
            key = (GroupKind.PREFILL, None, 1, 0)  # one group: each member reads its capacity's ranking
        elif g.kind is GraphKind.MIXED:
            key = (GroupKind.MIXED, info.source, info.width, g.prefill_capacity)
        elif g.kind in GENERATION_KINDS or g.kind is GraphKind.SCORED_PREFILL:  # scored: its own prompters
            key = (GroupKind.ONE_BY_ONE, info.source, info.width, g.prefill_capacity)
        else:
            continue
        found.setdefault(key, []).append(index)
    return tuple(
        Group(*key, tuple(members), tuple((i, graphs[i].batch_capacity) for i in members), number)
        for number, (key, members) in enumerate(found.items())
    )


def _proposal_source(graph: GraphDescriptor) -> str | None:
    """Source whose acceptance prices the graph's rows; None for width-one rows."""
    if not graph.draws_proposals:
        return None
    return graph.proposal_source or "learned"


def _logical_width(graph: GraphDescriptor) -> int:
    if not graph.draws_proposals:
        return 1
    return min(graph.width, graph.proposal_depth + 1)
