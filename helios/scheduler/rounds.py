"""Speculative round candidates (spec "Speculative graph coverage"; S1-S4, A11).

How many target rows a decode lane may use in one complete speculative
program, and what it may reserve and advance while queued. Pure integer
arithmetic; acceptance estimates and prices come from elsewhere. Which
rounds are prefix-limit and which draw proposals are properties of the
``GraphDescriptor`` itself.
"""

from __future__ import annotations

from typing import Sequence

from flare_contract.graphs import GraphDescriptor


def query_length(graph: GraphDescriptor, room: int) -> int:
    """Host-fixed target rows of a lane (S1): the full prefix, shortened only by limits.

    The pending token needs one row; the program proposes at most D positions,
    so D + 1 rows can ever be verified.
    """
    return max(1, min(graph.width, graph.proposal_depth + 1, room))


def prefix_ceiling(graph: GraphDescriptor, room: int) -> int:
    """Immutable per-lane ceiling of a prefix-limit program: min(D + 1, W, limit) (S2)."""
    return max(1, min(graph.proposal_depth + 1, graph.width, room))


def queued_advance(ceiling: int, graph: GraphDescriptor) -> int:
    """Most tokens a queued speculative lane can commit: min(ceiling, P) (A11)."""
    return min(ceiling, graph.target_rows)


def reservation_rows(ceilings: Sequence[int], draft_extent: int) -> int:
    """Cache positions a prefix-limit round pins: every ceiling plus draft storage (S3).

    Ceilings may sum above P, and the reservation still covers all of them
    because the device, not the host, decides which lanes grow.
    """
    if draft_extent < 0:
        raise ValueError(f"draft_extent must be >= 0, got {draft_extent}")
    return sum(ceilings) + draft_extent
