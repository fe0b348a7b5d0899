"""State operations: bind and run the snapshot, restore and init programs (docs/checkpoints.md).

A state operation is a list of ``StateCopy`` records, one per row of the
program: a snapshot copies ``slot``'s committed state (its first ``tokens``
positions of KV, target and draft, the pending token, the committed length
and the token history) into checkpoint row ``row``; a restore copies row
``row`` into ``slot``; an init clears each listed slot's per-slot state
(``row`` and ``tokens`` unused). A copy with ``row`` -1 or ``tokens`` 0 is
inactive, as are the padding rows up to the program's batch capacity: they
mutate nothing.

``bind_state`` checks everything a copy depends on before the device runs it
(slots, rows, lengths, the slot's reserved pages, distinct destinations), so
a program never fails half-way through its rows; ``run_state`` runs the
program on the persistent state and checks that every row copied what was
bound (A2: a malformed output fails the operation before any result exists).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from flare_contract.graphs import GraphDescriptor, GraphKind
from helios.runtime.frame_outputs import FrameOutputError
from helios.scheduler.types import ExecutionTiming, LanePhase, ScheduledPlan

STATE_KINDS = (GraphKind.SNAPSHOT, GraphKind.RESTORE, GraphKind.INIT)


@dataclass(frozen=True, slots=True)
class StateCopy:
    """One row of a state program: request slot, checkpoint row, committed positions copied."""

    slot: int
    row: int = -1  # -1: inactive (e.g. a snapshot without an obtainable destination, K3)
    tokens: int = 0  # the slot's (snapshot) or the row's (restore) committed length; 0: inactive

    @property
    def active(self) -> bool:
        return self.row >= 0 and self.tokens > 0


@dataclass(frozen=True, slots=True)
class StoreShape:
    """What binding checks copies against: the store's rows and the cache's page size."""

    rows: int
    page_size: int

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor]) -> StoreShape:
        rows = state["checkpoint_pending"].shape[0] if "checkpoint_pending" in state else 0
        return cls(rows, state["k_cache"].shape[2] if "k_cache" in state else 1)


@dataclass(frozen=True, slots=True)
class BoundState:
    """A state operation bound to host tensors, ready for the device."""

    graph: GraphDescriptor
    copies: tuple[StateCopy, ...]  # row b of the program is copies[b]; later rows are padding
    inputs: Mapping[str, torch.Tensor]  # per-call inputs by name (no state)

    def expected(self) -> list[int]:
        """``copied_tokens`` (init: ``reset``) each row must report."""
        b = self.graph.batch_capacity
        if self.graph.kind is GraphKind.INIT:
            return [1] * len(self.copies) + [0] * (b - len(self.copies))
        return [c.tokens if c.active else 0 for c in self.copies] + [0] * (b - len(self.copies))


@dataclass(frozen=True, slots=True)
class StateResult:
    copies: tuple[StateCopy, ...]
    copied: tuple[int, ...]  # per copy: positions copied (init: 1 per reset slot); 0 for an inactive copy
    timing: ExecutionTiming


def state_copies(plan: ScheduledPlan, destinations: Mapping | None = None) -> tuple[StateCopy, ...]:
    """The copies of a plan's state lanes (``LanePhase.RESTORE``/``SNAPSHOT``); a snapshot lane's row is
    the destination the engine bound for its handle (K3), -1 (inactive) when there is none."""
    destinations = destinations or {}
    copies = []
    for lane in plan.lanes:
        if lane.phase not in (LanePhase.RESTORE, LanePhase.SNAPSHOT):
            raise ValueError(f"{plan.graph.id}: a {lane.phase.value} lane in a state program")
        row = lane.checkpoint_row if lane.phase is LanePhase.RESTORE else destinations.get(lane.handle, -1)
        copies.append(StateCopy(lane.handle.slot, row, lane.checkpoint_tokens))
    return tuple(copies)


def bind_state(graph: GraphDescriptor, copies: Sequence[StateCopy], page_table: torch.Tensor,
               store: StoreShape) -> BoundState:
    """The program inputs for ``copies`` (``page_table``: the host's, [slots, pages per slot])."""
    if graph.kind not in STATE_KINDS:
        raise ValueError(f"{graph.id}: a {graph.kind.value} program is not a state program")
    copies = tuple(copies)
    if len(copies) > graph.batch_capacity:
        raise ValueError(f"{graph.id}: {len(copies)} copies exceed B = {graph.batch_capacity}")
    slots = page_table.shape[0]
    wrong = [c.slot for c in copies if not 0 <= c.slot < slots]
    if wrong:
        raise ValueError(f"{graph.id}: slots {wrong} outside 0..{slots - 1}")
    if graph.kind is GraphKind.INIT:
        _distinct(graph, "slot", [c.slot for c in copies])
        return BoundState(graph, copies, _init_inputs(graph, copies))
    for copy in copies:
        if copy.active:
            _check_copy(graph, copy, page_table, store)
    active = [c for c in copies if c.active]
    _distinct(graph, "checkpoint row" if graph.kind is GraphKind.SNAPSHOT else "slot",
              [c.row if graph.kind is GraphKind.SNAPSHOT else c.slot for c in active])
    return BoundState(graph, copies, _copy_inputs(graph, copies, page_table))


def _check_copy(graph: GraphDescriptor, copy: StateCopy, page_table: torch.Tensor, store: StoreShape) -> None:
    if copy.row >= store.rows:
        raise ValueError(f"{graph.id}: checkpoint row {copy.row} outside the store's 0..{store.rows - 1}")
    capacity = page_table.shape[1] * store.page_size
    if copy.tokens > capacity:
        raise ValueError(f"{graph.id}: {copy.tokens} positions exceed a slot's {capacity}")
    blocks = -(-copy.tokens // store.page_size)
    if bool((page_table[copy.slot, :blocks] < 0).any()):
        raise ValueError(f"{graph.id}: slot {copy.slot} has no page for some of its first {copy.tokens} positions; "
                         "reserve them before a state copy")


def _distinct(graph: GraphDescriptor, what: str, values: list[int]) -> None:
    if len(set(values)) != len(values):
        raise ValueError(f"{graph.id}: two rows write one {what} ({values})")


def _copy_inputs(graph: GraphDescriptor, copies: tuple[StateCopy, ...], page_table: torch.Tensor) -> dict:
    b = graph.batch_capacity
    slots, rows, tokens = [0] * b, [-1] * b, [0] * b
    for index, copy in enumerate(copies):
        slots[index] = copy.slot
        rows[index], tokens[index] = (copy.row, copy.tokens) if copy.active else (-1, 0)
    return {"page_table": page_table, "row_slots": torch.tensor(slots, dtype=torch.int32),
            "checkpoint_rows": torch.tensor(rows, dtype=torch.int32),
            "checkpoint_tokens": torch.tensor(tokens, dtype=torch.int32)}


def _init_inputs(graph: GraphDescriptor, copies: tuple[StateCopy, ...]) -> dict:
    b = graph.batch_capacity
    slots = [c.slot for c in copies] + [0] * (b - len(copies))
    return {"row_slots": torch.tensor(slots, dtype=torch.int32),
            "active": torch.tensor([True] * len(copies) + [False] * (b - len(copies)))}


def run_state(executor, bound: BoundState, dispatched_ns: int) -> StateResult:
    """Run ``bound`` on ``executor``'s persistent state; wall time counts from ``dispatched_ns``."""
    program = executor.program_for(bound.graph.id)
    inputs = {name: t.to(executor.device, non_blocking=True) for name, t in bound.inputs.items()}
    outputs, device_ns = executor._timed_call(program, {**inputs, **executor.state})
    name = "reset" if bound.graph.kind is GraphKind.INIT else "copied_tokens"
    if name not in outputs:
        raise FrameOutputError(f"{bound.graph.id}: the program returned no {name!r}")
    reported = [int(v) for v in outputs[name].to("cpu").tolist()]
    if reported != bound.expected():
        raise FrameOutputError(f"{bound.graph.id}: rows report {reported} but {bound.expected()} were bound")
    wall_ns = max(0, time.monotonic_ns() - dispatched_ns)
    timing = ExecutionTiming(device_ns=max(device_ns, 1), wall_ns=wall_ns)
    return StateResult(bound.copies, tuple(reported[: len(bound.copies)]), timing)
