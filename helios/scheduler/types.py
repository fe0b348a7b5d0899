"""The scheduler's request, plan and completion vocabulary.

The graph vocabulary it ranks (``GraphDescriptor``, ``GraphKind``, ``CostKey``)
is shared with the catalog writer and lives in ``flare_contract.graphs``.
Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable

from flare_contract.graphs import GraphDescriptor


# ---------------------------------------------------------------------------
# The scheduler's public request/plan/completion vocabulary (DESIGN.md,
# "Public interfaces"). The core may add fields; it must not remove these.
# ---------------------------------------------------------------------------

Fence = int
"""Monotonic id the engine gives each committed plan."""


class SelectionReason(str, Enum):
    ORDINARY = "ordinary"
    DISCOVERY = "discovery"
    TIMING_REFRESH = "timing_refresh"
    ACCEPTANCE_LEARNING = "acceptance_learning"


class LanePhase(str, Enum):
    PROMPT = "prompt"  # consumes uncached prompt tokens
    DECODE = "decode"  # produces output tokens (ordinary or speculative)
    RESTORE = "restore"  # binds a retained checkpoint row to this request (prerequisite, P1)
    SNAPSHOT = "snapshot"  # copies this request's committed state into a checkpoint row (K1-K3, P6)


@dataclass(frozen=True, slots=True)
class RequestHandle:
    """A request slot and the generation that owns it (a reused slot gets a new one)."""

    slot: int
    generation: int


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    """What the scheduler needs to know about a new request: numbers, no text."""

    prompt_tokens: int  # total prompt length
    max_tokens: int  # output limit
    context_limit: int  # prompt + output may not exceed this
    cached_tokens: int = 0  # prompt prefix already resident (earns no prompt service)
    endpoints: tuple[int, ...] = ()  # message/system boundaries inside the prompt
    proposal_sources: tuple[str, ...] = ()  # "learned", "copy": speculation allowed
    greedy: bool = True
    # State operations (issue 21; docs/checkpoints.md "Interface"):
    restore_row: int = -1  # >= 0: a retained checkpoint holding the first cached_tokens; restore runs first
    snapshot_points: tuple[int, ...] = ()  # K1 anchors (prompt lengths, best first) worth capturing
    terminal_snapshot: bool = False  # capture prompt + output when generation ends (P6)
    # Scored prefill (spec C1): the prompt runs only in SCORED_PREFILL programs, which return every
    # prompt position's logprob; max_tokens may then be 0 (the request ends when its prompt is consumed)
    scored_prompt: bool = False


@dataclass(slots=True)
class PlannedLane:
    """One active row of a plan: whose, which phase, how much work.

    Treat it as immutable once planned, like the rest of a ``ScheduledPlan``.
    It is not declared frozen because a decision builds up to 64 of them and
    a frozen dataclass's field-by-field initialisation cost four times as
    much (1.5 us against 0.4 us a lane on the development machine).
    """

    handle: RequestHandle
    phase: LanePhase
    prompt_start: int = 0  # first prompt position this lane consumes (prompt phase)
    prompt_tokens: int = 0  # prompt tokens consumed by this lane (prompt phase)
    query_length: int = 1  # target rows (decode phase; the pending token included)
    ceiling: int = 0  # prefix_limit lanes: immutable ceiling min(D + 1, W, limit)
    expected_tokens: float = 0.0  # committed tokens expected (for queue projection)
    finishes_prompt: bool = False  # the prompt ends in this lane: may publish a token
    checkpoint_row: int = -1  # restore: the row read; snapshot: -1, the engine binds a destination (K3)
    checkpoint_tokens: int = 0  # restore/snapshot: committed positions the copy covers

    @classmethod
    def decode_rows(cls, handles: Iterable[RequestHandle], query_lengths: Iterable[int],
                    expected_tokens: Iterable[float]) -> list["PlannedLane"]:
        """Decode lanes, one per (handle, query length, expected tokens), other fields at their defaults.

        Equal to ``PlannedLane(handle, LanePhase.DECODE, query_length=..., expected_tokens=...)``
        each, built without a call to the generated ``__init__`` per lane (a winner holds up
        to 64 lanes; the call was a third of their cost). Every field is set here: a field
        added to the class must be added here too (the tests compare both ways of building).
        """
        new, decode = object.__new__, LanePhase.DECODE
        lanes = []
        add = lanes.append
        for handle, length, expected in zip(handles, query_lengths, expected_tokens):
            lane = new(cls)
            lane.handle = handle
            lane.phase = decode
            lane.prompt_start = 0
            lane.prompt_tokens = 0
            lane.query_length = length
            lane.ceiling = 0
            lane.expected_tokens = expected
            lane.finishes_prompt = False
            lane.checkpoint_row = -1
            lane.checkpoint_tokens = 0
            add(lane)
        return lanes


@dataclass(slots=True, unsafe_hash=True)  # per-frame: not frozen (docs/runtime.md, "Per-frame records")
class PlanTrace:
    """What a plan looked like when it was chosen (spec A12), for traces and metrics.

    B/D/W/P are the physical program's; ``selected_cost_ns`` the duration
    estimate selection used (0 while unknown); ``observation_age_ns`` the time
    since that estimate's last valid sample (None while unknown). The two
    credits are the exploration balances at planning time, in ns (negative
    while an episode's overrun is being repaid).
    """

    batch_capacity: int
    proposal_depth: int
    width: int
    aggregate: int
    selected_cost_ns: int
    observation_age_ns: int | None
    reason: SelectionReason
    timing_refresh_credit_ns: float
    acceptance_learning_credit_ns: float


@dataclass(slots=True, unsafe_hash=True)  # per-frame: not frozen (docs/runtime.md, "Per-frame records")
class ScheduledPlan:
    """An immutable decision: the program, its lanes, and why (spec A6, A12)."""

    graph: GraphDescriptor
    lanes: tuple[PlannedLane, ...]
    reason: SelectionReason
    estimated_duration_ns: int  # 0 when the graph's duration is still unknown
    scaled_value_rate: float
    log_scale: float
    prefill_row: int | None = None  # index into ``lanes`` of the prompt row (mixed)
    requires_feedback: bool = True  # may not be queued behind other work
    trace: PlanTrace | None = None  # A12: physical shape, cost, age, reason and credit at planning

    def selection_value_rate(self) -> float:
        """Selection score after the decision's common positive scaling (spec U7)."""
        return self.scaled_value_rate

    def selection_log_scale(self) -> float:
        """Natural log of that decision's scaling factor (spec U7)."""
        return self.log_scale


@dataclass(slots=True, unsafe_hash=True)  # per-frame: not frozen (docs/runtime.md, "Per-frame records")
class CompletionRecord:
    """What the program did for one lane, as the executor reports it."""

    handle: RequestHandle
    prompt_consumed: int = 0
    tokens: tuple[int, ...] = ()  # committed output tokens: accepted drafts + bonus
    offered: int = 0  # draft positions verified for this lane (speculative rows)
    terminated: bool = False  # the model ended the request (EOS)
    confidence: tuple[float, ...] | None = None  # joint prefix probabilities (rank 0)
    survival: tuple[float, ...] | None = None  # completion_speculative_survival


@dataclass(slots=True, unsafe_hash=True)  # per-frame: not frozen (docs/runtime.md, "Per-frame records")
class ExecutionTiming:
    """Measured intervals of one executed frame (spec A3, D3)."""

    device_ns: int  # max positive rank-local device interval; 0 when missing
    wall_ns: int  # host: dispatch through observed completion
    readiness_delay_ns: int = 0  # exposed embedding-delivery delay, if measured


@dataclass(slots=True, unsafe_hash=True)  # per-frame: not frozen (docs/runtime.md, "Per-frame records")
class GeneratedToken:
    """Tokens a completion committed for one request, ready to detokenize."""

    handle: RequestHandle
    fence: Fence
    tokens: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | None
