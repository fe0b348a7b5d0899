"""Graph descriptors: the vocabulary a catalog's writer and its reader share.

A ``GraphDescriptor`` names one prepared physical program by its fixed
capacities. ``ignition``'s capacity planner emits them, the catalog stores
them, ``helios``'s scheduler ranks them. Plain data: nothing here imports
torch, and nothing here imports either side.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class GraphKind(str, Enum):
    """Families of prepared programs (spec checklist C1)."""

    PREFILL = "prefill"
    SCORED_PREFILL = "scored_prefill"
    DECODE = "decode"
    SPECULATIVE = "speculative"
    MIXED = "mixed"
    VISION = "vision"
    SNAPSHOT = "snapshot"
    RESTORE = "restore"
    INIT = "init"


class ValueSource(str, Enum):
    """Who allocates a speculative program's target rows (spec S1/S2)."""

    QUERY_LENGTH = "query_length"  # host fixes per-lane lengths before proposals
    PREFIX_LIMIT = "prefix_limit"  # host gives ceilings; the device allocates within P


GENERATION_KINDS = frozenset({GraphKind.DECODE, GraphKind.SPECULATIVE})
"""Kinds allowed to occupy both frame slots (spec A7)."""


@dataclass(frozen=True, slots=True)
class CostKey:
    """Identity of a duration estimate (spec D1): active rows never change it."""

    kind: GraphKind
    batch_capacity: int
    token_capacity: int
    proposal_depth: int
    prefill_capacity: int
    aggregate: int


@dataclass(frozen=True, slots=True)
class GraphDescriptor:
    """One prepared fixed-shape program.

    batch_capacity   B: physical request rows.
    proposal_depth   D: proposal positions the program produces (0 for width one).
    width            W: target positions per row, the pending token included
                     (the mixed contract's ``token_capacity``). 1 for plain decode.
    aggregate        P: total target rows; rectangular programs have P = B * W.
    prefill_capacity prompt tokens (prefill, scored prefill, mixed); 0 otherwise.
    ragged           target rows packed by per-lane lengths summing to <= P.
    value_source     for speculative/mixed programs with W > 1: who allocates rows.
    proposal_source  "learned" (draft model) or "copy" (prompt lookup), if any.
    speculation_enabled  width-one decode/mixed variants that maintain draft state.
    confidence_width equals D for confidence-producing programs, else 0 (C12).
    estimated_duration_ns  always written as 0; the runtime learns durations (C11).
    """

    id: str
    kind: GraphKind
    batch_capacity: int
    proposal_depth: int = 0
    width: int = 1
    aggregate: int = 0
    prefill_capacity: int = 0
    ragged: bool = False
    value_source: ValueSource | None = None
    proposal_source: str | None = None
    speculation_enabled: bool = False
    confidence_width: int = 0
    estimated_duration_ns: int = 0

    def __post_init__(self) -> None:
        if self.batch_capacity < 1:
            raise ValueError(f"{self.id}: batch_capacity must be >= 1, got {self.batch_capacity}")
        if self.width < 1:
            raise ValueError(f"{self.id}: width must be >= 1, got {self.width}")
        if self.aggregate < 0 or self.prefill_capacity < 0 or self.proposal_depth < 0:
            raise ValueError(f"{self.id}: capacities must be nonnegative")
        if not self.ragged and self.aggregate not in (0, self.batch_capacity * self.width):
            raise ValueError(
                f"{self.id}: rectangular programs need P = B * W "
                f"({self.batch_capacity * self.width}), got {self.aggregate}"
            )

    @property
    def target_rows(self) -> int:
        """P, with rectangular programs defaulting to B * W."""
        return self.aggregate or self.batch_capacity * self.width

    @property
    def max_packed_tokens(self) -> int:
        """Packed token extent (spec C10): prompt row plus the other rows' widths."""
        if self.prefill_capacity and self.kind is GraphKind.MIXED:
            return self.prefill_capacity + (self.batch_capacity - 1) * self.width
        if self.prefill_capacity:
            return self.prefill_capacity
        return self.target_rows

    @property
    def is_prefix_limit(self) -> bool:
        """The device allocates this program's target rows within P (spec S2)."""
        return self.value_source is ValueSource.PREFIX_LIMIT and self.proposal_depth > 0 and self.width > 1

    @property
    def draws_proposals(self) -> bool:
        """Rows wider than the pending token need proposals from some source (spec S4)."""
        return self.proposal_depth > 0 and self.width > 1

    def cost_key(self) -> CostKey:
        return CostKey(
            kind=self.kind,
            batch_capacity=self.batch_capacity,
            token_capacity=self.width,
            proposal_depth=self.proposal_depth,
            prefill_capacity=self.prefill_capacity,
            aggregate=self.target_rows,
        )
